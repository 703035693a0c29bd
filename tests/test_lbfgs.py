"""An optimizer that evaluates its closure several times per step (LBFGS): one figure, one count, one skip per step."""

from collections import Counter
from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_hooks import GradientAnomalyStopping, GradientMonitor
from tests.helpers import TinyNet, events, loader, trainer

MAX_ITER = 4


class LBFGSNet(TinyNet):
    """TinyNet under ``LBFGS(max_iter=4)``; its loss is NaN at the closure calls in ``nan_at``.

    Args:
        nan_at: ``(global step, closure call)`` pairs, calls counted from 1 within the step.
    """

    def __init__(self, nan_at: tuple[tuple[int, int], ...] = ()) -> None:
        super().__init__(lr=0.1)
        self.nan_at = set(nan_at)
        self.calls: Counter = Counter()  # closure calls per global step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        self.calls[step] += 1
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if (step, self.calls[step]) in self.nan_at else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=MAX_ITER)


class StepStarts(L.Callback):
    """Parameters and optimizer state at the start of every step, and at the end of fit."""

    def __init__(self) -> None:
        self.params: dict[Any, list[torch.Tensor]] = {}
        self.optim: dict[Any, dict[str, Any]] = {}

    def _take(self, key: Any, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params[key] = [p.detach().clone() for p in pl_module.parameters()]
        state = trainer.optimizers[0].state_dict()["state"]
        self.optim[key] = {k: _cloned(v) for k, v in state.get(0, {}).items()}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._take(trainer.global_step, trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take("end", trainer, pl_module)


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    return [_cloned(v) for v in value] if isinstance(value, list) else value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _first_gradient_norm(model: nn.Module) -> float:
    """The total gradient norm of the first batch at the model's current parameters."""
    x, y = next(iter(loader()))
    copy = TinyNet()
    copy.load_state_dict(model.state_dict())
    nn.functional.mse_loss(copy(x), y).backward()
    return torch.nn.utils.get_total_norm([p.grad for p in copy.parameters()]).item()


def test_the_monitor_logs_one_figure_per_step_the_gradient_at_the_steps_starting_parameters(tmp_path):
    torch.manual_seed(0)
    model = LBFGSNet()
    expected = _first_gradient_norm(model)
    monitor = GradientMonitor(log_every_n_steps=1)
    logger = TensorBoardLogger(str(tmp_path), name="", version="")
    trainer(tmp_path, [monitor], logger=logger, max_steps=3).fit(model, loader())
    assert all(model.calls[step] > 1 for step in range(3))  # LBFGS ran its closure several times a step
    norms = events(str(tmp_path)).Scalars("gradients/total_norm")
    assert [e.step for e in norms] == [0, 1, 2]
    assert norms[0].value == pytest.approx(expected, rel=1e-6)


def test_patience_and_the_running_median_count_optimizer_steps_not_closure_calls(tmp_path):
    torch.manual_seed(0)
    clean = GradientAnomalyStopping(relative_threshold=1e6, window=50)
    trainer(tmp_path, [clean], logger=False, max_steps=3).fit(LBFGSNet(), loader())
    assert clean.state_dict()["detector"]["seen"] == {0: 3}  # one norm per step in the median
    torch.manual_seed(0)
    stopper = GradientAnomalyStopping(action="stop", patience=2)
    model = LBFGSNet(nan_at=((0, 1),))  # the NaN update poisons the weights: every later call is NaN
    fit = trainer(tmp_path, [stopper], logger=False, max_steps=8)
    fit.fit(model, loader())
    assert (stopper.anomalous_steps, stopper.dropped_steps, fit.global_step) == (3, 1, 3)  # stopped at step 2


@pytest.mark.parametrize("action", ["skip", "stop"])
def test_a_nan_at_the_second_closure_call_drops_the_whole_step_bit_identically(tmp_path, action):
    torch.manual_seed(0)
    starts = StepStarts()
    stopper = GradientAnomalyStopping(action=action)
    model = LBFGSNet(nan_at=((1, 2),))
    fit = trainer(tmp_path, [stopper, starts], logger=False, max_steps=4)
    fit.fit(model, loader())
    assert (stopper.anomalous_steps, stopper.dropped_steps) == (1, 1)
    after: Optional[Any] = 2 if action == "skip" else "end"
    assert fit.global_step == (4 if action == "skip" else 2)
    assert all(torch.equal(a, b) for a, b in zip(starts.params[1], starts.params[after]))
    assert starts.optim[1].keys() == starts.optim[after].keys()
    assert all(_same(value, starts.optim[after][key]) for key, value in starts.optim[1].items()), starts.optim[1]
    assert not any(torch.equal(a, b) for a, b in zip(starts.params[0], starts.params[1]))  # step 0 did train
    if action == "skip":
        assert not all(torch.equal(a, b) for a, b in zip(starts.params[2], starts.params[3]))  # and trains on
