"""A monitor's hooks are on the modules only for the steps that log, and validation runs when asked.

A registered forward hook alone puts every call of its module on PyTorch's slow path; so a
monitor registers its hooks when its gate opens (a logged step, a validation batch it collects)
and removes them when it closes. The figures are those of hooks left on for the whole fit, and
the hooks go on every way out. On a compiled model they stay for the whole fit (see
docs/cost.md): a compiled graph does not see hooks added after it was compiled.
"""

from __future__ import annotations

import csv
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_hooks import STAT_NAMES, ActivationMonitor, TransformerStability
from lightning_hooks.core._torch_internals import is_compiled
from tests.helpers import HookCounter, TinyNet, forward_hook_count, loader, trainer


class AlwaysOn(ActivationMonitor):
    """The monitor with its hooks registered for the whole fit, gated by the flag alone (as before)."""

    _hooks_follow_gate = False


def metrics(path: str) -> dict[tuple[str, int], float]:
    """Every ``activations/`` and ``val_activations/`` value of a CSVLogger run, by (tag, step)."""
    found: dict[tuple[str, int], float] = {}
    with open(os.path.join(path, "lightning_logs", "version_0", "metrics.csv")) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if "activations/" in key and value != "":
                    found[(key, int(row["step"]))] = float(value)
    return found


def fit(tmp_path, monitor, counter=None, **kwargs):
    torch.manual_seed(0)
    model = TinyNet()
    callbacks = [monitor] + ([counter] if counter is not None else [])
    trainer(tmp_path, callbacks, logger=CSVLogger(tmp_path), **kwargs).fit(model, loader(64, 8), loader(16, 8, 1))
    return model


def test_hooks_are_on_the_modules_only_at_the_steps_that_log(tmp_path):
    counter = HookCounter()
    monitor = ActivationMonitor(log_every_n_steps=3, histogram=False)
    model = fit(tmp_path, monitor, counter, max_steps=7)
    n = len(monitor.module_names)
    assert n == 3
    assert counter.train == [n if step in (0, 2, 5) else 0 for step in range(7)]  # steps 0, 2, 5 log
    assert counter.val == [0, 0]  # the sanity check; validation is not asked for
    assert forward_hook_count(model) == 0 and not monitor.is_attached


def test_validation_runs_have_the_hooks_when_asked(tmp_path):
    counter = HookCounter()
    monitor = ActivationMonitor(log_every_n_steps=4, histogram=False, stages=("train", "validate"))
    fit(tmp_path, monitor, counter, max_epochs=1, max_steps=-1, val_check_interval=4, limit_val_batches=2,
        num_sanity_val_steps=1)
    assert counter.val == [0] + [3] * 4  # not the sanity check; both batches of both runs
    assert counter.train == [3, 0, 0, 3, 0, 0, 0, 3]


@pytest.mark.parametrize("stages", [("train",), ("train", "validate")])
def test_the_figures_are_those_of_hooks_left_on(tmp_path, stages):
    kwargs = dict(max_epochs=2, max_steps=-1, val_check_interval=4, limit_val_batches=2)
    fit(tmp_path / "gated", ActivationMonitor(log_every_n_steps=3, stats=STAT_NAMES, stages=stages,
                                              histogram=False), **kwargs)
    fit(tmp_path / "on", AlwaysOn(log_every_n_steps=3, stats=STAT_NAMES, stages=stages, histogram=False), **kwargs)
    gated, on = metrics(str(tmp_path / "gated")), metrics(str(tmp_path / "on"))
    assert {step for tag, step in gated if tag.startswith("activations/")} == {0, 2, 5, 8, 11, 14}
    assert any(tag.startswith("val_activations/") for tag, _ in gated) == ("validate" in stages)
    assert gated == on


class Raises(TinyNet):
    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.at:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("at", [2, 3])  # a logged step (hooks on), a step that is not (hooks off)
def test_hooks_go_when_fit_raises_on_any_step(tmp_path, at):
    model = Raises(at)
    user = model.net[0].register_forward_hook(lambda *args: None)
    monitor = ActivationMonitor(log_every_n_steps=3, histogram=False)
    with pytest.raises(RuntimeError, match="boom"):
        trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=6).fit(model, loader(64, 8))
    assert forward_hook_count(model) == 1 and user.id in model.net[0]._forward_hooks
    assert not monitor.is_attached
    monitor.detach()  # idempotent
    assert forward_hook_count(model) == 1


class Decoder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x = batch[0].view(-1, 1, 8).expand(-1, 4, 8)
        out, _ = self.attn(x, x, x)
        return nn.functional.mse_loss(self.head(out).mean(1), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_transformer_stability_hooks_follow_its_logged_steps(tmp_path):
    counter = HookCounter()
    model = Decoder()
    trainer(tmp_path, [TransformerStability(log_every_n_steps=2, logits=False, blocks=False), counter],
            logger=CSVLogger(tmp_path), max_steps=4).fit(model, loader(64, 8))
    assert counter.train == [1, 1, 0, 1]  # a pre-hook on the attention at steps 0, 1, 3
    assert forward_hook_count(model) == 0


def test_a_compiled_module_is_seen_wherever_it_is():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert not is_compiled(net)
    assert is_compiled(nn.Sequential(torch.compile(net, backend="eager")))
    inner = nn.Sequential(nn.Linear(2, 2))
    inner.compile(backend="eager")
    assert is_compiled(nn.Sequential(nn.Linear(2, 2), inner))


def test_on_a_compiled_model_the_hooks_stay_for_the_whole_fit(tmp_path):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyNet()
    model.net = torch.compile(model.net, backend="eager")
    counter = HookCounter()
    monitor = ActivationMonitor(log_every_n_steps=3, histogram=False, stats=["count"])
    trainer(tmp_path, [monitor, counter], logger=CSVLogger(tmp_path), max_steps=4).fit(model, loader(64, 8))
    assert counter.train == [3] * 4  # a graph compiled without them would never run hooks added later
    assert {step for tag, step in metrics(str(tmp_path)) if tag == "activations/net.0/count"} == {0, 2}
    assert forward_hook_count(model) == 0


class HookIds(L.Callback):
    """The ids of the forward hooks on the first module at each training batch."""

    def __init__(self) -> None:
        self.ids: list[tuple[int, ...]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.ids.append(tuple(pl_module.net[0]._forward_hooks))


def test_consecutive_logged_steps_keep_their_hooks(tmp_path):
    # Steps 0 and 1 log (every 2: step 0 and (n + 1) % 2 == 0), then 3 and 5: the hooks of step 0
    # stay for step 1, go for step 2, and new ones come for step 3.
    ids = HookIds()
    monitor = ActivationMonitor(log_every_n_steps=2, histogram=False)
    model = fit(tmp_path, monitor, ids, max_steps=6)
    assert [len(i) for i in ids.ids] == [1, 1, 0, 1, 0, 1]
    assert ids.ids[0] == ids.ids[1] and ids.ids[3] != ids.ids[1] and ids.ids[5] != ids.ids[3]
    assert forward_hook_count(model) == 0 and not monitor.is_attached


def test_logging_every_step_registers_each_hook_once(tmp_path):
    kept, gated = CSVLogger(tmp_path / "kept"), CSVLogger(tmp_path / "gated")
    ids = HookIds()
    torch.manual_seed(0)
    trainer(tmp_path, [AlwaysOn(log_every_n_steps=1, histogram=False)], logger=kept, max_steps=5).fit(
        TinyNet(), loader(64, 8))
    torch.manual_seed(0)
    model = TinyNet()
    trainer(tmp_path, [ActivationMonitor(log_every_n_steps=1, histogram=False), ids], logger=gated,
            max_steps=5).fit(model, loader(64, 8))
    assert len(set(ids.ids)) == 1 and len(ids.ids[0]) == 1  # one registration for the whole fit
    assert forward_hook_count(model) == 0
    assert metrics(str(tmp_path / "gated")) == metrics(str(tmp_path / "kept"))
