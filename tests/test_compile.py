"""torch.compile with inductor: every callback, in fp32 and bf16-mixed, gives what eager mode gives.

Each case trains the same seeded model twice, once compiled with inductor (``self.net =
torch.compile(net)``, the recipe the README gives) and once eager, with the same callbacks, then
compares everything the callbacks produced: the logged scalars, the final parameters (which the
gradient callbacks change), the saved features. The model is small enough to compile in seconds.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import (
    STAT_NAMES,
    ActivationMonitor,
    FeatureExtractor,
    GradientAnomalyStopping,
    GradientMonitor,
    GradientTransform,
    LayerHealth,
    load_features,
)
from lightning_hooks.measure.stats import Binning, _accumulate_tensors_, as_float_values, new_rows
from tests.zoo import metric_series

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*TensorFloat32.*")]

STEPS = 6
NAN_BATCH = 2  # the stopper's case: this batch's inputs are NaN


class Net(L.LightningModule):
    """Linear -> ReLU -> Linear -> Tanh -> Linear regression on ``net``, compiled or not.

    The shapes are those of the report that found inductor's out-of-bounds read: an output of
    8 x 4 = 32 values, one vector of 32 lanes with nothing left over.
    """

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        self.net = torch.compile(net, backend="inductor") if compiled else net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data(nan_batch: bool = False) -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8 * STEPS, 32, generator=gen)
    y = x[:, :4] * 2 - x[:, 4:8]
    if nan_batch:
        x[8 * NAN_BATCH : 8 * (NAN_BATCH + 1)] = math.nan
    return DataLoader(TensorDataset(x, y), batch_size=8)


def fit(tmp_path: Any, precision: str, callbacks: list[L.Callback], compiled: bool, nan_batch: bool = False) -> Net:
    torch._dynamo.reset()
    model = Net(compiled)
    L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, precision=precision, callbacks=callbacks,
        logger=CSVLogger(tmp_path, name="csv", version=0), log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    ).fit(model, data(nan_batch))
    return model


# Each case: the callbacks (made fresh for each run, writing under the given folder) and whether
# its data holds a NaN batch.
Case = Callable[[Any], list[L.Callback]]
CASES: dict[str, tuple[Case, bool]] = {
    "ActivationMonitor": (lambda d: [ActivationMonitor(log_every_n_steps=2, stats=STAT_NAMES)], False),
    "GradientMonitor": (lambda d: [GradientMonitor(log_every_n_steps=2, provenance=True, update_ratio=True)], False),
    "GradientAnomalyStopping": (lambda d: [GradientAnomalyStopping(action="skip", provenance=True)], True),
    "GradientTransform": (
        lambda d: [GradientTransform(scale={"net.0": 0.5}, reverse={"net.3": 1.0}, clip_norm={"net.4": 0.05})],
        False,
    ),
    "FeatureExtractor": (lambda d: [FeatureExtractor(modules=["net.1", "net.4"], dirpath=d / "features",
                                                     stages=("train",))], False),
    "LayerHealth": (
        lambda d: [ActivationMonitor(log_every_n_steps=2), GradientMonitor(log_every_n_steps=2, update_ratio=True),
                   LayerHealth(image_every_n_steps=4)],
        False,
    ),
}

# bf16 rounds each Linear's output to 8 bits of mantissa; inductor fuses the ops after it in float32
# where eager rounds each one, so bf16 runs agree to bf16's precision, fp32 runs to float32's.
TOLERANCE = {"32-true": dict(rel=1e-4, abs=1e-5), "bf16-mixed": dict(rel=3e-2, abs=3e-3)}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("case", list(CASES))
def test_inductor_gives_the_eager_figures(tmp_path, case, precision):
    make, nan_batch = CASES[case]
    runs = {}
    for mode in ("compiled", "eager"):
        folder = tmp_path / mode
        callbacks = make(folder)
        model = fit(folder, precision, callbacks, compiled=mode == "compiled", nan_batch=nan_batch)
        runs[mode] = (callbacks, model, metric_series(folder / "csv" / "version_0"), folder)
    (got_callbacks, got_model, got, got_dir), (_, want_model, want, want_dir) = runs["compiled"], runs["eager"]
    tol = TOLERANCE[precision]

    ours = [k for k in want if k.split("/")[0] in ("loss", "activations", "gradients", "updates", "anomalies")]
    silent = ("GradientAnomalyStopping", "GradientTransform", "FeatureExtractor")  # they log nothing here
    assert ours != ["loss"] or case in silent, "nothing of ours was logged"
    assert {k: sorted(v) for k, v in got.items() if k in ours} == {k: sorted(want[k]) for k in ours}
    for key in ours:
        for step, value in want[key].items():
            assert got[key][step] == pytest.approx(value, nan_ok=True, **tol), (key, step)
    for (name, a), (_, b) in zip(got_model.named_parameters(), want_model.named_parameters()):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=tol["rel"], atol=tol["abs"], msg=name)

    if case == "GradientAnomalyStopping":
        assert got_callbacks[0].dropped_steps == 1
    if case == "FeatureExtractor":
        for layer in ("net.1", "net.4"):
            saved = load_features(got_dir / "features", layer, stage="train")
            assert saved.shape[0] == 8 * STEPS
            want_saved = load_features(want_dir / "features", layer, stage="train")
            torch.testing.assert_close(saved.float(), want_saved.float(), rtol=tol["rel"], atol=tol["abs"])
    if case == "ActivationMonitor":
        assert got["activations/net.0/count"] == {0: 512, 1: 512, 3: 512, 5: 512}  # (8, 64) per step, logged steps only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_compiled_kernel_equals_the_eager_kernel(dtype):
    """The tensor-op kernel compiled by inductor, on the sizes whose generated code once read out of bounds.

    Inductor's CPU code for ``argmax`` over a bool mask viewed as uint8 (how the kernel once
    found its first finite value) returned indices past the end for 16-bit inputs of 64 and 100
    values: ``index out of bounds: 0 <= tmp11 < 64L``, the crash of ``fit`` under compile. The sums are float32 in
    an order of inductor's choosing (vector widths differ between CPUs): they may differ by the reordering's bound,
    ``n * eps`` times the largest term (a sum of 32 values off by 1.4e-6 on one CPU); every count exactly.
    """
    binning = Binning(128, torch.device("cpu"), torch.float32)

    def kernel(row: Tensor, output: Tensor) -> None:
        _accumulate_tensors_(row, as_float_values(output), binning, 1)

    gen = torch.Generator().manual_seed(0)
    for n, bad in itertools.product((32, 64, 100), (None, math.nan, math.inf)):
        torch._dynamo.reset()
        compiled = torch.compile(kernel, backend="inductor", dynamic=False)
        output = torch.randn(n, generator=gen).to(dtype)
        if bad is not None:
            output[n // 3] = bad
        want, got = new_rows(2, binning.n_bins)
        kernel(want, output)
        compiled(got, output)
        largest = float(output.float()[output.float().isfinite()].abs().max()) ** 2 + 1.0  # a square's, or a count's
        reorder = n * torch.finfo(torch.float32).eps * largest
        torch.testing.assert_close(got, want, rtol=1e-6, atol=reorder, equal_nan=True, msg=f"{n} values, {bad}")


class GeluNet(Net):
    """Linear -> GELU -> Linear, compiled; a hook of the test's own keeps a copy of each GELU output (bf16)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
        self.outputs: list[Tensor] = []
        net[1].register_forward_hook(lambda module, args, out: self.outputs.append(out.detach().clone()))
        self.net = torch.compile(net, backend="inductor")


def test_compiled_bf16_figures_are_those_of_the_rounded_output_not_of_the_float32_before_it(tmp_path):
    # Inductor fuses GELU with the hook's read: read in float32 before rounding, the max was 4.68749 where
    # the output holds 4.6875. The read goes through an opaque op, so the output is rounded first.
    torch._dynamo.reset()
    model = GeluNet()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(24, 32, generator=gen) * 3
    monitor = ActivationMonitor(modules="net.1", log_every_n_steps=1, stats=["abs_max", "min", "max"])
    L.Trainer(accelerator="cpu", devices=1, max_steps=3, precision="bf16-mixed", callbacks=[monitor],
              logger=CSVLogger(tmp_path, name="csv", version=0), log_every_n_steps=1, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False,
              ).fit(model, DataLoader(TensorDataset(x, x[:, :4]), batch_size=8))
    logged = metric_series(tmp_path / "csv" / "version_0")
    assert [out.dtype for out in model.outputs] == [torch.bfloat16] * 3
    for step, out in enumerate(model.outputs):
        out = out.float()
        want = {"abs_max": out.abs().max(), "min": out.min(), "max": out.max()}
        assert {stat: logged[f"activations/net.1/{stat}"][step] for stat in want} == {
            stat: value.item() for stat, value in want.items()}, step
