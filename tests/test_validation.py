"""Argument checks: one place, one rule (TypeError for a wrong type, ValueError for a wrong value), one message form."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lightning_hooks import (
    ActivationMonitor,
    FeatureExtractor,
    GradientAnomalyStopping,
    GradientMonitor,
    LayerHealth,
)
from lightning_hooks.core._validation import (
    MAX_WINDOW,
    check_bool,
    check_choice,
    check_int,
    check_names,
    check_number,
    check_path,
)
from lightning_hooks.measure.stats import MAX_BINS

#: Every bool flag of every callback.
FLAGS = [
    (ActivationMonitor, "histogram"), (ActivationMonitor, "inputs"),
    *[(GradientMonitor, f) for f in ("histogram", "check_finite", "provenance", "prog_bar", "update_ratio")],
    *[(GradientAnomalyStopping, f) for f in ("check_finite", "provenance", "prog_bar")],
]

#: Every "positive int or None" argument: (callback, argument, other arguments it needs).
OPTIONAL_COUNTS = [
    (ActivationMonitor, "log_every_n_steps", {}), (ActivationMonitor, "max_rows", {}),
    (GradientMonitor, "log_every_n_steps", {}), (GradientMonitor, "max_rows", {}),
    (GradientAnomalyStopping, "rollback_every_n_steps", {"action": "rollback"}),
]


@pytest.mark.parametrize(("callback", "flag"), FLAGS)
@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_flag_that_is_not_a_bool_is_a_type_error_everywhere(callback, flag, value):
    """Every flag, `check_finite` included, raises TypeError for a value that is not a bool."""
    with pytest.raises(TypeError, match=rf"^`{flag}` must be a bool, got {value!r} \(\w+\): pass {flag}=True or"):
        callback(**{flag: value})


@pytest.mark.parametrize(("callback", "argument", "needs"), OPTIONAL_COUNTS)
def test_a_positive_int_or_none_is_checked_the_same_everywhere(callback, argument, needs):
    for wrong_type in (2.0, "5", True):
        with pytest.raises(TypeError, match=rf"^`{argument}` must be a positive int.* or None.*, got {wrong_type!r}"):
            callback(**needs, **{argument: wrong_type})
    with pytest.raises(ValueError, match=rf"^`{argument}` must be a positive int.* or None.*, got 0: pass {argument}="):
        callback(**needs, **{argument: 0})
    callback(**needs, **{argument: None})  # None is allowed
    callback(**needs, **{argument: 3})


def test_layer_health_and_feature_extractor_counts_follow_the_same_rule(tmp_path: Path):
    with pytest.raises(TypeError, match=r"`top_k` must be a positive int, got 2\.0 \(float\): pass e\.g\. top_k=1"):
        LayerHealth(top_k=2.0)
    with pytest.raises(ValueError, match=r"`top_k` must be a positive int, got 0: pass top_k=1 or more"):
        LayerHealth(top_k=0)
    with pytest.raises(TypeError, match=r"`embedding_samples` must be a non-negative int, got '5' \(str\)"):
        FeatureExtractor("net.0", dirpath=tmp_path, embedding_samples="5")
    with pytest.raises(ValueError, match=r"`embedding_samples` must be a non-negative int, got -1: pass"):
        FeatureExtractor("net.0", dirpath=tmp_path, embedding_samples=-1)


@pytest.mark.parametrize(
    ("call", "kind", "message"),
    [
        (lambda: check_bool("histogram", 0), TypeError,
         "`histogram` must be a bool, got 0 (int): pass histogram=True or histogram=False"),
        (lambda: check_int("window", 0), ValueError, "`window` must be a positive int, got 0: pass window=1 or more"),
        (lambda: check_int("window", 2, low=3), ValueError,
         "`window` must be an int of at least 3, got 2: pass window=3 or more"),
        (lambda: check_int("skip", 1.0, low=0), TypeError,
         "`skip` must be a non-negative int, got 1.0 (float): pass e.g. skip=1"),
        (lambda: check_int("max_rows", "9", optional=True, none_means="no limit"), TypeError,
         "`max_rows` must be a positive int, or None for no limit, got '9' (str): pass e.g. max_rows=1"),
        (lambda: check_number("norm_threshold", math.nan, 0.0, optional=True), ValueError,
         "`norm_threshold` must be a finite number > 0 or None, got nan: pass e.g. norm_threshold=1"),
        (lambda: check_number("norm_threshold", "1e3", 0.0), TypeError,
         "`norm_threshold` must be a finite number > 0, got '1e3' (str): pass a number, e.g. norm_threshold=1"),
        (lambda: check_number("share", 2.0, 0.0, high=1.0), ValueError,
         "`share` must be a number in (0, 1], got 2.0: pass e.g. share=1"),
        (lambda: check_choice("action", "halt", ("stop", "skip")), ValueError,
         "`action` must be one of ['stop', 'skip'], got 'halt'"),
        (lambda: check_choice("action", 1, ("stop", "skip")), TypeError,
         "`action` must be one of ['stop', 'skip'], got 1 (int)"),
        (lambda: check_names("stages", ["train", "fitting"], ("train", "validate"), what="stage"), ValueError,
         "unknown stage(s) ['fitting'] in `stages`; choose from ['train', 'validate']"),
        (lambda: check_names("stages", [], ("train",)), ValueError,
         "`stages` is empty: name at least one of ['train']"),
        (lambda: check_names("stages", 3, ("train",)), TypeError,
         "`stages` must be a list of names from ['train'], got 3 (int)"),
        (lambda: check_path("dirpath", 3, optional=True), TypeError,
         "`dirpath` must be a directory path or None, got 3 (int): pass a str or an os.PathLike"),
        (lambda: check_path("dirpath", "", optional=True), ValueError,
         "`dirpath` is empty: pass a directory, or None to save nothing"),
    ],
)
def test_each_message_says_what_was_given_what_is_expected_and_how_to_fix_it(call, kind, message):
    with pytest.raises(kind) as caught:
        call()
    assert str(caught.value) == message


def test_values_that_fit_pass_and_a_bare_name_is_a_list_of_one():
    check_bool("x", False)
    check_int("x", 0, low=0)
    check_int("x", None, optional=True)
    check_number("x", 1e-3, 0.0)
    check_number("x", 0.0, 0.0, strict=False)
    check_path("x", Path("out"))
    assert check_names("stages", "train", ("train", "validate")) == ("train",)


#: Sizes that must fit in memory, bounded at construction: (callback, arguments).
HUGE = [
    *[(cls, {"window": 10**30}) for cls in (GradientMonitor, GradientAnomalyStopping, LayerHealth)],
    *[(cls, {"bins": bins}) for cls in (ActivationMonitor, GradientMonitor) for bins in (10**6, 10**12)],
]


@pytest.mark.parametrize(("callback", "arguments"), HUGE)
def test_a_window_or_bin_count_too_large_to_hold_fails_at_construction_not_in_fit(callback, arguments):
    ((name, value),) = arguments.items()
    limit = MAX_WINDOW if name == "window" else MAX_BINS
    with pytest.raises(ValueError, match=rf"`{name}` must be at most {limit}, got .*: pass {name}={limit} or less"):
        callback(**arguments)
    callback(**{name: limit})  # the bound itself is accepted


def test_a_huge_int_is_described_by_its_size_and_edges_are_bounded_as_bins():
    with pytest.raises(ValueError, match=r"^`window` must be at most 100000, got an int of about 5001 digits"):
        check_int("window", 10**5000, high=MAX_WINDOW)  # its repr would be refused (over 4300 digits)
    with pytest.raises(ValueError, match=r"at most 4097 numbers \(4096 bins\), got 5000"):
        ActivationMonitor(bins=[float(i) for i in range(5000)])
