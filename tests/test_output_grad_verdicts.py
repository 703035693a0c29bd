"""The verdicts on the gradient reaching each module's output (ActivationMonitor(gradients=True)).

A cut in the backward pass moves the output gradients of every module before it in forward
order: the last of them (the first the backward pass reached) is named, in LayerHealth, the
Layers tab and the diagnosis alike; the others, and the parameter gradients they starve, are its
victims; a forward culprit keeps its name.
"""

from __future__ import annotations

import math
import random
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth
from lightning_hooks.output._diagnosis import diagnose
from lightning_hooks.output._health_verdicts import JUDGED, Bands, Verdicts
from lightning_hooks.tensorboard_plugin.run_data import Figure
from lightning_hooks.tensorboard_plugin.verdicts import banner, judge
from tests.helpers import run_reader

NAMES = [f"l{i}" for i in range(6)]
STEPS = list(range(0, 600, 10))
ONSET = 400


def synthetic(grad_fault: Any = None, level_fault: Any = None, seed: int = 0) -> dict[tuple[str, str], dict]:
    """A run's figures: per (kind, stat), per row, one value per step of :data:`STEPS`; faults scale them."""
    rng = random.Random(seed)
    grid: dict[tuple[str, str], dict[str, list[float]]] = {
        ("activations", "std"): {n: [(1 + i) * math.exp(rng.gauss(0, 0.03)) for _ in STEPS]
                                 for i, n in enumerate(NAMES)},
        ("activation_grads", "std"): {n: [1e-3 * (6 - i) * math.exp(rng.gauss(0, 0.1)) for _ in STEPS]
                                      for i, n in enumerate(NAMES)},
        ("gradients", "norm"): {f"{n}.weight": [(1 + i) * math.exp(rng.gauss(0, 0.2)) for _ in STEPS]
                                for i, n in enumerate(NAMES)},
    }
    for fault, key in ((grad_fault, ("activation_grads", "std")), (level_fault, ("activations", "std"))):
        if fault is not None:
            rows, factor = fault
            for name in rows:
                grid[key][name] = [v * (factor if s >= ONSET else 1) for v, s in zip(grid[key][name], STEPS)]
    if grad_fault is not None:  # the parameters whose output gradient vanished or exploded get as much
        rows, factor = grad_fault
        for name in rows:
            values = grid[("gradients", "norm")][f"{name}.weight"]
            grid[("gradients", "norm")][f"{name}.weight"] = [v * (factor if s >= ONSET else 1)
                                                            for v, s in zip(values, STEPS)]
    return grid


def verdicts_of(grid: dict) -> Verdicts:
    """LayerHealth's record of the figures."""
    verdicts = Verdicts(Bands())
    for col, step in enumerate(STEPS):
        for (kind, stat), rows in grid.items():
            verdicts.add(JUDGED[(kind, stat)], step, {name: values[col] for name, values in rows.items()})
    return verdicts


def now(verdicts: Verdicts) -> set[tuple[str, str, int]]:
    return {(layer, problem, e.first) for (problem, layer), e in verdicts.episodes.items() if e.ongoing}


def tab(grid: dict) -> set[tuple[str, str, int]]:
    figures = [Figure(f"{kind}/{stat}", "", kind, stat, list(rows), STEPS, [list(v) for v in rows.values()])
               for (kind, stat), rows in grid.items()]
    return {(b["layer"], b["verdict"], b["since"]) for b in banner(judge(figures, Bands()), Bands())}


@pytest.mark.parametrize("factor, problem", [(1e-6, "output_grad_vanishing"), (1e4, "output_grad_exploding")])
def test_a_cut_in_the_backward_names_the_last_module_before_it_and_the_tab_says_the_same(factor, problem):
    grid = synthetic(grad_fault=(["l0", "l1", "l2"], factor))
    verdicts = verdicts_of(grid)
    found = now(verdicts)
    assert ("l2", problem, ONSET) in found
    assert not {layer for layer, _, _ in found} & {"l0", "l1", "l0.weight", "l1.weight", "l3", "l4", "l5"}, found
    assert found == tab(grid)
    said = diagnose(verdicts, top_k=5)
    assert f"l2: the gradient reaching l2's output {'vanished' if factor < 1 else 'exploded'} since step {ONSET}" \
        in said
    assert "right after it in forward order (l3)" in said
    assert verdicts.victims  # the modules before it, and their parameters' gradients: counted, not named


def test_a_forward_culprit_keeps_its_name_and_the_output_gradients_it_moved_are_its_victims():
    # l3's outputs jump x20: the gradient reaching l0..l2's outputs comes back through it, x20 too.
    grid = synthetic(grad_fault=(["l0", "l1", "l2"], 20.0), level_fault=(["l3", "l4", "l5"], 20.0))
    verdicts = verdicts_of(grid)
    assert {(layer, problem) for layer, problem, _ in now(verdicts)} <= {("l3", "blowup"), ("l3.weight", "exploding")}
    assert ("l3", "blowup", ONSET) in now(verdicts) and now(verdicts) == tab(grid)


def test_every_gradient_at_once_the_loss_side_too_is_the_batch_not_a_layer():
    # The loss's gradient x1e4: every output gradient and parameter gradient with it; the gains from the loss hold.
    grid = synthetic(grad_fault=(NAMES, 1e4))
    verdicts = verdicts_of(grid)
    # Named at the next logged step, once the gradients stayed up (one hard batch is not the batch's labels).
    assert {key: e.first for key, e in verdicts.episodes.items()} == {("data", "(every layer)"): ONSET + STEPS[1]}
    assert tab(grid) == now(verdicts)


def test_the_loss_falling_moves_every_output_gradient_together_and_is_not_judged():
    grid = synthetic()
    for name, values in grid[("activation_grads", "std")].items():  # a hundredfold fall, and a jump back
        grid[("activation_grads", "std")][name] = [v * (0.01 if 200 <= s < 400 else 1) for v, s in zip(values, STEPS)]
    assert verdicts_of(grid).episodes == {} and tab(grid) == set()


def test_a_healthy_synthetic_run_with_output_gradients_is_not_judged():
    assert verdicts_of(synthetic(seed=3)).episodes == {} and tab(synthetic(seed=3)) == set()


def test_the_output_gradient_band_is_validated_and_taken_by_layer_health():
    with pytest.raises(ValueError, match="output_grad_factor"):
        Bands(output_grad_factor=0.5)
    assert LayerHealth(output_grad_factor=8.0).verdicts.bands.output_grad_factor == 8.0


class Teacher(L.LightningModule):
    """Six Linear layers with ReLUs between (as the fault zoo's ``mlp``), fitting a fixed teacher under Adam.

    From step ``onset`` on, the gradient reaching ``cut``'s output is multiplied by 1e-6 (a tensor
    hook put on in the module's own forward hook, before the monitor's: the monitor sees the cut).
    """

    def __init__(self, cut: str = "", onset: int = 10**9) -> None:
        super().__init__()
        torch.manual_seed(0)
        sizes = [16, 64, 64, 64, 64, 64, 1]
        layers: list[nn.Module] = []
        for i in range(6):
            layers += [nn.Linear(sizes[i], sizes[i + 1]), *([nn.ReLU()] if i < 5 else [])]
        self.net = nn.Sequential(*layers)
        g = torch.Generator().manual_seed(0)
        self.w1, self.w2, self.onset = torch.randn(16, 32, generator=g) / 4, torch.randn(32, 1, generator=g) / 6, onset
        if cut:
            self.net.get_submodule(cut).register_forward_hook(self._cut)

    def _cut(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if self.training and self.trainer.global_step >= self.onset:
            out.register_hook(lambda grad: grad * 1e-6)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.trainer.global_step)
        x = torch.randn(32, 16, generator=g)
        return nn.functional.mse_loss(self.net(x), torch.tanh(x @ self.w1) @ self.w2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        return [0] * 160


def train(tmp_path: Any, model: Teacher) -> tuple[LayerHealth, set[tuple[str, str, int]]]:
    """Fit 160 steps watched as the docs say; LayerHealth, and the tab's banner read back from the event file."""


    health = LayerHealth(max_images=1)
    callbacks = [ActivationMonitor(gradients=True, histogram=False, log_every_n_steps=2),
                 GradientMonitor(update_ratio=True, histogram=False, log_every_n_steps=2), health]
    logger = TensorBoardLogger(tmp_path, name="", version=0)
    trainer = L.Trainer(max_steps=160, logger=logger, callbacks=callbacks, log_every_n_steps=2, accelerator="cpu",
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    logger.experiment.flush()
    reader = run_reader(tmp_path)
    figures = reader.figures("version_0")
    assert any(f.kind == "activation_grads" and f.stat == "std" for f in figures)
    judged = judge(figures, Bands(), reader.unjudged_ratios("version_0"), reader.forward_order("version_0"))
    return health, {(b["layer"], b["verdict"], b["since"]) for b in banner(judged, Bands())}


@pytest.mark.slow
def test_on_a_real_model_the_module_whose_output_gradient_was_cut_is_named_by_layer_health_and_the_tab(tmp_path):
    health, tab_says = train(tmp_path, Teacher(cut="4", onset=100))
    named = now(health.verdicts)
    assert ("net.4", "output_grad_vanishing", 101) in named  # the first logged step after the onset
    assert {layer for layer, _, _ in named} <= {"net.4", "net.4.weight"}, health.summary()  # none before it
    assert all(e.first >= 100 for e in health.verdicts.episodes.values()), health.summary()  # nothing before
    assert tab_says == named
    assert "net.4: the gradient reaching net.4's output vanished since step 101" in health.summary()
    assert ": 1 layer unhealthy now" in health.summary().splitlines()[0]  # its weight's gradient row is the same layer


@pytest.mark.slow
def test_on_a_real_model_a_healthy_run_watched_with_output_gradients_gets_no_verdict(tmp_path):
    health, tab_says = train(tmp_path, Teacher())
    assert health.verdicts.episodes == {}, health.summary()
    assert tab_says == set()


def test_layer_health_judges_in_the_order_the_modules_ran_not_the_order_they_were_registered(tmp_path):
    # As GPT-2's MLP registers c_proj before act: ``head`` is registered before ``trunk`` and runs after it.
    from tests.helpers import HeadFirst, loader, trainer

    torch.manual_seed(0)
    health = LayerHealth()
    callbacks = [ActivationMonitor(modules=["head", "trunk.0"], gradients=True), GradientMonitor(histogram=False),
                 health]
    trainer(tmp_path, callbacks, max_steps=2, logger=False).fit(HeadFirst(), loader())
    health.verdicts.flush()
    assert list(health.verdicts.judge.depth)[:2] == ["trunk.0", "head"]
