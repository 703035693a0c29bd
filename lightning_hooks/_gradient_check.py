"""The gradient check GradientMonitor and GradientAnomalyStopping share: flags, agreement, reports."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.amp.grad_scaler import OptState
from torch.utils.hooks import RemovableHandle

from lightning_hooks._base import HookCallback
from lightning_hooks._compat import BarCount
from lightning_hooks._provenance import NEVER, NonFiniteTrace
from lightning_hooks._sharding import ShardGroupCache, grad_of, note_flat_shards
from lightning_hooks.anomalies import (
    FLAG_NAMES,
    AnomalyDetector,
    AnomalyReport,
    GradientFigures,
    gradient_figures,
)
from lightning_hooks.selection import ModuleSelection, named_parameters
from lightning_hooks.sinks import log_text


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r}")


def _params_with_grads(optimizer: Any) -> tuple[list[Tensor], list[int]]:
    """Return the parameters of ``optimizer`` that have a dense gradient, and how many per group."""
    params, sizes = [], []
    for group in optimizer.param_groups:
        present = [p for p in group["params"] if (p.grad is not None and p.grad.layout == torch.strided)
                   or (p.grad is None and grad_of(p) is not None)]  # an FSDP1 rank's empty part: an empty gradient
        params.extend(present)
        sizes.append(len(present))
    return params, sizes


def _amp_overflow(trainer: pl.Trainer, optimizer: Any, device: torch.device) -> Optional[Tensor]:
    """Whether the AMP grad scaler found an Inf or a NaN, and so skips this step; None without one.

    Lightning unscales before ``on_before_optimizer_step``, and ``GradScaler.unscale_`` leaves
    its finding in the optimizer's ``found_inf_per_device``. An optimizer that would unscale in
    its own ``step`` (``fused=True``) is unscaled here, as for gradient clipping, so that the
    figures are of the true gradients and a dropped update still leaves the scaler consistent.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
        scaler.unscale_(optimizer)
    found = list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
    return torch.stack([f.to(device) for f in found]).sum() > 0 if found else None


def _agree(trainer: pl.Trainer, votes: Tensor) -> Tensor:
    """Sum ``votes`` over ranks, on device: no collective under one process, and no host sync."""
    if trainer.world_size == 1:
        return votes
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(votes)  # not strategy.reduce, whose barrier blocks the host
        return votes
    return trainer.strategy.reduce(votes, reduce_op="sum")


@dataclass
class Step:
    """One optimizer step's figures, still on device."""

    key: int
    params: list[Tensor]
    figures: GradientFigures
    flags: Tensor
    overflow: Optional[Tensor]
    unsure: Tensor
    """How many gradients have an infinite norm but were not checked for NaN and Inf values."""


@dataclass
class Check:
    """One optimizer step's figures, on the host; flags and the rest agreed across ranks."""

    flags: dict[str, bool]
    amp_overflow: Optional[bool]
    norms: list[float]
    anomalous: bool
    extra: list[float]
    skipped: bool
    """The scaler skipped the step, or a rank had no gradient: it says nothing about the gradients."""
    unsure: bool
    """A rank had an infinite norm that a finite gradient may have: measure exactly, agree again."""


class GradientCheck(HookCallback):
    """The step check both gradient callbacks run in ``on_before_optimizer_step``.

    Measures the gradients and flags anomalies on device, agrees on the flags across ranks on
    device, reads the step's figures in one host transfer (two on a step with an infinite
    gradient norm, see :meth:`on_before_optimizer_step`), keeps the running median, traces NaN
    provenance and writes reports. Subclasses act on the result in :meth:`_handle`.
    """

    def __init__(
        self, modules: ModuleSelection, check_finite: bool, max_norm: Optional[float],
        relative_threshold: Optional[float], min_norm: Optional[float], window: int,
        provenance: bool, save_dir: Optional[str],
    ) -> None:
        super().__init__(modules)
        self._detector = AnomalyDetector(check_finite, max_norm, relative_threshold, min_norm, window)
        _check_bool("provenance", provenance)
        if save_dir is not None and not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(f"`save_dir` must be a directory path or None, got {save_dir!r}")
        if save_dir is not None and not os.fspath(save_dir):
            raise ValueError("`save_dir` is empty: pass a directory, or None to save nothing")
        self.check_finite, self.max_norm, self.min_norm = check_finite, max_norm, min_norm
        self.relative_threshold, self.window = relative_threshold, window
        self.provenance, self.save_dir = provenance, save_dir
        self._trace = NonFiniteTrace()
        self._micro_batches: list[tuple[int, Any]] = []  # (batch_idx, batch if saved) of this step
        self._stepped = False  # whether an optimizer step ran in the current batch
        self._param_names: dict[Tensor, str] = {}
        self._traced: list[Tensor] = []  # parameters whose gradients the trace checks
        self._shown: Optional[int] = None  # the value the progress bar shows
        self._bar = BarCount()  # carries it as an int
        self._state_key: Optional[str] = None
        self._shard_groups = ShardGroupCache()  # how the optimizer's gradients are split across ranks

    def _uses_modules(self) -> bool:
        return self.provenance

    def _key(self) -> dict[str, Any]:
        """What tells two instances apart in a checkpoint, for ``state_key``."""
        return dict(check_finite=self.check_finite, max_norm=self.max_norm,
                    relative_threshold=self.relative_threshold, min_norm=self.min_norm)

    @property
    def state_key(self) -> str:
        """Identifies this instance's state in a checkpoint, so several can be used together.

        Made once: Lightning reads it at every hook call, for its profiler's labels.
        """
        if self._state_key is None:
            self._state_key = self._generate_state_key(**self._key())
        return self._state_key

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve the module selection when it is used."""
        if self._uses_modules():
            super().setup(trainer, pl_module, stage)

    def attach(self, model: nn.Module) -> None:
        """Learn the parameter names; register the provenance hooks when asked for."""
        if self._uses_modules():
            super().attach(model)
        else:
            self.detach()
        self._param_names = {p: name for name, p in named_parameters(model)}
        note_flat_shards(model, type(self).__name__)
        if not self.provenance:
            return
        self._traced = [p for p in self._param_names if p.requires_grad]
        for index, param in enumerate(self._traced, start=len(self._targets)):
            hook = self._guard(self._param_names[param], self._trace.grad_hook(index))
            self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def _register(self, index: int, name: str, module: nn.Module) -> list[RemovableHandle]:
        if not self.provenance:
            return []
        return [module.register_forward_hook(self._guard(name, self._trace.output_hook(index)))]

    def _show(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str, value: int) -> None:
        """Show ``value`` in the progress bar if there is one and it changed (the bar keeps it).

        A ``log`` call costs a good part of a millisecond, and on an accelerator a host-to-device copy.
        """
        if trainer.progress_bar_callback is not None and value != self._shown:
            self._bar(value)
            pl_module.log(name, self._bar, prog_bar=True, logger=False, on_step=True, on_epoch=False,
                          metric_attribute=name)
            self._shown = value

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Note the micro-batch (and keep the batch, to save it) until its optimizer step."""
        if len(self._micro_batches) >= trainer.accumulate_grad_batches:  # no step came (manual optimization)
            self._new_step()
        self._trace.mark()
        self._micro_batches.append((batch_idx, batch if self.save_dir is not None else None))
        self._collecting = self.provenance

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Close the gate; drop the step's batches once its optimizer step is done."""
        self._collecting = False
        if self._stepped:
            self._new_step()

    def _new_step(self) -> None:
        self._trace.clear()
        self._micro_batches.clear()
        self._stepped = False

    def detach(self) -> None:
        """Remove the hooks, drop every reference into the model and the step, forget the progress bar.

        Lightning clears the progress bar's values for each fit.
        """
        super().detach()
        self._new_step()
        self._collecting, self._param_names, self._traced, self._shown = False, {}, [], None
        self._shard_groups.clear()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        """Check the step's gradients: after accumulation, after AMP unscaling.

        The L2 norms alone tell whether gradients are finite unless a norm is infinite, which a
        finite gradient whose float32 norm overflows also gives; only then (agreed across
        ranks) are the gradients measured again exactly, in a second collective and transfer.
        """
        step = self._measure(trainer, optimizer, exact=False)
        extra = self._extra(trainer, step)
        check = self._conclude(trainer, step, extra)
        if check.unsure:
            step = self._measure(trainer, optimizer, exact=True)
            check = self._conclude(trainer, step, extra)
        self._handle(trainer, pl_module, optimizer, step, check)
        self._trace.clear()
        self._stepped = True

    def _extra(self, trainer: pl.Trainer, step: Step) -> list[Tensor]:
        """More device figures to bring to the host in the step's one transfer."""
        return []

    def _handle(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, step: Step,
                check: Check) -> None:
        raise NotImplementedError

    def _measure(self, trainer: pl.Trainer, optimizer: Any, exact: bool) -> Step:
        params, sizes = _params_with_grads(optimizer)
        device = params[0].device if params else trainer.strategy.root_device
        overflow = _amp_overflow(trainer, optimizer, device) if params else None  # may unscale: first
        grads: list[Tensor] = [p.grad if p.grad is not None else grad_of(p) for p in params]  # type: ignore[misc]
        figures = gradient_figures(grads, sizes, device=device, exact=exact, shards=self._shard_groups(params))
        key = next((i for i, opt in enumerate(trainer.optimizers) if opt is optimizer), 0)
        flags = self._detector.flags(figures, key)
        if overflow is not None:  # the scaler skips this step itself
            flags = flags & ~overflow
        unsure = torch.zeros((), device=device) if exact else torch.isinf(figures.norms).sum()
        return Step(key, params, figures, flags, overflow, unsure)

    def _conclude(self, trainer: pl.Trainer, step: Step, extra: list[Tensor]) -> Check:
        """Agree on the flags across ranks on device, then read everything in one transfer.

        Every rank reaches the one collective at every optimizer step, a rank without
        gradients too, so a decision one rank alone made is everyone's and no rank waits alone.
        """
        norms = step.figures.group_norms
        overflow = step.overflow if step.overflow is not None else torch.zeros((), device=norms.device)
        empty = torch.full((), float(not step.params), device=norms.device)
        votes = torch.cat([t.reshape(-1).double() for t in (step.flags, overflow, empty, step.unsure)])
        parts = [_agree(trainer, votes), norms, *extra]
        host = torch.cat([p.reshape(-1).to(norms.device, torch.float64) for p in parts]).cpu().tolist()
        n_flags, n_cols = step.flags.numel(), norms.numel()
        # All gradients first, as "<flag>"; then per group, as "<flag>/group<i>", if several.
        columns = [(n_cols - 1, "")] + ([(g, f"/group{g}") for g in range(n_cols - 1)] if n_cols > 2 else [])
        flags = {
            name + suffix: host[row * n_cols + col] > 0
            for row, name in enumerate(FLAG_NAMES) if name in self._detector.enabled_flags
            for col, suffix in columns
        }
        overflowed, skipped = host[n_flags] > 0, host[n_flags] > 0 or host[n_flags + 1] > 0
        # Settled without an exact measure when no flag could hinge on it, or the scaler skips the step.
        unsure = host[n_flags + 2] > 0 and bool(self._detector.enabled_flags) and not overflowed
        anomalous = any(flags.values())
        if not anomalous and not skipped and not unsure:
            self._detector.remember(norms, step.key)
        amp = overflowed if step.overflow is not None else None
        start = n_flags + 3
        return Check(flags, amp, host[start : start + n_cols], anomalous, host[start + n_cols :], skipped, unsure)

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Step,
                check: Check) -> AnomalyReport:
        """Build, save and log the report; under several ranks every rank must call this."""
        n_outputs = len(self._targets)
        located = self._trace.locate(trainer, n_outputs, n_outputs + len(self._traced)) if self.provenance else None
        norms, bad_grads = torch.stack([step.figures.norms, step.figures.bad.double()]).cpu().tolist()
        names = [self._param_names.get(p, f"param{i}") for i, p in enumerate(step.params)]
        largest = sorted(((n, v) for n, v in zip(names, norms) if math.isfinite(v)), key=lambda item: -item[1])
        # First bad first: in the order backward made them non-finite; the rest in optimizer order.
        went_bad = {p: located.first[i] for i, p in enumerate(self._traced, n_outputs)} if located else {}
        bad = sorted((i for i, is_bad in enumerate(bad_grads) if is_bad),
                     key=lambda i: went_bad.get(step.params[i], NEVER))
        module = located.earliest(range(n_outputs)) if located else None
        micro = located.micro_batch if located and located.micro_batch is not None else -1
        batch_idx, batch = self._micro_batches[micro] if self._micro_batches else (None, None)
        report = AnomalyReport(
            step=trainer.global_step, epoch=trainer.current_epoch, batch_idx=batch_idx,
            flags=tuple(name for name, fired in check.flags.items() if fired),
            total_norm=check.norms[-1], group_norms=tuple(check.norms[:-1]),
            first_nonfinite_module=None if module is None else self.module_names[module],
            nonfinite_rank=located.rank if located else None,
            nonfinite_params=tuple(names[i] for i in bad),
            largest_norms=tuple(largest[:5]),
        )
        if self.save_dir is not None:
            report = replace(report, saved_path=self._save(trainer, pl_module, report, batch))
        text = "\n".join("    " + line for line in str(report).splitlines())  # markdown code block
        log_text(trainer, "anomalies/report", text, trainer.global_step)
        return report

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: AnomalyReport,
              batch: Any) -> str:
        assert self.save_dir is not None
        os.makedirs(self.save_dir, exist_ok=True)
        path = os.path.join(self.save_dir, f"anomaly-step{report.step}-rank{trainer.global_rank}.pt")
        payload = {"report": asdict(report), "batch": batch, "batches": [b for _, b in self._micro_batches],
                   "state_dict": pl_module.state_dict()}
        torch.save(move_data_to_device(payload, "cpu"), path)
        return path

    def _state(self) -> dict[str, Any]:
        return {"detector": self._detector.state_dict()}

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        self._detector.load_state_dict(state_dict["detector"])
