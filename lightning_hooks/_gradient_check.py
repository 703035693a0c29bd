"""The gradient check GradientMonitor and GradientAnomalyStopping share, and NaN provenance."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.amp.grad_scaler import OptState
from torch.utils.hooks import RemovableHandle

from lightning_hooks._base import HookCallback
from lightning_hooks.anomalies import (
    FLAG_NAMES,
    AnomalyDetector,
    AnomalyReport,
    GradientFigures,
    gradient_figures,
)
from lightning_hooks.selection import ModuleSelection
from lightning_hooks.sinks import log_text
from lightning_hooks.stats import iter_tensors


class NonFiniteTrace:
    """Where non-finite values began: the first watched module whose output held a NaN or an Inf.

    Its forward hooks append ``(module index, on-device "all finite" bool)`` per call, in call
    order, and never sync with the host. :meth:`first_nonfinite` reads them (one transfer) only
    when asked; :meth:`clear` drops them, once per step, so no tensor outlives its step.
    """

    def __init__(self) -> None:
        self._calls: list[tuple[int, Tensor]] = []

    def hook(self, index: int) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        """Return a forward hook recording whether module ``index``'s output is all finite."""

        @torch.no_grad()
        def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            checks = [torch.isfinite(t).all() for t in iter_tensors(output) if _is_float(t)]
            if checks:
                self._calls.append((index, torch.stack(checks).all() if len(checks) > 1 else checks[0]))

        return record

    def clear(self) -> None:
        """Drop the recorded calls."""
        self._calls.clear()

    def first_nonfinite(self) -> Optional[int]:
        """Return the index of the first module, in call order, with a non-finite output, or None."""
        if not self._calls:
            return None
        device = self._calls[0][1].device
        finite = torch.stack([ok.to(device) for _, ok in self._calls]).cpu()
        bad = (~finite).nonzero()
        return self._calls[int(bad[0])][0] if bad.numel() else None

    def locate(self, trainer: pl.Trainer) -> tuple[Optional[int], Optional[int]]:
        """:meth:`first_nonfinite` over every rank: ``(module index, rank)``; all ranks must call it."""
        index = self.first_nonfinite()
        if trainer.world_size == 1:
            return index, None
        local = torch.tensor([-1 if index is None else index], device=trainer.strategy.root_device)
        found = trainer.strategy.all_gather(local).reshape(-1).tolist()
        return next(((i, rank) for rank, i in enumerate(found) if i >= 0), (None, None))


def _is_float(tensor: Tensor) -> bool:
    return tensor.layout == torch.strided and not tensor.is_meta and (
        tensor.is_floating_point() or tensor.is_complex()
    )


def _params_with_grads(optimizer: Any) -> tuple[list[Tensor], list[int]]:
    """Return the parameters of ``optimizer`` that have a dense gradient, and how many per group."""
    params, sizes = [], []
    for group in optimizer.param_groups:
        present = [p for p in group["params"] if p.grad is not None and p.grad.layout == torch.strided]
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


@dataclass
class Step:
    """One optimizer step's figures, still on device."""

    key: int
    params: list[Tensor]
    figures: GradientFigures
    flags: Tensor
    overflow: Optional[Tensor]


@dataclass
class Check:
    """One optimizer step's figures, on the host."""

    flags: dict[str, bool]
    amp_overflow: Optional[bool]
    norms: list[float]
    anomalous: bool
    extra: list[float]


class GradientCheck(HookCallback):
    """The step check both gradient callbacks run in ``on_before_optimizer_step``.

    Measures the gradients and flags anomalies on device, reads the step's figures in one
    host transfer, agrees on whether the step was anomalous across ranks, keeps the running
    median, traces NaN provenance and writes reports. Subclasses act on the result in
    :meth:`_handle`.
    """

    def __init__(
        self, modules: ModuleSelection, check_finite: bool, max_norm: Optional[float],
        relative_threshold: Optional[float], min_norm: Optional[float], window: int,
        provenance: bool, save_dir: Optional[str],
    ) -> None:
        super().__init__(modules)
        self._detector = AnomalyDetector(check_finite, max_norm, relative_threshold, min_norm, window)
        self.check_finite, self.max_norm, self.min_norm = check_finite, max_norm, min_norm
        self.relative_threshold, self.window = relative_threshold, window
        self.provenance, self.save_dir = bool(provenance), save_dir
        self._trace = NonFiniteTrace()
        self._trace_step: Optional[int] = None
        self._batch: Any = None
        self._batch_idx: Optional[int] = None
        self._param_names: dict[Tensor, str] = {}

    def _uses_modules(self) -> bool:
        return self.provenance

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve the module selection when it is used."""
        if self._uses_modules():
            super().setup(trainer, pl_module, stage)

    def attach(self, model: nn.Module) -> None:
        """Learn the parameter names; register the provenance hooks when asked for."""
        if self._uses_modules():
            super().attach(model)
        self._param_names = {p: name for name, p in model.named_parameters()}

    def _register(self, index: int, name: str, module: nn.Module) -> list[RemovableHandle]:
        if not self.provenance:
            return []
        return [module.register_forward_hook(self._guard(name, self._trace.hook(index)))]

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Start a new trace on a new step; keep a reference to the batch while it runs."""
        if trainer.global_step != self._trace_step:
            self._trace.clear()
            self._trace_step = trainer.global_step
        self._batch = batch if self.save_dir is not None else None
        self._batch_idx = batch_idx
        self._collecting = self.provenance

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Drop the batch and close the gate."""
        self._batch, self._collecting = None, False

    def detach(self) -> None:
        """Remove the hooks and drop every reference into the model and the step."""
        super().detach()
        self._trace.clear()
        self._batch, self._collecting, self._param_names = None, False, {}

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        """Check the step's gradients: after accumulation, after AMP unscaling."""
        step = self._measure(trainer, optimizer)
        if step is not None:
            check = self._conclude(trainer, step, self._extra(trainer, step))
            self._handle(trainer, pl_module, optimizer, step, check)
        self._trace.clear()

    def _extra(self, trainer: pl.Trainer, step: Step) -> list[Tensor]:
        """More device figures to bring to the host in the step's one transfer."""
        return []

    def _handle(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, step: Step,
                check: Check) -> None:
        raise NotImplementedError

    def _measure(self, trainer: pl.Trainer, optimizer: Any) -> Optional[Step]:
        params, sizes = _params_with_grads(optimizer)
        if not params:
            return None
        overflow = _amp_overflow(trainer, optimizer, params[0].device)  # may unscale: before measuring
        figures = gradient_figures([p.grad for p in params], sizes)  # type: ignore[misc]
        key = next((i for i, opt in enumerate(trainer.optimizers) if opt is optimizer), 0)
        flags = self._detector.flags(figures, key)
        if overflow is not None:  # the scaler skips this step itself
            flags = flags & ~overflow
        return Step(key, params, figures, flags, overflow)

    def _conclude(self, trainer: pl.Trainer, step: Step, extra: list[Tensor]) -> Check:
        norms = step.figures.group_norms
        overflow = step.overflow if step.overflow is not None else torch.zeros((), device=norms.device)
        parts = [step.flags, overflow, norms, *extra]
        host = torch.cat([p.reshape(-1).to(norms.device, torch.float64) for p in parts]).cpu().tolist()
        n_flags, n_cols = step.flags.numel(), norms.numel()
        # All gradients first, as "<flag>"; then per group, as "<flag>/group<i>", if several.
        columns = [(n_cols - 1, "")] + ([(g, f"/group{g}") for g in range(n_cols - 1)] if n_cols > 2 else [])
        flags = {
            name + suffix: host[row * n_cols + col] > 0
            for row, name in enumerate(FLAG_NAMES) if name in self._detector.enabled_flags
            for col, suffix in columns
        }
        overflowed = host[n_flags] > 0
        anomalous = trainer.strategy.reduce_boolean_decision(any(flags.values()), all=False)
        if not anomalous and not overflowed:
            self._detector.remember(norms, step.key)
        amp = overflowed if step.overflow is not None else None
        end = n_flags + 1 + n_cols
        return Check(flags, amp, host[n_flags + 1 : end], anomalous, host[end:])

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Step,
                check: Check) -> AnomalyReport:
        """Build, save and log the report; under several ranks every rank must call this."""
        module, rank = self._trace.locate(trainer) if self.provenance else (None, None)
        norms, max_abs = torch.stack([step.figures.norms, step.figures.max_abs]).cpu().tolist()
        names = [self._param_names.get(p, f"param{i}") for i, p in enumerate(step.params)]
        finite = [(name, norm) for name, norm in zip(names, norms) if math.isfinite(norm)]
        largest = sorted(finite, key=lambda item: -item[1])
        report = AnomalyReport(
            step=trainer.global_step, epoch=trainer.current_epoch, batch_idx=self._batch_idx,
            flags=tuple(name for name, fired in check.flags.items() if fired),
            total_norm=check.norms[-1], group_norms=tuple(check.norms[:-1]),
            first_nonfinite_module=None if module is None else self.module_names[module],
            nonfinite_rank=rank,
            nonfinite_params=tuple(n for n, high in zip(names, max_abs) if not math.isfinite(high)),
            largest_norms=tuple(largest[:5]),
        )
        if self.save_dir is not None:
            report = replace(report, saved_path=self._save(trainer, pl_module, report))
        text = "\n".join("    " + line for line in str(report).splitlines())  # markdown code block
        log_text(trainer, "anomalies/report", text, trainer.global_step)
        return report

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: AnomalyReport) -> str:
        assert self.save_dir is not None
        os.makedirs(self.save_dir, exist_ok=True)
        path = os.path.join(self.save_dir, f"anomaly-step{report.step}-rank{trainer.global_rank}.pt")
        payload = {"report": asdict(report), "batch": self._batch, "state_dict": pl_module.state_dict()}
        torch.save(move_data_to_device(payload, "cpu"), path)
        return path

    def _state(self) -> dict[str, Any]:
        return {"detector": self._detector.state_dict()}

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        self._detector.load_state_dict(state_dict["detector"])
