"""Could another spread, threshold, co-occurrence, scale floor or memory clear the healthy runs, keeping real spikes?

An approximate, vectorised replay of the spike judge (the steps flagged keep their deviations in
the spread, which the package's ``SpikeWindows`` leaves out: a delay may differ by a step at the
threshold) over the healthy series ``benchmarks/spikes_models.py`` recorded, and over the faulty
series of ``benchmarks/spikes_healthy.py`` (a fault at step 2,000 of a 3,000-step run: a corrupt
batch, wrong targets, the learning rate x30; MLP and attention, seeds 0 and 1), recorded here
into the same store if missing, and over the recorded classifiers of ``tests/data`` with one batch's
loss and gradient norm multiplied (the zoo's CNN x1000 and x100 at steps 300, 600, 900; the ViT
x1000 at 500 and 800). Per variant: the healthy runs with a flag after the first 10%, their
flags, the delay from each fault to its first flag (X: missed), and how many planted batches are
flagged at their step.

    python benchmarks/spikes_variants.py      # after spikes_models.py; about 8 minutes on 2 loaded cores
"""

from __future__ import annotations

import glob
import math
import os
import sys
import warnings
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spikes_healthy import FAULTS, train  # noqa: E402
from spikes_models import STORE  # noqa: E402

from lightning_hooks.measure.spikes import _TAIL_TO_STD, TAIL_QUANTILE  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "before (tail q75 / 1.15)": dict(q=0.75, k=1 / 1.1503), "shipped (tail q90 / 1.645, z 6)": {},
    "tail q85 / 1.44": dict(q=0.85, k=1 / 1.4395),
    "tail q95 / 1.96": dict(q=0.95, k=1 / 1.96), "z 7": dict(thr=7.0), "floor 0.1": dict(floor=0.1),
    "both signals (other z > 2)": dict(co=2.0), "both signals (other z > 3)": dict(co=3.0),
    "scale floor 0.01": dict(scale=0.01), "scale floor 0.03": dict(scale=0.03),
    "scale floor 0.05": dict(scale=0.05), "scale floor 0.1": dict(scale=0.1), "scale floor 0.3": dict(scale=0.3),
    "scale floor 0.05, loss only": dict(scale=0.05, scaled=(0,)),
    "beyond the run's largest excursion": dict(memory=True)}
PLANTED = (("cnn_sgd_1000", 1e3, (300, 600, 900)), ("cnn_sgd_1000", 1e2, (300, 600, 900)),
           ("vit_adamw_1000", 1e3, (500, 800)))  # recorded series in tests/data, a factor, the steps


def _median(rows: np.ndarray) -> np.ndarray:
    """Each row's median, the lower of the middle two for an even count (as torch's), NaNs skipped."""
    return np.nanquantile(rows, 0.5, axis=1, method="lower")


def zscores(values: np.ndarray, window: int = 128, recent: int = 16, warmup: int = 64, floor: float = 0.05,
            q: float = TAIL_QUANTILE, k: float = _TAIL_TO_STD) -> np.ndarray:
    """Each step's robust z-score of a positive series, as ``robust_zscore`` computes it, all steps at once."""
    log = np.log(np.clip(values, 1e-300, None))
    past = sliding_window_view(np.concatenate([np.full(window, np.nan), log]), window)[: len(log)]
    level = _median(past[:, -recent:])
    steps = _median(np.abs(np.diff(past, axis=1))) * 1.4826 / math.sqrt(2)
    before = sliding_window_view(np.concatenate([np.full(recent, np.nan), log]), recent)[: len(log)]
    deviation = log - _median(before)
    tails = sliding_window_view(np.concatenate([np.full(window, np.nan), deviation]), window)[: len(log)]
    spread = np.fmax(np.fmax(steps, np.nanquantile(np.abs(tails), q, axis=1) * k), floor)
    z = np.nan_to_num((log - level) / spread)
    z[np.isfinite(past).sum(1) < warmup] = 0
    return z


def levels(values: np.ndarray, recent: int = 16) -> np.ndarray:
    """Each step's level: the median of the ``recent`` values before it (NaN for the first step)."""
    return _median(sliding_window_view(np.concatenate([np.full(recent, np.nan), values]), recent)[: len(values)])


def above_scale(values: np.ndarray, fraction: float) -> np.ndarray:
    """Whether each step rose above its level by ``fraction`` of the highest level the run has had so far."""
    level = levels(values)
    return values - level >= fraction * np.fmax.accumulate(level)


def beyond_memory(values: np.ndarray, start: int = 64) -> np.ndarray:
    """Whether each step's deviation from its level (in log) is beyond every earlier one from ``start`` on."""
    deviation = np.log(values) - np.log(levels(values))
    seen = np.fmax.accumulate(np.where(np.arange(len(values)) >= start, deviation, -np.inf))
    return deviation > np.concatenate([[-np.inf], seen[:-1]])


def flags(values: np.ndarray, thr: float = 6.0, co: float = 0.0, scale: float = 0.0, scaled: tuple[int, ...] = (0, 1),
          memory: bool = False, **kwargs: Any) -> np.ndarray:
    """The steps flagged: either signal above ``thr`` (with ``co``: and the other above ``co``).

    With ``scale``, a signal of ``scaled`` only where it also rose by that fraction of its highest level so
    far (:func:`above_scale`); with ``memory``, only beyond its largest excursion so far (:func:`beyond_memory`).
    """
    z = [zscores(values[:, s], **kwargs) for s in (0, 1)]
    over = [z[s] > thr for s in (0, 1)]
    for s in scaled if scale else ():
        over[s] &= above_scale(values[:, s], scale)
    if memory:
        over = [over[s] & beyond_memory(values[:, s]) for s in (0, 1)]
    if co:
        return (over[0] & (z[1] > co)) | (over[1] & (z[0] > co))
    return over[0] | over[1]


def planted(data: str) -> list[tuple[np.ndarray, int]]:
    """The recorded classifiers of ``data`` with one batch's loss and gradient norm multiplied (:data:`PLANTED`)."""
    out = []
    for name, factor, steps in PLANTED:
        trace = np.loadtxt(os.path.join(data, f"{name}.csv"), delimiter=",", skiprows=3)[:, :2]
        for at in steps:
            corrupt = trace[: at + 1].copy()
            corrupt[at] *= factor
            out.append((corrupt, at))
    return out


def faulty(store: str) -> dict[str, np.ndarray]:
    """spikes_healthy.py's faulty runs (2,100 steps, the fault at 2,000), recorded into ``store`` if missing."""
    out = {}
    for kind in ("mlp", "attention"):
        for seed in (0, 1):
            for i, fault in enumerate(FAULTS):
                path = os.path.join(store, f"spike_fault{i}_{kind}_s{seed}.pt")
                if not os.path.exists(path):
                    torch.save(train(kind, seed, 2100, fault, 2000), path)
                out[f"{fault}, {kind} s{seed}"] = torch.load(path).numpy()
    return out


def main() -> int:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", RuntimeWarning)  # the medians of the first, empty windows
    healthy = {p: torch.load(p)["values"].numpy() for p in sorted(glob.glob(os.path.join(STORE, "spike_series_*.pt")))}
    faults = faulty(STORE)
    batches = planted(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data"))
    print(f"{len(healthy)} healthy runs; delays from the fault (step 2,000) to the first flag, in the order:")
    print("; ".join(faults) + "\n")
    print("| variant | runs flagged | flags after 10% | delays | CNN x1000, CNN x100, ViT x1000 flagged |")
    print("|---|---:|---:|---|---|")
    for name, kwargs in VARIANTS.items():
        late = [int(flags(v, **kwargs)[len(v) // 10:].sum()) for v in healthy.values()]
        delays = [np.nonzero(flags(v, **kwargs)[2000:])[0] for v in faults.values()]
        firsts = [str(d[0]) if len(d) else "X" for d in delays]
        cells = ", ".join(" ".join(firsts[i:i + 3]) for i in range(0, len(firsts), 3))
        caught = [bool(flags(v, **kwargs)[at]) for v, at in batches]
        found = ", ".join(f"{sum(caught[i:i + len(p[2])])}/{len(p[2])}" for i, p in
                          zip(np.cumsum([0] + [len(p[2]) for p in PLANTED]), PLANTED))
        print(f"| {name} | {sum(n > 0 for n in late)} | {sum(late)} | {cells} | {found} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
