"""Kernel launches on the CPU, as the proxy for a GPU: per summarised tensor and per gradient check.

On an accelerator the cost of a small op is its launch, so what counts is how many kernels each
summarised tensor and each optimizer step's gradient check launch. This script counts, with
``torch.profiler``, the ATen calls made at top level (each launches one kernel on a GPU; views
and allocations, which launch none, are left out):

- per ``accumulate_`` call, for the tensor-op kernel (the CPU fallback and ``torch.compile``) and
  for the accelerator kernel (what a GPU runs), at several tensor sizes;
- per gradient check (``GradientAnomalyStopping`` at an optimizer step), for models of 4 to 64
  layers, to show it does not grow with the parameter count.

With ``--cpu-time`` it times instead the kernels on the CPU (the C kernel, through ``accumulate_``
as a hook calls it, the tensor-op kernel, eager and compiled by inductor, and for comparison the
accelerator kernel) in
nanoseconds per value, at 1 and 2 torch threads:
the best wall time of several repeats (the machine is shared) and the process's CPU time.

    python benchmarks/stat_kernels.py
    python benchmarks/stat_kernels.py --cpu-time
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from functools import partial
from typing import Any, Callable

import lightning as L
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hooks import GradientAnomalyStopping  # noqa: E402
from lightning_hooks.measure._device_stats import accumulate_device_  # noqa: E402
from lightning_hooks.measure.stats import Binning, _accumulate_tensors_, accumulate_, new_rows  # noqa: E402

#: ATen calls that launch no kernel: views, reshapes, allocations.
NO_KERNEL = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::select", "aten::slice", "aten::as_strided",
    "aten::expand", "aten::expand_as", "aten::view_as", "aten::unsqueeze", "aten::squeeze", "aten::t",
    "aten::transpose", "aten::permute", "aten::alias", "aten::detach", "aten::lift_fresh", "aten::unbind",
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::result_type",
}


def launches(fn: Callable[[], Any]) -> Counter:
    """The kernel-launching ATen calls ``fn`` makes at top level (not those inside other ATen calls)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    calls: Counter = Counter()
    for event in prof.events():
        if not event.name.startswith("aten::") or event.name in NO_KERNEL:
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            calls[event.name] += 1
    return calls


def per_tensor(sizes: list[int]) -> list[tuple[str, int, int]]:
    """(kernel, size, launches) for one ``accumulate_`` call of each kernel on a float32 tensor."""
    rows = []
    for size in sizes:
        values = torch.randn(size, generator=torch.Generator().manual_seed(0))
        values[::97] = float("nan")
        binning = Binning(128, values.device, values.dtype)
        kernels = (
            ("tensor-op", partial(_accumulate_tensors_, values=values, binning=binning, calls=1)),
            ("accelerator", partial(accumulate_device_, values=values, table=binning.device_table(), calls=1)),
        )
        for name, kernel in kernels:
            row = new_rows(1, binning.n_bins)[0]
            kernel(row)  # warm: tables are made at first use
            rows.append((name, size, sum(launches(partial(kernel, row)).values())))
    return rows


class _Stack(L.LightningModule):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class _ProfiledCheck(GradientAnomalyStopping):
    """Counts the launches of its own check at the third optimizer step."""

    def __init__(self) -> None:
        super().__init__(action="skip", norm_threshold=1e6, prog_bar=False)
        self.counted: Counter = Counter()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step != 2:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
            return
        self.counted = launches(lambda: super(_ProfiledCheck, self).on_before_optimizer_step(
            trainer, pl_module, optimizer))


def per_check(depths: list[int]) -> list[tuple[int, int, int]]:
    """(layers, parameters, launches) of one gradient check."""
    rows = []
    for layers in depths:
        torch.manual_seed(0)
        check = _ProfiledCheck()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, callbacks=[check],
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        data = DataLoader(TensorDataset(torch.randn(32, 16)), batch_size=8)
        trainer.fit(_Stack(layers), data)
        rows.append((layers, 2 * layers, sum(check.counted.values())))
    return rows


def time_per_value(fn: Callable[[], Any], size: int, repeats: int) -> tuple[float, float]:
    """(best wall ns, median CPU ns) per value of ``fn``, each repeat running it for at least ~20 ms."""
    fn()  # warm: tables and code paths made at first use
    start = time.perf_counter()
    fn()
    calls = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter_ns(), time.process_time_ns()
        for _ in range(calls):
            fn()
        walls.append((time.perf_counter_ns() - wall) / calls / size)
        cpus.append((time.process_time_ns() - cpu) / calls / size)
    return min(walls), sorted(cpus)[len(cpus) // 2]


def cpu_times(sizes: list[int], threads: list[int], repeats: int) -> list[tuple[str, int, int, float, float]]:
    """(kernel, values, threads, wall ns per value, CPU ns per value) of the CPU kernels.

    The accelerator kernel is timed on the CPU too, for comparison only: on a GPU its cost is
    its 12 launches (see :func:`per_tensor`), which the CPU cannot show.
    """
    before, rows = torch.get_num_threads(), []
    # What torch.compile ran on the CPU before the C kernel became a custom op it can call.
    compiled = torch.compile(_accumulate_tensors_, backend="inductor", dynamic=False)
    try:
        for size, count in ((s, t) for s in sizes for t in threads):
            torch.set_num_threads(count)
            values = torch.randn(size, generator=torch.Generator().manual_seed(0))
            values[::97] = float("nan")
            binning = Binning(128, values.device, values.dtype)
            if binning.native is None:
                raise SystemExit("the C kernel is not built or is switched off: nothing to compare")
            row = new_rows(1, binning.n_bins)[0]
            for name, kernel in (("C kernel", partial(accumulate_, row, values, binning)),
                                 ("tensor-op", partial(_accumulate_tensors_, row, values, binning, 1)),
                                 ("tensor-op, inductor", partial(compiled, row, values, binning, 1)),
                                 ("accelerator (on the CPU)",
                                  partial(accumulate_device_, row, values, binning.device_table(), 1))):
                rows.append((name, size, count, *time_per_value(kernel, size, repeats)))
    finally:
        torch.set_num_threads(before)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000, 4_000_000])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--cpu-time", action="store_true", help="time the kernels on the CPU instead")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads, for --cpu-time")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per figure, for --cpu-time")
    args = parser.parse_args()
    if args.cpu_time:
        print("| kernel | values | threads | ns per value (best wall) | ns per value (CPU time) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, size, count, wall, cpu in cpu_times(args.sizes, args.threads, args.repeats):
            print(f"| {name} | {size:,} | {count} | {wall:.2f} | {cpu:.2f} |")
        return
    print("| kernel | values | kernel launches per summarised tensor |\n| --- | ---: | ---: |")
    for name, size, count in per_tensor(args.sizes):
        print(f"| {name} | {size:,} | {count} |")
    print("\n| layers | parameters | kernel launches per gradient check |\n| ---: | ---: | ---: |")
    for layers, params, count in per_check(args.depths):
        print(f"| {layers} | {params} | {count} |")


if __name__ == "__main__":
    main()
