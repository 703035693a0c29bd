"""One instance, one running Trainer: a `fit` inside a `fit` with the same callback says so, in the inner setup."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from lightning_hooks import (
    ActivationMonitor,
    GradientAnomalyStopping,
    GradientMonitor,
    GradientTransform,
    LayerHealth,
    TransformerStability,
)
from tests.helpers import TinyNet, forward_hook_count, loader, trainer

MAKERS: dict[str, Callable[[], Any]] = {
    "ActivationMonitor": lambda: ActivationMonitor(log_every_n_steps=1),
    "GradientMonitor": lambda: GradientMonitor(log_every_n_steps=1, provenance=True),
    "GradientAnomalyStopping": lambda: GradientAnomalyStopping(action="rollback"),
    "TransformerStability": lambda: TransformerStability(log_every_n_steps=1, logits="net.2"),
    "LayerHealth": lambda: LayerHealth(),
    "GradientTransform": lambda: GradientTransform(scale={"net.0": 0.5}),
}


class Nesting(TinyNet):
    """At step 2 its training_step fits another model with ``inner_callbacks``."""

    def __init__(self, tmp_path: Any, inner_callbacks: list[Any]) -> None:
        super().__init__()
        self.tmp_path, self.inner_callbacks = tmp_path, inner_callbacks

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 2:
            trainer(self.tmp_path / "inner", self.inner_callbacks, max_steps=2).fit(TinyNet(), loader())
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("name", MAKERS)
def test_a_nested_fit_with_the_same_instance_is_refused_with_a_message_and_the_outer_hooks_are_removed(tmp_path, name):
    callback = MAKERS[name]()
    model = Nesting(tmp_path, [callback])
    with pytest.raises(RuntimeError, match=rf"^{name}: this instance is attached to another Trainer that is still"):
        trainer(tmp_path / "outer", [callback], max_steps=4).fit(model, loader())
    assert forward_hook_count(model) == 0 and not getattr(callback, "is_attached", False)
    trainer(tmp_path / "again", [callback], max_steps=2).fit(TinyNet(), loader())  # free again after the failed run


@pytest.mark.parametrize("name", MAKERS)
def test_a_nested_fit_with_its_own_instance_runs_and_the_outer_one_keeps_its_hooks(tmp_path, name):
    hooks: dict[int, int] = {}

    class Watch(TinyNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == 2:
                trainer(tmp_path / "inner", [MAKERS[name]()], max_steps=2).fit(TinyNet(), loader())
            hooks[self.global_step] = forward_hook_count(self)
            return super().training_step(batch, batch_idx)

    model = Watch()
    trainer(tmp_path / "outer", [MAKERS[name]()], max_steps=4).fit(model, loader())
    assert hooks[3] == hooks[1] and forward_hook_count(model) == 0
