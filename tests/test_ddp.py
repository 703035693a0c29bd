"""Real 2-process DDP on CPU (gloo): figures reduced across ranks, hooks removed on every rank."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.helpers import TinyNet, events

pytestmark = pytest.mark.slow  # 2-process DDP runs

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "_ddp_activations.py"), str(out)],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.load(open(out / f"rank{r}.json")) for r in (0, 1)]
    return out, ranks


def test_histogram_counts_add_across_ranks_and_moments_match_the_global_batch(ddp_run):
    out, _ = ddp_run
    acc = events(str(out))
    series = acc.Histograms("activations/net.0")
    assert [e.step for e in series] == [0, 1]  # step 0, then Lightning's (n + 1) % 2 == 0
    # Step 0's global batch is the union of the batches each rank saw (4 samples each).
    x = torch.cat([torch.load(out / f"batch0-rank{r}.pt") for r in (0, 1)])
    assert series[0].histogram_value.num == 2 * 4 * 16
    model = TinyNet()
    model.load_state_dict(torch.load(out / "initial.pt"))
    with torch.no_grad():
        hidden = model.net[0](x)
    scalars = {tag: acc.Scalars(tag)[0].value for tag in acc.Tags()["scalars"] if tag.startswith("activations/net.0/")}
    assert scalars["activations/net.0/count"] == hidden.numel()
    for module in ("net.0", "net.1", "net.2"):  # one call a rank: as one process over the global batch
        assert [e.value for e in acc.Scalars(f"activations/{module}/calls")] == [1, 1], module
    assert scalars["activations/net.0/mean"] == pytest.approx(hidden.mean().item(), rel=1e-5)
    assert scalars["activations/net.0/std"] == pytest.approx(hidden.std().item(), rel=1e-5)
    assert scalars["activations/net.0/min"] == pytest.approx(hidden.min().item(), rel=1e-6)
    assert scalars["activations/net.0/max"] == pytest.approx(hidden.max().item(), rel=1e-6)
    hist = series[0].histogram_value
    assert hist.sum == pytest.approx(hidden.sum().item(), rel=1e-5, abs=1e-4)
    assert hist.sum_squares == pytest.approx(hidden.square().sum().item(), rel=1e-5)
    assert (hist.min, hist.max) == pytest.approx((hidden.min().item(), hidden.max().item()), rel=1e-6)
    limits = torch.tensor(list(hist.bucket_limit), dtype=torch.float32)
    expected = torch.bincount(torch.bucketize(hidden.flatten(), limits[:-1]), minlength=len(limits))
    assert list(hist.bucket) == expected.tolist()


def test_activation_gradients_are_each_ranks_local_gradient_combined_as_statistics(ddp_run):
    out, _ = ddp_run
    acc = events(str(out))
    model = TinyNet()
    model.load_state_dict(torch.load(out / "initial.pt"))
    local = []
    for rank in (0, 1):  # each rank's own loss over its 4 samples, before DDP averages anything
        x = torch.load(out / f"batch0-rank{rank}.pt")
        output = model(x)
        output.retain_grad()
        torch.nn.functional.mse_loss(output, x.sum(1, keepdim=True)).backward()
        local.append(output.grad.reshape(-1))
    grads = torch.cat(local)
    scalars = {stat: acc.Scalars(f"activation_grads/net.2/{stat}")[0].value
               for stat in ("count", "calls", "abs_max", "mean")}
    assert scalars["count"] == 8 and scalars["calls"] == 1
    assert scalars["abs_max"] == pytest.approx(grads.abs().max().item(), rel=1e-5)
    assert scalars["mean"] == pytest.approx(grads.mean().item(), rel=1e-5, abs=1e-7)


def test_hooks_attach_on_every_rank_and_are_removed_after_fit(ddp_run):
    _, ranks = ddp_run
    assert [r["hooks_during"] for r in ranks] == [3, 3]  # on the LightningModule, not the DDP wrapper
    assert [r["hooks_after"] for r in ranks] == [0, 0]
    assert [r["global_step"] for r in ranks] == [3, 3]


def test_rank_zero_logs_the_pull_it_measured_in_the_monitors_transfer_at_the_logged_steps_after_the_first(ddp_run):
    out, ranks = ddp_run
    pulls = events(str(out)).Scalars("activation_grads/net.2/pull")
    assert [p.step for p in pulls] == [1]  # logged at 0 and 1; from the step after the forward order is known on
    assert pulls[0].value == np.float32(ranks[0]["pulls"]["1"])  # rank zero's own, bit for bit (TensorBoard's float32)


def test_rank_zero_writes_the_layout_once(ddp_run):
    out, _ = ddp_run
    assert len(list(out.rglob("events.out.tfevents.*"))) == 1
    (layout,) = events(str(out)).Tensors("custom_scalars__config__")
    assert b"activations/.*/std$" in layout.tensor_proto.string_val[0]
