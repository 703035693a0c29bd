"""On a CUDA device: the accelerator kernel's figures, and no hidden host sync. Skipped without CUDA.

`torch.cuda.set_sync_debug_mode("error")` makes any synchronizing CUDA call raise, so a hook or
kernel that reads a value on the host, sizes an output from the data, or sorts with a sync, fails
these tests. The sync audit of a real bf16 fit is benchmarks/gpu.py's, on a small model.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

from lightning_hooks.measure.anomalies import gradient_figures
from lightning_hooks.measure.stats import Binning, accumulate_, new_rows, summarize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


@contextlib.contextmanager
def no_sync():
    """Any synchronizing CUDA call inside raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _summariser(device, dtype):
    """A function adding a tensor's figures to a fresh row, its tables made beforehand (as a StatBlock does)."""
    binning = Binning(128, torch.device(device), torch.float64 if dtype == torch.float64 else torch.float32)
    row = new_rows(1, binning.n_bins, device)[0]

    def summarise(values):
        accumulate_(row, values.reshape(-1) if dtype == torch.float64 else values.reshape(-1).float(), binning, 1)
        return row

    return summarise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_gpu_kernel_gives_the_cpu_figures_without_a_sync(dtype):
    values = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0)).to(dtype)
    values[::101] = float("nan")
    values[5], values[6], values[7] = float("inf"), -float("inf"), 0.0
    summarise, on_gpu = _summariser("cuda", dtype), values.cuda()
    with no_sync():
        row = summarise(on_gpu)
    gpu, cpu = row.cpu(), _summariser("cpu", dtype)(values)
    assert gpu[:2].tolist() == cpu[:2].tolist() and gpu[4:].tolist() == cpu[4:].tolist()  # counts, extremes, bins
    got, want = summarize(gpu.tolist()), summarize(cpu.tolist())
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-9) and got["std"] == pytest.approx(want["std"], rel=1e-9)


def test_gradient_figures_on_the_gpu_need_no_sync():
    grads = [torch.randn(n, device="cuda") for n in (10, 1000, 100_000)]
    with no_sync():
        figures = gradient_figures(grads, [1, 2], exact=True)
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert figures.group_norms[-1].item() == pytest.approx(want.item(), rel=1e-6)


def test_a_bf16_fit_syncs_only_where_the_design_says():
    from gpu import audit_syncs, gpt_workload

    small = gpt_workload(batch=2, seq=64, layers=2, width=64, heads=4, vocab=512, context=64)
    with_monitors = audit_syncs(small, every=2, steps=5)
    without = audit_syncs(small, every=2, steps=5, monitors=False)
    for step in range(5):
        counts = with_monitors[step]
        assert counts.get("model", 0) == without[step].get("model", 0), step  # the hooks add none
        assert counts.get("ActivationMonitor", 0) == (1 if step % 2 == 0 else 0), step
        assert counts.get("GradientMonitor", 0) == 1, step  # the anomaly flags, every optimizer step


def test_the_spike_judge_and_the_rollback_copy_of_the_judges_need_no_sync():
    from lightning_hooks.callbacks._spike_check import SpikeWatch, StepJudges
    from lightning_hooks.measure.anomalies import AnomalyDetector
    from lightning_hooks.measure.spikes import SpikeTrigger

    watch = SpikeWatch(SpikeTrigger(window=16, warmup=8), flight_recorder=0)
    judges = StepJudges(AnomalyDetector(relative_threshold=10.0, window=8), watch)
    values = torch.tensor([1.0, 2.0], dtype=torch.float64, device="cuda")
    watch.spikes.windows.judge(values)  # made once (the thresholds' copy to the device), outside
    for _ in range(12):
        watch.spikes.windows.remember(values)
        judges.detector.remember(values)
    with no_sync():
        z, flags = watch.spikes.windows.judge(values * 100)
        saved = judges.copy_judges()
        watch.spikes.windows.remember(values * 100)
        judges.restore_judges(saved)
        again = watch.spikes.windows.judge(values * 100)[0]
    assert flags.cpu().tolist() == [True, True] and torch.equal(z, again)
