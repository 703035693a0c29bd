"""The GPU benchmark: a GPT-2-small-sized transformer in bf16, the CPU table's configurations, and host syncs.

Two parts, both on one CUDA device:

- **Overhead**: the configurations of the CPU benchmark (``configs.build_configs``), each a real
  ``Trainer.fit`` with ``precision="bf16-mixed"``, interleaved with plain fits in shuffled rounds
  by the same harness, reported as the median ratio to plain training.
- **Host syncs**: ``torch.cuda.set_sync_debug_mode`` counts every synchronizing CUDA call in the
  forward and backward passes (where the hooks run) and in each callback's step hooks, on
  logged and non-logged steps. The design says: none in forward/backward, none on a non-logged
  step for ``ActivationMonitor``, one transfer per logged step per callback, and one per
  optimizer step for the gradient check.

    python benchmarks/gpu.py                 # both, about 3 minutes on an H100-class GPU
    python benchmarks/gpu.py --syncs-only    # the sync count alone, in seconds

Without CUDA it says so and exits 0. ``tests/test_gpu.py`` runs the sync check on a small model.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import build_configs  # noqa: E402
from harness import Device, Schedule, Workload, analyse, timed_rounds  # noqa: E402

from lightning_hooks import ActivationMonitor, GradientMonitor  # noqa: E402


class GPT(pl.LightningModule):
    """A GPT-2-style decoder: token and position embeddings, pre-norm blocks, tied head, AdamW."""

    def __init__(self, layers: int = 12, width: int = 768, heads: int = 12, vocab: int = 50257, context: int = 1024):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=ids.device)
        x = self.tokens(ids) + self.positions(torch.arange(seq, device=ids.device))
        return self.norm(self.blocks(x, mask=mask, is_causal=True)) @ self.tokens.weight.T

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def gpt_workload(batch: int = 8, seq: int = 512, **sizes: int) -> Workload:
    """Seeded GPT and four distinct token batches, repeated, on the GPU."""

    def model() -> pl.LightningModule:
        torch.manual_seed(0)
        return GPT(**sizes)

    def batches(n: int) -> list[Any]:
        gen = torch.Generator().manual_seed(1)
        vocab = sizes.get("vocab", 50257)
        distinct = [torch.randint(0, vocab, (batch, seq + 1), generator=gen).cuda() for _ in range(4)]
        return [(b[:, :-1], b[:, 1:]) for b in (distinct[i % 4] for i in range(n))]

    return Workload(model, batches)


@contextlib.contextmanager
def counting_syncs(counts: Counter, key: str) -> Iterator[None]:
    """Count the synchronizing CUDA calls made inside, under ``counts[key]``."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    counts[key] += sum("synchronizing" in str(w.message) for w in caught)


class SyncAudit(pl.Callback):
    """Counts host syncs per step: in forward + backward, and in each audited callback's step hooks.

    Put first in ``callbacks``. The model's ``training_step`` and backward run inside
    :func:`counting_syncs` (through the LightningModule's ``training_step`` and ``backward``);
    each audited callback's ``on_before_optimizer_step`` and ``on_train_batch_end`` too.
    """

    HOOKS = ("on_before_optimizer_step", "on_train_batch_end")

    def __init__(self, audited: list[pl.Callback]) -> None:
        self.audited = audited
        self.per_step: dict[int, Counter] = {}

    def counts(self, trainer: pl.Trainer) -> Counter:
        return self.per_step.setdefault(trainer.global_step, Counter())

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name in ("training_step", "backward"):
            setattr(pl_module, name, self._audit(trainer, "model", getattr(pl_module, name)))
        for callback in self.audited:
            for hook in self.HOOKS:
                setattr(callback, hook, self._audit(trainer, type(callback).__name__, getattr(callback, hook)))

    def _audit(self, trainer: pl.Trainer, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def audited(*args: Any, **kwargs: Any) -> Any:
            with counting_syncs(self.counts(trainer), key):
                return fn(*args, **kwargs)
        return audited


def audit_syncs(workload: Workload, every: int, steps: int, precision: str = "bf16-mixed",
                monitors: bool = True) -> dict[int, dict[str, int]]:
    """Host syncs per global step of a fit with ActivationMonitor and GradientMonitor logging every ``every``.

    With ``monitors=False``, of the same fit without them: what the model and PyTorch sync themselves.
    """
    callbacks = [ActivationMonitor(log_every_n_steps=every), GradientMonitor(log_every_n_steps=every)]
    monitors_: list[pl.Callback] = callbacks if monitors else []
    audit = SyncAudit(monitors_)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = pl.Trainer(
            accelerator="cuda", devices=1, precision=precision, max_steps=steps, default_root_dir=tmp,
            callbacks=[audit, *monitors_], log_every_n_steps=every, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False,
        )
        loader = torch.utils.data.DataLoader(workload.batches(steps), batch_size=None)
        trainer.fit(workload.model(), train_dataloaders=loader)
    return {step: dict(c) for step, c in audit.per_step.items()}


def overhead(steps: int, rounds: int) -> dict[str, Any]:
    """The CPU table's configurations on the GPT, bf16, as ratios to plain training."""
    notes: list[str] = []
    configs = {name: dataclasses.replace(c, trainer_kwargs={**c.trainer_kwargs, "precision": "bf16-mixed"})
               for name, c in build_configs(notes).items()}
    workloads = {"gpt2-small": gpt_workload()}
    schedule = Schedule(steps=steps, rounds=rounds, warmup=3, min_steps=steps, fit_seconds=60.0)
    with tempfile.TemporaryDirectory() as tmp:
        runs = timed_rounds(configs, workloads, schedule, tmp, Device("cuda", torch.cuda.synchronize))
    return {"notes": notes, "rows": analyse(runs, configs, list(workloads))["gpt2-small"]}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per fit")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--syncs-only", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "gpu_results.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device: nothing to measure.")
        return 0
    started = time.time()
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    results["syncs"] = audit_syncs(gpt_workload(), every=2, steps=6)
    results["syncs_without_monitors"] = audit_syncs(gpt_workload(), every=2, steps=6, monitors=False)
    print("host syncs per step (every=2: steps 0, 2, 4 are logged), with the monitors and without:")
    for step, counts in sorted(results["syncs"].items()):
        print(f"  step {step}: {counts}  /  {results['syncs_without_monitors'].get(step)}")
    if not args.syncs_only:
        results["overhead"] = overhead(args.steps, args.rounds)
        print("| configuration | x plain training | logged step | non-logged step | ms per step |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, row in results["overhead"]["rows"].items():
            cells = [row.get(k) for k in ("ratio", "ratio_logged", "ratio_non_logged", "ms")]
            print(f"| {name} | " + " | ".join("-" if v is None else f"{v:.3g}" for v in cells) + " |")
    results["seconds"] = round(time.time() - started, 1)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(f"written to {args.out} in {results['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
