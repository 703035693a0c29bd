"""Sharded training for real, on 2 CPU processes with gloo: FSDP2, FSDP1 and tensor parallelism.

FSDP2 (``fully_shard``, DTensor gradients) goes through Lightning's
``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``; FSDP1 (flat shards,
``use_orig_params=True``) through Lightning's ``FSDPStrategy``, let onto the CPU; tensor
parallelism (``parallelize_module``) through ``ModelParallelStrategy`` too. The reference is the
same model, whole, in one process, on the same global batches (tests/_fsdp_run.py).
"""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.helpers import events

pytestmark = pytest.mark.slow  # 2-process FSDP/TP runs and FSDP set-ups in new interpreters

HERE = os.path.dirname(os.path.abspath(__file__))


KINDS = ["fsdp2", "fsdp1"]


def _run(out, mode, devices=2, kind="fsdp2"):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "_fsdp_run.py"), str(out), mode, str(devices), kind],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.load(open(out / f"rank{r}.json")) for r in range(devices)]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    return out, _run(out, "figures", devices=1)


@pytest.fixture(scope="module")
def sharded_figures(tmp_path_factory):
    """The ``figures`` run of a kind of sharding, made once for the module."""
    made = {}

    def run(kind):
        if kind not in made:
            out = tmp_path_factory.mktemp(kind)
            made[kind] = out, _run(out, "figures", kind=kind)
        return made[kind]

    return run


@pytest.fixture(scope="module", params=[*KINDS, "tp"])
def figures(request, sharded_figures, whole):
    return sharded_figures(request.param), whole


def _compared(tag, figures):
    """Whether ``tag`` should equal the one-process run's: under tensor parallelism, gradients only.

    Each tensor-parallel rank's activations are its local output, and a replicated output
    counts once per rank (see test_tensor_parallel_activations_count_a_replicated_output_per_rank).
    """
    (sharded, _), _ = figures
    return not (sharded.name.startswith("tp") and tag.startswith("activations/"))


#: Some of each rank's local shapes: FSDP2 splits each tensor on dim 0, FSDP1 each Linear's
#: weight and bias as one flat vector (144 values of Linear(8, 16): 72 a rank, all of the bias on
#: rank 1), and the PReLU's weight in the root unit's.
LOCAL_SHAPES = {"fsdp2": [{"net.0.weight": [8, 8]}, {"net.0.weight": [8, 8], "net.3.bias": [0]}],
                "fsdp1": [{"net.0.weight": [72], "net.0.bias": [0], "net.1.weight": [8]},
                          {"net.0.weight": [56], "net.0.bias": [16], "net.1.weight": [8]}],
                "tp": [{"net.0.weight": [8, 8], "net.1.weight": [16], "net.3.weight": [1, 3], "net.3.bias": [1]}] * 2}


def test_the_run_really_is_sharded(figures, request):
    (_, ranks), _ = figures
    kind = request.node.callspec.params["figures"]
    for rank, shapes in zip(ranks, LOCAL_SHAPES[kind]):
        assert {name: rank["local_shapes"][name] for name in shapes} == shapes


def test_every_scalar_equals_the_whole_model_in_one_process(figures):
    (sharded, _), (whole, _) = figures
    a, b = events(str(sharded)), events(str(whole))
    tags = set(b.Tags()["scalars"])
    assert set(a.Tags()["scalars"]) == tags
    assert {"gradients/net.0.weight/norm", "gradients/total_norm", "gradients/net.3.bias/std",
            "updates/net.0.weight/ratio"} <= tags
    for tag in filter(lambda tag: _compared(tag, figures), tags):
        got, want = [e.value for e in a.Scalars(tag)], [e.value for e in b.Scalars(tag)]
        assert len(got) == len(want) == 4, tag
        for g, w in zip(got, want):
            assert (math.isnan(g) and math.isnan(w)) or g == pytest.approx(w, rel=1e-5, abs=1e-7), tag


def test_every_histogram_bin_equals_the_whole_model_in_one_process(figures):
    (sharded, _), (whole, _) = figures
    a, b = events(str(sharded)), events(str(whole))
    tags = b.Tags()["histograms"]
    assert "gradients/net.0.weight" in tags and "activations/net.1" in tags
    for tag in filter(lambda tag: _compared(tag, figures), tags):
        got = [list(e.histogram_value.bucket) for e in a.Histograms(tag)]
        assert got == [list(e.histogram_value.bucket) for e in b.Histograms(tag)], tag


def test_scaling_and_clipping_by_the_whole_norm_train_as_in_one_process(figures):
    (_, ranks), (_, [whole]) = figures
    for rank in ranks:
        for name, values in whole["params"].items():
            assert rank["params"][name] == pytest.approx(values, abs=1e-6), name


def test_tensor_parallel_activations_count_a_replicated_output_per_rank(sharded_figures, whole):
    a, b = events(str(sharded_figures("tp")[0])), events(str(whole[0]))

    def counts(run, module):
        return [e.value for e in run.Scalars(f"activations/{module}/count")]

    assert counts(a, "net.2") == counts(b, "net.2")  # split by columns: each rank's part, once
    assert counts(a, "net.0") == [2 * c for c in counts(b, "net.0")]  # replicated: once per rank


@pytest.fixture(scope="module", params=KINDS)
def skipped_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("nan")
    return out, _run(out, "nan", kind=request.param)


@pytest.fixture(scope="module")
def skipped(skipped_run):
    return skipped_run[1]


def test_a_skipped_update_has_no_update_ratio(skipped_run):
    out, _ = skipped_run
    for tag in ("updates/net.0.weight/ratio", "updates/net.3.bias/ratio"):  # FSDP1 gives rank 0 none of net.3.bias
        assert [e.step for e in events(str(out)).Scalars(tag)] == [0, 1, 3], tag


def test_a_nan_on_one_rank_is_skipped_on_both_and_traced_to_its_module(skipped):
    assert [r["global_step"] for r in skipped] == [4, 4]
    assert skipped[0]["params"] == skipped[1]["params"]
    assert all(math.isfinite(v) for values in skipped[0]["params"].values() for v in values)
    for rank in skipped:
        assert "at step 2" in rank["report"] and "module 'net.0' on rank 1" in rank["report"]
        assert "net.0.weight" in rank["report"]  # names are the user's, not FSDP's


def test_each_check_is_one_sum_over_the_shards_one_agreement_and_one_transfer(skipped):
    for rank in skipped:
        assert sorted(rank["monitor_calls"]) == sorted(rank["calls"])
        for step, calls in rank["calls"].items():
            if step != "2":  # the reported step also gathers the provenance
                # The stopper measures the step for the GradientMonitor beside it too: the monitor's
                # sharded stat rows join the check (one all_gather), and the monitor adds nothing.
                assert calls == {"all_reduce": 2, "all_gather": 1, "cpu": 1}, step
                assert rank["monitor_calls"][step] == {}, step


@pytest.mark.parametrize("kind", KINDS)
def test_a_nan_on_one_rank_stops_both_at_the_same_step(tmp_path, kind):
    ranks = _run(tmp_path, "stop", kind=kind)
    assert [r["global_step"] for r in ranks] == [3, 3]
    assert ranks[0]["params"] == ranks[1]["params"]
    assert all(math.isfinite(v) for values in ranks[0]["params"].values() for v in values)


def test_an_fsdp1_parameter_the_step_did_not_use_has_an_empty_row_on_every_rank(tmp_path):
    ranks = _run(tmp_path, "unused", kind="fsdp1")
    assert [r["global_step"] for r in ranks] == [4, 4]
    assert [r["local_shapes"]["spare.weight"] for r in ranks] == [[3], [0]]  # rank 1 holds none of it
    assert [e.value for e in events(str(tmp_path)).Scalars("gradients/spare.weight/norm")] == [0.0] * 4


FSDP1_MODEL = """
import os, sys, warnings, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
sys.path.insert(0, {root!r})
from lightning_hooks import GradientMonitor
from lightning_hooks.core.selection import select_modules
from lightning_hooks.measure._sharding import SHARD_GROUP_ATTRIBUTE, note_flat_shards
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
dist.init_process_group("gloo", rank=0, world_size=1)
cpu = torch.device("cpu")


def model(where, orig):
    if where == "nested":  # one unit inside the model
        return nn.Sequential(FSDP(nn.Linear(4, 4), device_id=cpu, use_orig_params=orig), nn.Linear(4, 1))
    return FSDP(nn.Sequential(nn.Linear(4, 1)), device_id=cpu, use_orig_params=orig).module  # the root unit's


for where in ("nested", "root"):
    for orig in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            GradientMonitor().attach(model(where, orig))
        found = " | ".join(str(w.message) for w in caught if "FSDP1" in str(w.message))
        print(f"WARNED {{where}}-{{'orig' if orig else 'flat'}}:" + found)
kept, ignored = nn.Linear(4, 4), nn.Linear(4, 1)
note_flat_shards(FSDP(nn.Sequential(kept, ignored), device_id=cpu, use_orig_params=True, ignored_states=[ignored]))
print("MARKED", [hasattr(p, SHARD_GROUP_ATTRIBUTE) for p in (*kept.parameters(), *ignored.parameters())])
for orig in (False, True):
    unit = FSDP(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), device_id=cpu, use_orig_params=orig)
    leaf = FSDP(nn.Linear(4, 1), device_id=cpu, use_orig_params=orig)
    print(f"SELECTED {{'orig' if orig else 'flat'}}:", [n for n, _ in select_modules(nn.Sequential(unit, leaf), None)])
dist.destroy_process_group()
"""


def _fsdp1_one_process():
    code = FSDP1_MODEL.format(root=os.path.dirname(HERE))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_fsdp1_without_use_orig_params_gets_a_warning_that_figures_are_of_flat_parameters():
    warned = dict(line[len("WARNED "):].split(":", 1) for line in _fsdp1_one_process() if line.startswith("WARNED"))
    for case in ("nested-flat", "root-flat"):  # the root unit's flat parameter sits on the model itself
        assert "flat parameter" in warned[case] and "use_orig_params=True" in warned[case], case
    assert warned["nested-orig"] == warned["root-orig"] == ""  # Lightning's default: nothing to warn of


def test_fsdp1_parameters_it_ignores_are_not_marked_as_split():
    marked = next(line for line in _fsdp1_one_process() if line.startswith("MARKED"))
    assert marked == "MARKED [True, True, False, False]"  # whole on every rank: never summed


def test_fsdp1_the_default_selection_takes_no_unit_for_its_flat_parameter():
    lines = [line[len("SELECTED "):] for line in _fsdp1_one_process() if line.startswith("SELECTED")]
    selected = dict(line.split(": ", 1) for line in lines)
    # Without use_orig_params the unit's Sequential owns `_flat_param` and its Linears hold none: not a layer.
    assert selected == {"flat": "['0.1', '1']", "orig": "['0.0', '0.1', '0.2', '1']"}
