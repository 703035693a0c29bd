"""GradientMonitor's rows: which gradients each row covers, their figures on device, their metrics on the host.

A row is one parameter (``granularity="parameter"``) or a selected module's parameters
(``"module"``). :func:`select_rows` chooses them when fit starts; on a logged step
:func:`row_figures` gives the rows' norms and stat rows on device, for the step's one host
transfer, and :func:`row_metrics` turns what came back into the ``gradients/<row>/<stat>``
scalars and the histograms.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_hooks.callbacks._base import log_step
from lightning_hooks.core.selection import ModuleSelection, check_limit, named_parameters
from lightning_hooks.distributed._rank_agreement import Check
from lightning_hooks.measure._sharding import ShardGroups, grad_of, local
from lightning_hooks.measure._stat_rows import N_FIELDS, summarize_rows
from lightning_hooks.measure.aggregate import StatBlock
from lightning_hooks.output._findings import owner_of
from lightning_hooks.output._histograms import log_histograms
from lightning_hooks.output.figures import HistogramBlock, ScalarBlock
from lightning_hooks.output.sinks import Charts


class Row(NamedTuple):
    """One of GradientMonitor's rows: its name, and the parameters whose gradients it covers."""

    name: str
    params: list[Tensor]


Rows = list[Row]
"""GradientMonitor's rows, in order."""


def select_rows(pl_module: pl.LightningModule, granularity: str, modules: ModuleSelection,
                targets: list[tuple[str, nn.Module]], trained: Optional[set[Tensor]]) -> Rows:
    """The rows: each trained parameter once, under its first name, or each target module with trained parameters.

    Args:
        pl_module: The model.
        granularity: ``"parameter"`` or ``"module"``.
        modules: The module selection; None for every parameter.
        targets: The modules it selected, with their names.
        trained: The parameters the optimizers hold (:func:`trained_parameters`); None when
            there is no optimizer: then those that require a gradient.

    Returns:
        One :class:`Row` per row.
    """

    def is_trained(param: Tensor) -> bool:
        return param.requires_grad if trained is None else param in trained

    if granularity == "module":
        rows = [Row(name, [p for p in m.parameters() if is_trained(p)]) for name, m in targets]
        return [row for row in rows if row.params]
    named = named_parameters(pl_module) if modules is None else (
        (f"{mname}.{pname}", p) for mname, m in targets for pname, p in named_parameters(m)
    )
    first_name: dict[Tensor, str] = {}
    for name, param in named:
        if is_trained(param):
            first_name.setdefault(param, name)
    return [Row(name, [param]) for param, name in first_name.items()]


def selection_key(modules: ModuleSelection) -> Any:
    """``modules`` as it can go in a state key: a predicate by its name, not its address."""
    if callable(modules) and not isinstance(modules, type):
        return f"{getattr(modules, '__module__', '')}.{getattr(modules, '__qualname__', type(modules).__name__)}"
    return modules


def trained_parameters(optimizers: Sequence[Any]) -> Optional[set[Tensor]]:
    """The parameters in the optimizers' param groups (frozen ones too: they may be unfrozen); None: no optimizer."""
    if not optimizers:
        return None
    return {p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}


def limit_rows(owner: str, rows: Rows, granularity: str, max_rows: Optional[int], tags_per_row: int,
               starting: bool) -> Rows:
    """``rows``, checked against ``max_rows``: over it, raise before training, or keep the first ones later.

    Rows added during training (a param group added by ``BackboneFinetuning``) past the limit
    are left out with a warning: a monitor never ends a run.

    Raises:
        ValueError: When ``starting`` and there are more than ``max_rows`` rows.
    """
    if starting:
        names = [name for name, _ in rows]
        owners = names if granularity == "module" else [owner_of(n) for n in names]
        check_limit(owner, "max_rows", max_rows, len(rows), tags_per_row, owners)
    elif max_rows is not None and len(rows) > max_rows:
        rank_zero_warn(f"{owner}: the optimizers now train {len(rows)} rows, over `max_rows`={max_rows}: the first"
                       f" {max_rows} are logged. Raise `max_rows` to see them all.")
        return rows[:max_rows]
    return rows


def untrained_message(owner: str, modules: ModuleSelection) -> str:
    """The warning for a selection of which no parameter is trained now (a frozen backbone, a ReLU)."""
    what = "the model" if modules is None else repr(modules)
    return (f"{owner}: no parameter of {what} is trained (frozen, in no optimizer's param groups, or none at all),"
            " so it has no gradient row now. Rows follow the optimizers: a parameter gets one from the first logged"
            " step at which it is trained (`requires_grad` set again, a param group added, as BackboneFinetuning"
            " does). The total norm and the anomaly flags cover every gradient the optimizers apply.")


def optimizer_layout(optimizers: Sequence[Any]) -> tuple[int, ...]:
    """How many parameters each param group of each optimizer holds: it changes when a param group is added."""
    return tuple(len(group["params"]) for optimizer in optimizers for group in optimizer.param_groups)


def row_figures(params: list[Tensor], norms: Tensor, rows: Rows, block: Optional[StatBlock],
                row_shards: ShardGroups, granularity: str) -> tuple[list[bool], dict[str, Tensor]]:
    """Which rows have gradients this step, and the rows' norms and stat rows, on device.

    Args:
        params: The step's parameters with gradients.
        norms: Their gradient norms, in the same order.
        rows: The rows, as :func:`select_rows` gives them.
        block: The rows' stat block, filled here; None when no stat but the norm is logged.
        row_shards: How each row's gradients are split across ranks.
        granularity: ``"parameter"`` or ``"module"``.

    Returns:
        Per row whether it had gradients, and the figures to bring to the host.
    """
    position = {p: i for i, p in enumerate(params)}
    present = [[p for p in row_params if p in position] for _, row_params in rows]
    if block is not None:
        pairs = [(index, param) for index, row_params in enumerate(present) for param in row_params]
        calls = [int(row_shards.leads[index]) for index, _ in pairs]  # a sharded gradient counts once
        grads = [local(grad_of(param)) for _, param in pairs]  # type: ignore[arg-type]
        added = block.add_many([index for index, _ in pairs], grads, calls)  # type: ignore[arg-type]
        # FSDP1 may leave the leading rank no part of a gradient: count it still
        uncounted = [index for (index, _), done, call in zip(pairs, added, calls) if call and not done]
        if uncounted:
            block.count(uncounted)
        row_shards.reduce_stat_rows_(block.rows)  # a sharded row: whole-gradient figures
    figures = {"row_norms": _row_norms(norms, position, present, granularity)}
    if block is not None:
        figures["row_stats"] = block.rows
    return [bool(row_params) for row_params in present], figures


def _row_norms(norms: Tensor, position: dict[Tensor, int], present: list[list[Tensor]], granularity: str) -> Tensor:
    """Each row's gradient norm from the per-gradient ``norms``; NaN for a row without gradients.

    One row per parameter: one ``index_select``, its index sent to the device once for each
    layout of the rows (the same step after step), not a view per row.
    """
    nan = norms.new_full((1,), math.nan)
    if granularity == "parameter":
        index = tuple(position[params[0]] if params else len(position) for params in present)
        return torch.cat([norms, nan]).index_select(0, _device_index(index, norms.device))
    return torch.stack([
        torch.linalg.vector_norm(torch.stack([norms[position[p]] for p in params])) if params else nan[0]
        for params in present
    ])


@functools.lru_cache(maxsize=8)
def _device_index(index: tuple[int, ...], device: torch.device) -> Tensor:
    """``index`` as a tensor on ``device``, made once for each index (a host-to-device copy)."""
    return torch.tensor(index, dtype=torch.long, device=device)


def row_tags(rows: Rows, stats: Sequence[str]) -> dict[str, list[str]]:
    """Every row's tags by stat (``""``: its histogram's), made once per fit rather than at each logged step."""
    return {stat: [f"gradients/{name}/{stat}" if stat else f"gradients/{name}" for name, _ in rows]
            for stat in ("", *stats)}


def row_metrics(trainer: pl.Trainer, check: Check, names: Sequence[str], tags: dict[str, list[str]],
                present: list[bool], block: Optional[StatBlock], stats: Sequence[str],
                histograms: bool) -> tuple[dict[str, float], list[ScalarBlock]]:
    """The total norms as scalars, each present row's stats as typed blocks; the rows' histograms written.

    The rows are read as one block (:func:`summarize_rows`), not one row at a time.

    Args:
        trainer: The trainer, for its loggers and step.
        check: The step's figures on the host: ``check.extra`` holds what :func:`row_figures` gave.
        names: The rows' names.
        tags: The rows' tags, from :func:`row_tags`.
        present: Per row whether it had gradients this step.
        block: The rows' stat block, emptied here; None when no stat but the norm is logged.
        stats: Which stats to log per row.
        histograms: Whether to write histograms.

    Returns:
        The total norms by tag, and one block per stat of the rows (``gradients``/``norm``...).
    """
    metrics = {"gradients/total_norm": check.norms[-1]}
    if len(check.norms) > 2:
        metrics.update({f"gradients/total_norm/group{g}": n for g, n in enumerate(check.norms[:-1])})
    index = [i for i, here in enumerate(present) if here]  # rows without a gradient this step: unused or frozen
    if not index:
        return metrics, []
    present_names = [names[i] for i in index]
    figures = []
    if "norm" in stats:
        norms = check.extra["row_norms"][index].tolist()
        figures.append(ScalarBlock("gradients", "norm", present_names, norms, [tags["norm"][i] for i in index]))
    if block is None:
        return metrics, figures
    rows = check.extra["row_stats"].reshape(len(present), -1)[index]
    summary = summarize_rows(rows)
    figures += [ScalarBlock("gradients", stat, present_names, summary[stat].tolist(), [tags[stat][i] for i in index])
                for stat in stats if stat != "norm"]
    if histograms:
        log_histograms(trainer, HistogramBlock("gradients", present_names, [tags[""][i] for i in index], summary,
                                               rows[:, N_FIELDS:]), block.edges, log_step(trainer))
    block.reset()
    return metrics, figures


class GradientRows:
    """GradientMonitor's rows in one fit: chosen for what the optimizers train, and their figures at a logged step.

    Args:
        owner: The monitor's name, for its warnings and errors.
    """

    def __init__(self, owner: str) -> None:
        self.owner, self.granularity, self.stats, self.bins = owner, "parameter", ("norm",), 128
        self.rows: Rows = []
        self.names: list[str] = []
        self.tags: dict[str, list[str]] = {}  # the rows' tags by stat, made once per fit
        self.present: list[bool] = []  # which rows had gradients at the last logged step
        self.block: Optional[StatBlock] = None  # the rows' stat rows; None when only norms are logged
        self._shards = ShardGroups([])  # how each row's gradients are split across ranks
        self._layout: tuple[int, ...] = ()  # the optimizers' param group sizes the rows were chosen for

    def choose(self, trainer: pl.Trainer, pl_module: pl.LightningModule, monitor: Any, histograms: bool,
               starting: bool) -> None:
        """Rows for what the optimizers hold, their tags and buffers; again at a step whose param groups changed.

        ``monitor``'s settings as they are now (``granularity``, ``stats``, ``bins``, ``max_rows``,
        ``modules`` and the modules it selected) hold until the next choice. Too many rows raise
        before training (``starting``), and a selection with nothing trained warns then; rows
        added later past ``max_rows`` are left out.
        """
        self.granularity, self.stats, self.bins = monitor.granularity, monitor.stats, monitor.bins
        self._layout = optimizer_layout(trainer.optimizers)
        modules, trained = monitor.modules, trained_parameters(trainer.optimizers)
        rows = select_rows(pl_module, self.granularity, modules, monitor._targets, trained)
        rows = limit_rows(self.owner, rows, self.granularity, monitor.max_rows, len(self.stats) + histograms, starting)
        self.rows, self.names, self.tags = rows, [name for name, _ in rows], row_tags(rows, self.stats)
        needs_rows = histograms or any(s != "norm" for s in self.stats)
        self.block = StatBlock(self.names, self.bins, pl_module.device) if needs_rows and self.names else None
        self._shards = ShardGroups([params[0] for _, params in rows])
        if starting and not any(p.requires_grad for _, params in rows for p in params):
            rank_zero_warn(untrained_message(self.owner, modules))

    def charts(self) -> Charts:
        """One Custom Scalars chart per stat drawing every row, one of the total norms, one of the flags."""
        charts: dict[str, list[str]] = {f"{s} by {self.granularity}": [rf"gradients/.*/{s}$"] for s in self.stats}
        return {**charts, "total norm": [r"gradients/total_norm(/group\d+)?$"], "anomaly flags": [r"anomalies/"]}

    def changed(self, trainer: pl.Trainer) -> bool:
        """Whether the optimizers' param groups changed since the rows were chosen (a param group added)."""
        return optimizer_layout(trainer.optimizers) != self._layout

    def figures(self, params: list[Tensor], norms: Tensor) -> dict[str, Tensor]:
        """The rows' figures of a logged step, on device (:func:`row_figures`)."""
        if not self.rows:
            self.present = []
            return {}
        self.present, figures = row_figures(params, norms, self.rows, self.block, self._shards, self.granularity)
        return figures

    def metrics(self, trainer: pl.Trainer, check: Check,
                histograms: bool) -> tuple[dict[str, float], list[ScalarBlock]]:
        """The logged step's total norms and rows' stats, the histograms written (:func:`row_metrics`)."""
        return row_metrics(trainer, check, self.names, self.tags, self.present, self.block, self.stats, histograms)

    def clear(self) -> None:
        """Drop every reference to the model's parameters."""
        self.rows, self.present, self.block, self._shards = [], [], None, ShardGroups([])
