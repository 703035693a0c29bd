"""How the ranks agree on a checked step, and the step's one host transfer.

:func:`agree` sums every rank's flags (those of each callback reading the step) and votes (the
scaler skipped the step, a rank had no gradient, a norm was infinite, and each callback's own,
such as GradientAnomalyStopping's spike flags) in one collective on device, then starts them on
their way to the host in one transfer (:class:`HostTransfer`, named parts) together with the norms
and whatever figures each callback adds. :meth:`Agreed.checks` reads it, at once or a step later:
a :class:`Check` per callback, the same on every rank, so that no rank decides alone and no rank
waits alone. Under one process, where the step's flags follow from its norms alone
(:func:`~lightning_hooks.distributed._step_measure.flags_on_host`), the transfer brings the norms
and :func:`host_flags` makes the flags on the host.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor

from lightning_hooks.distributed._step_measure import Step
from lightning_hooks.measure.anomalies import FLAG_NAMES, AnomalyDetector


def _agree(trainer: pl.Trainer, votes: Tensor) -> Tensor:
    """Sum ``votes`` over ranks, on device: no collective under one process, and no host sync."""
    if trainer.world_size == 1:
        return votes
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(votes)  # not strategy.reduce, whose barrier blocks the host
        return votes
    return trainer.strategy.reduce(votes, reduce_op="sum")


class HostTransfer:
    """Named device tensors on their way to the host in one copy: started at once, read when needed.

    On CUDA the copy goes into pinned host memory without blocking (an event marks its end), so
    the host waits only when it reads a transfer the device has not finished, and a transfer
    read one step later has long landed. On the CPU there is nothing to copy; on another
    accelerator the copy is made when read. The one place where a step's transfer is packed and
    unpacked, so that no reader counts positions in a flat list.

    Args:
        parts: The tensors to bring, by name (any shape; each is read back flat, as float64).
        device: Where they are put together before the copy: the step's device.
    """

    def __init__(self, parts: Mapping[str, Tensor], device: torch.device) -> None:
        flat = [_flat(t) if t.device == device else _flat(t).to(device) for t in parts.values()]
        self._sizes = [(name, t.numel()) for name, t in zip(parts, flat)]
        if not any(t.dtype is torch.float64 for t in flat):  # else `cat` promotes every part to float64 itself
            flat = [t.double() for t in flat]
        if len(flat) == 1:  # nothing to join (on the CPU read as it is: each part is made for the step)
            joined = flat[0]
        else:
            joined = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
        self._ready: Optional[torch.cuda.Event] = None
        if joined.is_cuda:
            self._host = torch.empty(joined.shape, dtype=joined.dtype, pin_memory=True)
            self._host.copy_(joined, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(joined.device))
        else:
            self._host = joined

    def read(self, arrays: Collection[str] = ()) -> dict[str, Any]:
        """Each part as a list of floats, or for the names in ``arrays`` a flat float64 numpy array, by name.

        A block of stat rows is read as arrays: a list would be a Python float per value.
        """
        if self._ready is not None:
            self._ready.synchronize()
        on_host = self._host.cpu()
        if len(self._sizes) == 1 and self._sizes[0][0] not in arrays:  # the usual step, one part: no numpy view
            return {self._sizes[0][0]: on_host.tolist()}
        host = on_host.numpy()
        out, start = {}, 0
        for name, size in self._sizes:
            piece = host[start : start + size]
            out[name] = piece if name in arrays else piece.tolist()
            start += size
        return out


def _flat(tensor: Tensor) -> Tensor:
    return tensor if tensor.dim() == 1 else tensor.reshape(-1)


@dataclass
class Check:
    """One optimizer step's figures, on the host, for one callback; flags and the rest agreed across ranks."""

    flags: dict[str, bool]
    amp_overflow: Optional[bool]
    norms: list[float]
    anomalous: bool
    extra: dict[str, np.ndarray]
    """The callback's own figures of the step, by the names it gave them, flat float64 arrays."""
    skipped: bool
    """The scaler skipped the step, or a rank had no gradient: it says nothing about the gradients."""
    unsure: bool
    """A rank had an infinite norm that a finite gradient may have: measure exactly, agree again."""
    votes: dict[str, list[float]] = field(default_factory=dict)
    """The callback's own votes of the step, by the names it gave them, summed over the ranks."""


def conclude(trainer: pl.Trainer, detectors: Sequence[AnomalyDetector], steps: Sequence[Step],
             extras: Sequence[Mapping[str, Tensor]], remember: bool = True,
             own_votes: Sequence[Mapping[str, Tensor]] = ()) -> list[Check]:
    """Agree on every callback's flags across ranks on device, then read everything in one transfer.

    :func:`agree`, then :meth:`Agreed.checks` at once: see those.
    """
    return agree(trainer, detectors, steps, extras, own_votes).checks(remember)


def agree(trainer: pl.Trainer, detectors: Sequence[AnomalyDetector], steps: Sequence[Step],
          extras: Sequence[Mapping[str, Tensor]], own_votes: Sequence[Mapping[str, Tensor]] = ()) -> Agreed:
    """Agree on every callback's flags across ranks on device, and start the step's one transfer to the host.

    Every rank reaches the one collective at every optimizer step, a rank without
    gradients too, so a decision one rank alone made is everyone's and no rank waits alone.
    However many callbacks read the step, there is one collective and one host transfer. The
    host does not wait here: it reads the transfer in :meth:`Agreed.checks`, now or a step later.
    Under one process there is nothing to agree on: the votes go into the transfer as they are
    (callbacks whose flags are one tensor send it once), and those the host knows stay on the host.

    Args:
        trainer: The trainer, for the world size and the strategy.
        detectors: Per callback, the thresholds that gave its step's flags, and the running medians.
        steps: Per callback, the step as :func:`~lightning_hooks.distributed._step_measure.measure_step` gives
            it (the same figures, each with its own flags).
        extras: Per callback, more device figures to bring to the host in the same transfer, by name.
        own_votes: Per callback (or none), more device figures to sum over the ranks in the same
            collective, by name: each must have the same shape on every rank.

    Returns:
        The agreed step, on its way to the host.
    """
    shared = steps[0]
    norms = shared.figures.group_norms
    device = norms.device
    if shared.flags is None:  # one process, flags made on the host: the group and total norms are all there is to bring
        parts = {"norms": norms}
        own: dict[str, int] = {}
        for i, mine in enumerate(own_votes):
            for name, t in mine.items():
                parts[f"vote/{i}/{name}"], own[f"{i}/{name}"] = t, t.numel()
        for i, extra in enumerate(extras):
            for name, t in extra.items():
                parts[f"{i}/{name}"] = t
        return Agreed(HostTransfer(parts, device), list(detectors), list(steps), [list(e) for e in extras],
                      [list(own) for own in own_votes], {}, own, list(own), {})
    votes: dict[str, Union[Tensor, float]] = {}
    # Under one process, callbacks whose flags are one tensor (detectors that flag alike) send it once;
    # across ranks every callback votes, so that the collective's size never depends on a rank's tensors.
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for i, step in enumerate(steps):
        alike = id(step.flags) if trainer.world_size == 1 else i
        aliases[f"flags{i}"] = name = first.setdefault(alike, f"flags{i}")
        votes[name] = step.flags
    votes.update(overflow=shared.overflow if shared.overflow is not None else 0.0, empty=float(not shared.params),
                 unsure=shared.unsure)
    votes.update({f"{i}/{name}": t for i, own in enumerate(own_votes) for name, t in own.items()})
    sizes = {name: vote.numel() if isinstance(vote, Tensor) else 1 for name, vote in votes.items()}
    offsets, start = {}, 0
    for name, size in sizes.items():
        offsets[name], start = start, start + size
    offsets.update({alias: offsets[name] for alias, name in aliases.items()})
    sizes.update({alias: sizes[name] for alias, name in aliases.items()})
    if trainer.world_size > 1:
        parts = {"votes": _agree(trainer, torch.cat([_on(v, device).reshape(-1).double() for v in votes.values()]))}
        constants: dict[str, float] = {}
    else:  # nothing to agree on: the votes go as they are, and those the host knows stay on the host
        parts = {f"vote/{name}": v for name, v in votes.items() if isinstance(v, Tensor)}
        constants = {name: v for name, v in votes.items() if not isinstance(v, Tensor)}
    parts["norms"] = norms
    parts.update({f"{i}/{name}": t for i, extra in enumerate(extras) for name, t in extra.items()})
    return Agreed(HostTransfer(parts, device), list(detectors), list(steps), [list(e) for e in extras],
                  [list(own) for own in own_votes], offsets, sizes, list(votes), constants)


def _on(vote: Union[Tensor, float], device: torch.device) -> Tensor:
    return vote if isinstance(vote, Tensor) else torch.full((), vote, device=device)


@dataclass
class Agreed:
    """A step agreed across ranks on device, its one transfer to the host started: read by :meth:`checks`."""

    transfer: HostTransfer
    detectors: list[AnomalyDetector]
    steps: list[Step]
    extras: list[list[str]]
    """Per callback, the names of its own figures in the transfer."""
    own_votes: list[list[str]]
    """Per callback (or none), the names of its own votes."""
    offsets: dict[str, int]
    """Where each vote starts in the agreed votes."""
    sizes: dict[str, int]
    votes: list[str]
    """The votes in their order, each once."""
    constants: dict[str, float]
    """Under one process, the votes the host already knows (no device tensor made for them)."""

    def checks(self, remember: bool = True) -> list[Check]:
        """Read the transfer (the host waits only if the device has not finished it): a :class:`Check` per callback.

        A clean, settled step's norms join each detector's running median (with ``remember``:
        not for a closure's later evaluations within one optimizer step, LBFGS, so that the
        medians count steps).
        """
        arrays = {f"{i}/{name}" for i, names in enumerate(self.extras) for name in names}
        if self.steps[0].flags is None:
            return self._checks_on_host(self.transfer.read(arrays), remember)
        host = self.transfer.read(arrays)
        offsets, voted = self.offsets, host.get("votes")
        if voted is None:  # one process: the votes as they were cast
            voted = []
            for name in self.votes:
                voted.extend([self.constants[name]] if name in self.constants else host[f"vote/{name}"])
        overflowed = voted[offsets["overflow"]] > 0
        skipped = overflowed or voted[offsets["empty"]] > 0
        norms = self.steps[0].figures.group_norms
        checks = []
        for i, (detector, step) in enumerate(zip(self.detectors, self.steps)):
            flags = _flags(detector, voted[offsets[f"flags{i}"] : offsets[f"flags{i}"] + step.flags.numel()],
                           len(host["norms"]))
            # Settled without an exact measure when no flag could hinge on it, or the scaler skips the step.
            unsure = voted[offsets["unsure"]] > 0 and bool(detector.enabled_flags) and not overflowed
            anomalous = any(flags.values())
            if remember and not anomalous and not skipped and not unsure:
                detector.remember(norms, step.key)
            amp = overflowed if step.overflow is not None else None
            extra = {name: host[f"{i}/{name}"] for name in self.extras[i]}
            mine = self.own_votes[i] if self.own_votes else []
            summed = {name: voted[offsets[f"{i}/{name}"] : offsets[f"{i}/{name}"] + self.sizes[f"{i}/{name}"]]
                      for name in mine}
            checks.append(Check(flags, amp, host["norms"], anomalous, extra, skipped, unsure, summed))
        return checks

    def _checks_on_host(self, host: dict[str, Any], remember: bool) -> list[Check]:
        """:meth:`checks` where the flags are made on the host (one process, no scaler, see :func:`host_flags`)."""
        norms, checks = host["norms"], []
        # A gradient's infinite norm (a finite gradient's may overflow) makes the total's infinite or NaN:
        # only then are the gradients' own norms read (on such a step alone, a second read).
        figures = self.steps[0].figures
        unsure_any = not math.isfinite(norms[-1]) and not figures.exact and bool(torch.isinf(figures.measured).any())
        alike: dict[Any, dict[str, bool]] = {}  # detectors that flag alike: made once
        for i, (detector, step) in enumerate(zip(self.detectors, self.steps)):
            flags = alike.get(detector.shares_flags)
            if flags is None:
                flags = alike[detector.shares_flags] = host_flags(detector, norms)
            unsure = unsure_any and bool(detector.enabled_flags)
            anomalous = any(flags.values())
            if remember and not anomalous and not unsure and step.params:
                detector.remember(step.figures.group_norms, step.key)
            names, mine = self.extras[i], self.own_votes[i] if self.own_votes else None
            extra = {name: host[f"{i}/{name}"] for name in names} if names else {}
            summed = {name: host[f"vote/{i}/{name}"] for name in mine} if mine else {}
            checks.append(Check(dict(flags), None, norms, anomalous, extra, not step.params, unsure, summed))
        return checks


def _flags(detector: AnomalyDetector, votes: list[float], n_cols: int) -> dict[str, bool]:
    """The agreed flags by name: all gradients first, as "<flag>"; then per group, as "<flag>/group<i>", if several."""
    columns = [(n_cols - 1, "")] + ([(g, f"/group{g}") for g in range(n_cols - 1)] if n_cols > 2 else [])
    return {
        name + suffix: votes[row * n_cols + col] > 0
        for row, name in enumerate(FLAG_NAMES) if name in detector.enabled_flags
        for col, suffix in columns
    }


def host_flags(detector: AnomalyDetector, norms: list[float]) -> dict[str, bool]:
    """:func:`~lightning_hooks.measure.anomalies.anomaly_flags` made on the host from the group and total norms.

    For a detector without ``relative_threshold``, whose columns are finite exactly when their norms
    are (:func:`~lightning_hooks.distributed._step_measure.flags_on_host`): the same comparisons, in
    the same float64, as on device, named as :func:`_flags` names the device's.
    """
    n_cols = len(norms)
    columns = [(norms[-1], "")] + ([(norms[g], f"/group{g}") for g in range(n_cols - 1)] if n_cols > 2 else [])
    threshold, low, check_finite = detector.norm_threshold, detector.min_norm, detector.check_finite
    out = {}
    for name in detector.enabled_flags:
        for norm, suffix in columns:
            ok = math.isfinite(norm)
            if name == "nonfinite":
                fired = not ok
            elif name == "exploding":
                fired = (threshold is not None and norm > threshold and ok) or (not check_finite and not ok)
            else:
                fired = norm < low and ok
            out[name + suffix] = fired
    return out
