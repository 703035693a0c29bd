"""UpdateTransform: the update itself scaled, capped and clipped, for any optimizer."""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_hooks import GradientMonitor, GradientTransform, UpdateTransform
from lightning_hooks.callbacks import _step_copies as step_copies_module
from lightning_hooks.callbacks._step_copies import step_copies
from lightning_hooks.callbacks._update_step import NormHistory
from lightning_hooks.measure import _update_passes as passes
from tests.helpers import csv_metrics, trainer
from tests.update_helpers import BackboneHead, Updates, data, fit, largest_difference


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_scale_is_the_param_groups_lr_multiplied_over_50_steps(tmp_path, optimizer):
    scaled = fit(tmp_path, BackboneHead(optimizer), [UpdateTransform(scale={"backbone": 0.1})])
    reference = fit(tmp_path, BackboneHead(optimizer, backbone_lr=0.1))
    plain = fit(tmp_path, BackboneHead(optimizer))
    assert largest_difference(scaled, reference) < 5e-6  # float32 rounding over 50 steps
    assert largest_difference(plain, reference) > 1e-2  # and the lr does change the run


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_in_float64_the_match_is_to_rounding(tmp_path, optimizer):
    scaled = fit(tmp_path, BackboneHead(optimizer, dtype=torch.float64), [UpdateTransform(scale={"backbone.*": 0.1})])
    reference = fit(tmp_path, BackboneHead(optimizer, backbone_lr=0.1, dtype=torch.float64))
    assert largest_difference(scaled, reference) < 1e-12


def test_scale_with_gradient_accumulation_is_the_lr_multiplied(tmp_path):
    scaled = fit(tmp_path, BackboneHead("adamw"), [UpdateTransform(scale={"backbone": 0.1})], steps=25,
                 accumulate_grad_batches=2)
    reference = fit(tmp_path, BackboneHead("adamw", backbone_lr=0.1), steps=25, accumulate_grad_batches=2)
    assert largest_difference(scaled, reference) < 5e-6


def test_max_ratio_caps_each_selected_parameter_and_only_those(tmp_path):
    updates = Updates()
    fit(tmp_path, BackboneHead("adamw"), [UpdateTransform(max_ratio={"backbone.0": 1e-3}), updates], steps=20)
    for name in ("backbone.0.weight", "backbone.0.bias"):
        ratios = updates.ratios(name)
        assert max(ratios) <= 1e-3 * (1 + 1e-4) and min(ratios) > 0.99e-3  # capped at every step: it binds
    assert max(updates.ratios("backbone.2.weight")) > 3e-3  # not selected: uncapped


@pytest.mark.parametrize("with_ratios", [False, True])  # True: the copy is shared, the rewrite is in the parameters
def test_max_ratio_caps_float64_parameters_too(tmp_path, with_ratios):
    updates = Updates()
    monitor = [GradientMonitor(update_ratio=True, log_every_n_steps=1, histogram=False)] if with_ratios else []
    fit(tmp_path, BackboneHead("adamw", dtype=torch.float64),
        [UpdateTransform(max_ratio={"backbone.0": 1e-3}), *monitor, updates], steps=10)
    ratios = updates.ratios("backbone.0.weight")
    assert max(ratios) <= 1e-3 * (1 + 1e-6) and min(ratios) > 0.99e-3  # capped in float64 too (it raised before)


def test_clip_to_history_bounds_a_spike_by_the_norms_before_it(tmp_path):
    x = torch.randn(240, 8, generator=torch.Generator().manual_seed(1))
    y = x[:, :1].clone()
    y[200:208] *= 100  # step 25's batch: a loss spike
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    updates, transform = Updates(), UpdateTransform(clip_to_history="*", history_window=16, history_sigmas=3.0)
    fit(tmp_path, BackboneHead("sgd"), [transform, updates], steps=26, loader=loader)
    history = transform._rewrite.histories[0]
    spike = (history.index - 1) % 16  # the last norm remembered: step 25's, unclipped
    before = torch.cat([history.norms[0, :spike], history.norms[0, spike + 1:]])
    bound = (before.mean() + 3 * before.std(unbiased=False)).item()
    assert history.norms[0, spike].item() > 20 * bound  # the spike as the optimizer made it
    assert updates.norms()[25] == pytest.approx(bound, rel=2e-3)  # clipped to the bound of the 16 before it (float32)
    assert max(updates.norms()[:25]) < 3 * bound


def test_history_waits_for_half_its_window_and_keeps_unclipped_finite_norms():
    history = NormHistory(groups=1, window=8, sigmas=2.0)
    for norm in (1.0, 2.0, 3.0):
        assert history.clip(torch.tensor([100.0 * norm])).item() == 1.0  # fewer than 4 norms: no clip
    history = NormHistory(groups=2, window=8, sigmas=2.0)
    for norm in (1.0, 2.0, 3.0, 4.0):
        history.clip(torch.tensor([norm, 1.0]))
    factor = history.clip(torch.tensor([10.0, float("nan")]))
    assert factor[0].item() == pytest.approx((2.5 + 2 * math.sqrt(1.25)) / 10)
    norms = history.norms
    assert norms[0, 4].item() == 10.0 and torch.isnan(norms[1, 4])  # unclipped kept, non-finite not


def test_two_instances_in_one_trainer_compose_and_keep_their_own_state(tmp_path):
    halve = UpdateTransform(scale={"backbone": 0.5})
    fifth = UpdateTransform(scale={"backbone": 0.2}, clip_to_history="backbone", history_window=4, history_sigmas=1e6)
    model = BackboneHead("adamw")
    run = trainer(tmp_path, [halve, fifth], max_steps=20, logger=False)
    run.fit(model, data())
    reference = fit(tmp_path, BackboneHead("adamw", backbone_lr=0.1), steps=20)
    assert largest_difference({k: p.detach() for k, p in model.named_parameters()}, reference) < 5e-6
    assert halve.state_key != fifth.state_key and halve.state_key.startswith("UpdateTransform{")
    run.save_checkpoint(tmp_path / "two.ckpt")
    saved = torch.load(tmp_path / "two.ckpt", weights_only=False)["callbacks"]
    assert saved[halve.state_key] == {"histories": {}}
    assert saved[fifth.state_key]["histories"][0]["index"] == 20 % 4


def test_the_history_survives_a_checkpoint_and_refuses_another_shape():
    history = NormHistory(groups=1, window=4, sigmas=2.0)
    history.clip(torch.tensor([3.0]))
    transform = UpdateTransform(clip_to_history="*", history_window=4)
    transform._rewrite.histories[0] = history
    restored = UpdateTransform(clip_to_history="*", history_window=4)
    restored.load_state_dict(transform.state_dict())
    assert restored._rewrite.histories[0].norms[0, 0].item() == 3.0 and restored._rewrite.histories[0].index == 1
    with pytest.raises(ValueError, match="history_window"):
        UpdateTransform(clip_to_history="*", history_window=8).load_state_dict(transform.state_dict())


@pytest.mark.parametrize("config", ["scale", "scale + max_ratio + clip_to_history"])
def test_the_step_hooks_allocate_one_copy_of_the_selected_parameters_and_a_few_figures(config):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    benchmark = importlib.import_module("update_transform")
    allocated, selected = benchmark.hook_bytes(benchmark.CONFIGS[config])  # counted by a TorchDispatchMode
    assert selected > 10 * 2**20 and selected <= allocated < selected + 2**14
    # Beside update ratios of every parameter: one copy of all of them serves both.
    allocated, every = benchmark.hook_bytes(benchmark.CONFIGS[config], ratios=True)
    assert every >= selected and every <= allocated < every + 2**16


class CopiesPerStep(L.Callback):
    """The elements copied into the optimizer's step copies at each step (``copies_of`` counted)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: list[int] = []
        original = step_copies_module.copies_of

        def counting(params: list[torch.Tensor], spares: list[Any], *args: Any) -> Any:
            self.counts[-1] += sum(param.numel() for param in params)
            return original(params, spares, *args)

        monkeypatch.setattr(step_copies_module, "copies_of", counting)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.counts.append(0)


def test_one_copy_of_the_selected_parameters_a_step_and_no_hook_left_after_fit(tmp_path, monkeypatch):
    transform = UpdateTransform(scale={"head": 0.5}, max_ratio={"head": 0.1})
    copies = CopiesPerStep(monkeypatch)
    model = BackboneHead("adam")
    fit(tmp_path, model, [transform, copies], steps=3)
    assert copies.counts == [17, 17, 17]  # the head's 16 weights and 1 bias, once a step
    optimizer = model.trainer.optimizers[0]
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    shared = step_copies(optimizer)  # nothing held, no memory kept for a next step, after the fit
    assert shared.numel == 0 and shared.spare_numel == 0 and not transform._rewrite._holding


@pytest.mark.parametrize("config", [dict(scale={"head": 0.5}, max_ratio={"head": 1e-3}), dict(scale={"head": 0.5})])
def test_with_update_ratios_one_copy_a_step_serves_both_and_the_ratio_is_of_the_changed_update(
        tmp_path, monkeypatch, config):
    """GradientMonitor(update_ratio=True) beside UpdateTransform: the parameters copied once a step, not twice."""
    copies, updates = CopiesPerStep(monkeypatch), Updates()
    monitor = GradientMonitor(update_ratio=True, log_every_n_steps=1, histogram=False)
    model = BackboneHead("adam")
    logger = CSVLogger(tmp_path, name="", version="")
    got = fit(tmp_path, model, [UpdateTransform(**config), monitor, copies, updates], steps=6, logger=logger,
              log_every_n_steps=1)
    every = sum(p.numel() for p in model.parameters())
    # The union, once: the head's 17 not copied a second time. On the CPU the ratio is the copy's last
    # reader after the step, so its pass leaves the parameters in it and the next steps copy nothing (chained).
    assert copies.counts == ([every] + [0] * 5 if passes.NATIVE_PASSES else [every] * 6)
    shared = step_copies(model.trainer.optimizers[0])
    assert shared.numel == 0 and shared.spare_numel == 0  # nothing held, nor kept, after the fit
    alone = fit(tmp_path, BackboneHead("adam"), [UpdateTransform(**config)], steps=6)
    assert largest_difference(got, alone) < 1e-6  # the same rewrite, made in the parameters
    logged = {int(r["step"]): float(r["updates/head.weight/ratio"]) for r in csv_metrics(str(tmp_path))
              if r.get("updates/head.weight/ratio", "") != ""}
    assert sorted(logged) == list(range(6))
    for step, ratio in logged.items():  # measured from the shared copy, after the rewrite
        assert ratio == pytest.approx(updates.ratios("head.weight")[step], rel=1e-4)
    if "max_ratio" in config:
        assert max(updates.ratios("head.weight")) < 1e-3 * (1 + 1e-4)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({}, ValueError, "at least one of"),
    ({"scale": {}}, ValueError, "is empty"),
    ({"scale": {"head": float("nan")}}, ValueError, "finite"),
    ({"max_ratio": {"head": 0}}, ValueError, "positive"),
    ({"max_ratio": [0.1]}, TypeError, "dict of name patterns"),
    ({"clip_to_history": []}, ValueError, "non-empty list"),
    ({"clip_to_history": 3}, TypeError, "name glob"),
    ({"clip_to_history": ["*", ""]}, TypeError, "non-empty name globs"),
    ({"clip_to_history": "*", "history_window": 1}, ValueError, "history_window"),
    ({"clip_to_history": "*", "history_sigmas": -1.0}, ValueError, "history_sigmas"),
])
def test_bad_arguments_raise_in_the_constructor(kwargs, error, match):
    with pytest.raises(error, match=match):
        UpdateTransform(**kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"scale": {"backbon.*": 0.1}}, "backbon"),
    ({"clip_to_history": ["backbone", "backbone.0"]}, "both reach a parameter"),
])
def test_patterns_are_checked_against_the_model_before_training(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit(tmp_path, BackboneHead(), [UpdateTransform(**kwargs)], steps=1)


def _backbone_update(tmp_path, optimizer, callbacks):
    updates = Updates()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, BackboneHead(optimizer), [*callbacks, updates], steps=10)
    said = [str(w.message) for w in caught if "GradientTransform: `scale`" in str(w.message)]
    return [d["backbone.0.weight"].norm().item() for d in updates.deltas], said


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_a_gradient_scale_under_adam_leaves_the_update_as_it_was_and_says_so_once(tmp_path, optimizer):
    plain, _ = _backbone_update(tmp_path, optimizer, [])
    scaled, said = _backbone_update(tmp_path, optimizer, [GradientTransform(scale={"backbone": 0.1})])
    assert scaled == pytest.approx(plain, rel=1e-3)  # Adam divides the scale away, step after step
    name = {"adam": "Adam", "adamw": "AdamW"}[optimizer]
    assert len(said) == 1 and "UpdateTransform(scale=" in said[0] and f"but {name} does not" in said[0]
    updated, _ = _backbone_update(tmp_path, optimizer, [UpdateTransform(scale={"backbone": 0.1})])
    assert updated[0] == pytest.approx(0.1 * plain[0], rel=1e-4)  # the first step, from the same weights


@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_a_gradient_scale_under_sgd_scales_the_update_without_a_warning(tmp_path, optimizer):
    plain, _ = _backbone_update(tmp_path, optimizer, [])
    scaled, said = _backbone_update(tmp_path, optimizer, [GradientTransform(scale={"backbone": 0.1})])
    assert scaled[0] == pytest.approx(0.1 * plain[0], rel=1e-4) and not said
