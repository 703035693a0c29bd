from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks.callbacks.transforms import GradientTransform

TRAINER = dict(
    accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, num_sanity_val_steps=0,
)


class Net(LightningModule):
    """backbone.{0,1,2,3} -> head, one MSE loss."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)
        self.steps = 0

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        self.steps += 1
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DANN(Net):
    """Features feed a task head directly and a domain head through an nn.Identity."""

    def __init__(self) -> None:
        super().__init__()
        self.grl = nn.Identity()
        self.domain_head = nn.Linear(8, 2)

    def losses(self, batch: list[Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        features = self.backbone(x)
        return F.mse_loss(self.head(features), y), F.mse_loss(self.domain_head(self.grl(features)), -y)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        task, domain = self.losses(batch)
        return task + domain


class Block(nn.Module):
    """A ResNet basic block: in-place ReLUs and an in-place residual add."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.relu2 = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x
        out = self.conv2(self.relu1(self.conv1(x)))
        out += shortcut
        return self.relu2(out)


class ResNetish(Net):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Block(4))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))


class GradCapture(Callback):
    """Keeps the gradients the optimizer is about to use."""

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, opt: object) -> None:
        self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def data(shape: tuple[int, ...] = (4,)) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, *shape, generator=generator), torch.randn(16, 2, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def step_grads(
    make: Callable[[], Net], *callbacks: Callback, shape: tuple[int, ...] = (4,), **trainer_kwargs: object
) -> dict[str, Tensor]:
    """The gradients of one optimizer step, from the same initial weights and batch every time."""
    seed_everything(0)
    model, capture = make(), GradCapture()
    Trainer(max_steps=1, callbacks=[*callbacks, capture], **TRAINER, **trainer_kwargs).fit(model, data(shape))
    return capture.grads


def assert_grads(got: dict[str, Tensor], expected: dict[str, Tensor], factors: dict[str, float]) -> None:
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        factor = next((f for prefix, f in factors.items() if name.startswith(prefix)), 1.0)
        torch.testing.assert_close(grad, factor * expected[name], rtol=1e-6, atol=1e-9, msg=name)


def test_scale_multiplies_only_the_selected_parameters_gradients() -> None:
    reference = step_grads(Net)
    got = step_grads(Net, GradientTransform(scale={"backbone.2": 0.1}))
    assert_grads(got, reference, {"backbone.2.": 0.1})


def test_each_scale_pattern_acts_once_per_parameter_and_overlapping_scales_multiply() -> None:
    reference = step_grads(Net)
    # 'backbone*' matches backbone, backbone.0, backbone.2, ...: still one factor of 0.5 each.
    got = step_grads(Net, GradientTransform(scale={"backbone*": 0.5, "backbone.0": 0.1}))
    assert_grads(got, reference, {"backbone.0.": 0.05, "backbone.": 0.5})


def test_reverse_flips_the_module_and_everything_upstream_but_not_downstream() -> None:
    reference = step_grads(Net)
    got = step_grads(Net, GradientTransform(reverse={"backbone.2": 0.5}))
    assert_grads(got, reference, {"backbone.": -0.5})


def test_reverse_on_an_identity_branch_flips_only_that_branch() -> None:
    seed_everything(0)
    model = DANN()
    task, domain = model.losses(next(iter(data())))
    params = dict(model.named_parameters())
    grads = [torch.autograd.grad(loss, list(params.values()), allow_unused=True, retain_graph=True)
             for loss in (task, domain)]
    g_task, g_domain = (dict(zip(params, g)) for g in grads)

    got = step_grads(DANN, GradientTransform(reverse={"grl": 1.0}))

    for name in params:
        if name.startswith("backbone."):
            expected = g_task[name] - g_domain[name]
        else:
            expected = g_task[name] if g_task[name] is not None else g_domain[name]
        torch.testing.assert_close(got[name], expected, msg=name)


def test_clip_value_bounds_every_element_after_accumulation() -> None:
    reference = step_grads(Net, accumulate_grad_batches=2)
    bound = 1e-3
    assert reference["backbone.0.weight"].abs().max() > bound
    got = step_grads(Net, GradientTransform(clip_value={"backbone.0": bound}), accumulate_grad_batches=2)
    torch.testing.assert_close(got["backbone.0.weight"], reference["backbone.0.weight"].clamp(-bound, bound))
    assert_grads({k: v for k, v in got.items() if not k.startswith("backbone.0")},
                 {k: v for k, v in reference.items() if not k.startswith("backbone.0")}, {})


def test_clip_norm_bounds_each_selected_module_jointly() -> None:
    reference = step_grads(Net)
    bound = 1e-3
    got = step_grads(Net, GradientTransform(clip_norm={"backbone.*": bound}))
    for layer in ("backbone.0", "backbone.2"):
        names = [f"{layer}.weight", f"{layer}.bias"]
        norm = torch.stack([got[n].norm() for n in names]).norm()
        assert bound * 0.99 < norm <= bound
        coefficient = got[names[0]].norm() / reference[names[0]].norm()
        for n in names:  # one coefficient per group: the direction is kept
            torch.testing.assert_close(got[n], coefficient * reference[n])
    torch.testing.assert_close(got["head.weight"], reference["head.weight"])


def test_reverse_survives_inplace_ops_on_a_view_output() -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 6), nn.Unflatten(1, (2, 3))), torch.randn(5, 4)

    def first_layer_grad() -> Tensor:
        model.zero_grad()
        out = model(x)  # Unflatten returns a view
        out.mul_(2)
        out.square().sum().backward()
        return model[0].weight.grad.clone()

    reference = first_layer_grad()
    transform = GradientTransform(reverse={"1": 1.0})
    transform.attach(model)
    torch.testing.assert_close(first_layer_grad(), -reference)
    transform.detach()
    torch.testing.assert_close(first_layer_grad(), reference)


@pytest.mark.parametrize(
    ("reversed_module", "factors"),
    [
        # conv2's output is then modified in place by `out += shortcut`; conv1 feeds only conv2.
        ("backbone.1.conv2", {"backbone.1.conv1.": -0.1, "backbone.1.conv2.": -1.0, "backbone.0.": None}),
        # an in-place ReLU returns its own input
        ("backbone.1.relu1", {"backbone.1.conv1.": -0.1, "backbone.0.": None}),
        ("backbone", {"backbone.1.conv1.": -0.1, "backbone.": -1.0}),
    ],
)
def test_works_through_inplace_relu_and_inplace_residual_add(reversed_module: str, factors: dict) -> None:
    reference = step_grads(ResNetish, shape=(3, 6, 6))
    transform = GradientTransform(scale={"backbone.1.conv1": 0.1}, reverse={reversed_module: 1.0})
    got = step_grads(ResNetish, transform, shape=(3, 6, 6))
    # The stem's gradient mixes the reversed path and the shortcut: not a plain multiple.
    mixed = [prefix for prefix, factor in factors.items() if factor is None]
    assert_grads(
        {k: v for k, v in got.items() if not k.startswith(tuple(mixed))},
        {k: v for k, v in reference.items() if not k.startswith(tuple(mixed))},
        {prefix: factor for prefix, factor in factors.items() if factor is not None},
    )


class Deferred(Net):
    """Builds its layers in configure_model, after the callbacks' setup."""

    def __init__(self) -> None:
        LightningModule.__init__(self)
        self.steps = 0

    def configure_model(self) -> None:
        if not hasattr(self, "backbone"):
            torch.manual_seed(0)
            self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
            self.head = nn.Linear(8, 2)


def test_a_model_built_in_configure_model_is_resolved_at_fit_start() -> None:
    reference = step_grads(Deferred)
    got = step_grads(Deferred, GradientTransform(scale={"head": 0.5}, clip_value={"backbone.0": 1.0}))
    torch.testing.assert_close(got["head.weight"], 0.5 * reference["head.weight"])


def test_hooks_are_removed_after_fit_and_user_hooks_survive() -> None:
    model = Net()
    model.backbone[0].weight.register_hook(lambda grad: None)
    model.backbone[2].register_forward_hook(lambda module, args, output: None)
    before = {n: len(p._backward_hooks or {}) for n, p in model.named_parameters()}
    transform = GradientTransform(scale={"backbone.*": 0.5}, reverse={"backbone.2": 1.0})

    transform.attach(model)
    transform.attach(model)  # attaching again replaces, never doubles
    assert len(model.backbone[0].weight._backward_hooks) == 2
    assert len(model.backbone[2]._forward_hooks) == 2

    Trainer(max_steps=2, callbacks=[transform], **TRAINER).fit(model, data())
    assert not transform.is_attached
    assert {n: len(p._backward_hooks or {}) for n, p in model.named_parameters()} == before
    assert len(model.backbone[2]._forward_hooks) == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "needs at least one of"),
        ({"scale": [("a", 1.0)]}, TypeError, "`scale` must be a dict"),
        ({"scale": {}}, ValueError, "`scale` is empty"),
        ({"scale": {"": 1.0}}, TypeError, "`scale` keys must be non-empty"),
        ({"scale": {nn.Linear: 1.0}}, TypeError, "`scale` keys must be non-empty"),
        ({"scale": {"a": float("nan")}}, ValueError, "`scale` values must be finite numbers, got nan"),
        ({"scale": {"a": "0.1"}}, TypeError, r"`scale` values must be finite numbers, got '0.1' \(str\) for 'a'"),
        ({"reverse": {"a": True}}, TypeError, r"`reverse` values must be finite numbers, got True \(bool\)"),
        ({"reverse": {"a": -1.0}}, ValueError, "`reverse` values must be positive, got -1.0"),
        ({"clip_value": {"a": 0}}, ValueError, "`clip_value` values must be positive, got 0"),
        ({"clip_norm": {"a": float("inf")}}, ValueError, "`clip_norm` values must be finite"),
    ],
)
def test_bad_arguments_raise_in_the_constructor(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        GradientTransform(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale": {"backbone.7": 0.1}}, r"`scale` pattern 'backbone.7' matched no module. Did you mean"),
        ({"clip_norm": {"heda": 1.0}}, r"`clip_norm` pattern 'heda' matched no module. Did you mean: 'head'"),
        ({"reverse": {"backbone.*": 1.0}}, r"`reverse` pattern 'backbone.\*' selects 4 modules"),
    ],
)
def test_patterns_are_checked_against_the_model_before_training(kwargs: dict, match: str) -> None:
    model = Net()
    with pytest.raises(ValueError, match=match):
        Trainer(max_steps=1, callbacks=[GradientTransform(**kwargs)], **TRAINER).fit(model, data())
    assert model.steps == 0
