"""One run as the Layers tab draws it: each figure a grid of layers (forward order) by logged steps.

Everything is read through TensorBoard's data provider, so a run still training shows its new
steps on the next request. The tags are those the monitors write, with or without a logger
prefix (Lightning's ``TensorBoardLogger(prefix="p")`` writes ``p-activations/...``):
``activations/<module>/<stat>``, ``val_activations/<module>/<stat>``, ``activation_grads/<module>/<stat>``,
``gradients/<param or module>/<stat>``, ``updates/<name>/log10_ratio`` and ``anomalies/<flag>``,
the text ``anomalies/report``, and the tab's own data (summaries of its plugin, which the Text tab
does not list: :mod:`lightning_hooks.output._plugin_data`): ``anomalies/flight_record_data``
(GradientAnomalyStopping's flight record, one JSON object: see
``lightning_hooks.callbacks._flight_recorder.record_json``), ``layers/forward_order`` and
``layers/unjudged_ratios``.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Union

from tensorboard.data import provider

from lightning_hooks.output._health_verdicts import UNJUDGED_RATIOS_TAG
from lightning_hooks.output._plugin_data import FLIGHT_RECORD_TAG, FORWARD_ORDER_TAG, LOOKUPS_TAG, PLUGIN_NAME
from lightning_hooks.tensorboard_plugin.flight_records import parse_record

#: Scalar tags the tab draws: an optional logger prefix, the kind, the layer, the statistic.
TAG = re.compile(r"^(?:(?P<prefix>.+)-)?(?P<kind>activations|val_activations|activation_grads|gradients|updates)"
                 r"/(?P<name>.+)/(?P<stat>[^/]+)$")
#: Anomaly flags GradientMonitor logs (1 on a step where the flag fired).
ANOMALY_TAG = re.compile(r"^(?:(?P<prefix>.+)-)?anomalies/(?P<flag>[^/]+)$")
#: The text tag (TensorBoard's text plugin adds ``/text_summary``) of anomaly reports.
REPORT_TAG = "anomalies/report/text_summary"
#: Names under a kind that are not layers.
NOT_LAYERS = frozenset({"total_norm"})
#: Statistics that are not drawn: bookkeeping, or the same figure as another (``ratio`` is ``log10_ratio``).
SKIPPED_STATS = frozenset({"count", "calls", "ratio"})
#: The figures drawn first, in this order; any other figure the run has follows.
FIRST = ("activations/std", "activations/zero_fraction", "activations/nonfinite_fraction",
         "gradients/norm", "updates/log10_ratio")
#: The loss and the learning rate, drawn above the heatmaps: the first tag each pattern finds.
CONTEXT_TAGS = (re.compile(r"^(train[_/-])?loss(_step)?$|^(train[_/-])?loss|loss$"),
                re.compile(r"^lr-|^(train[_/-])?(lr|learning_rate)$"))
#: How many points per tag to ask the provider for (TensorBoard keeps 1000 scalars per tag by default).
MAX_POINTS = 100_000
#: How many runs' figures a plugin keeps, to answer a reload of an unchanged run without reading it again.
CACHED_RUNS = 16

#: Figures by (experiment, run), with the listing they were read from: (tag, last step, last wall time)s.
FigureCache = OrderedDict[tuple[str, str], tuple[tuple[tuple[str, int, float], ...], list["Figure"]]]


@dataclass
class Figure:
    """One heatmap: ``values[row][column]`` is ``rows[row]``'s figure at ``steps[column]`` (None: not logged)."""

    key: str  # e.g. "activations/std", with the logger prefix in front when there is one: "p-activations/std"
    prefix: str
    kind: str
    stat: str
    rows: list[str]
    steps: list[int]
    values: list[list[Optional[float]]]

    def histogram_tag(self, row: int) -> Optional[str]:
        """The histogram tag a cell's click opens, or None for a figure without histograms."""
        if self.kind == "updates":
            return None
        return f"{self.kind}/{self.rows[row]}"


@dataclass
class Anomaly:
    """A logged step where anomaly flags fired, with the report and the flight record written then (if any)."""

    step: int
    flags: list[str]
    report: str = ""
    flight_record: Optional[dict[str, Any]] = None
    flight_error: str = ""  # why the flight record written at this step cannot be drawn


def natural_key(name: str) -> list[Any]:
    """Sort key putting ``net.2`` before ``net.10``: digit runs compare as numbers."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name) if part]


def layer_order(names: list[str], forward: list[str]) -> list[str]:
    """``names`` in forward order: each at the first forward-order module it is, is in, or holds.

    Parameter names (``net.0.weight``) go with their module; names the forward order does not know
    (or every name, when a run has no recorded order) follow in natural order (``net.2`` before
    ``net.10``), which is forward order for numbered stacks such as ``nn.Sequential``.
    """
    position = {name: i for i, name in enumerate(forward)}

    def key(name: str) -> tuple[int, list[Any]]:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            found = position.get(".".join(parts[:end]))
            if found is not None:
                return found, natural_key(name)
        inside = [i for module, i in position.items() if module.startswith(name + ".")]
        return (min(inside) if inside else len(forward)), natural_key(name)

    return sorted(names, key=key)


def cell(value: float) -> float:
    """A value as sent to the browser: four significant digits keep a 200-layer run's answer small."""
    return value if not math.isfinite(value) or value == 0 else float(f"{value:.4g}")


class RunReader:
    """Reads one run's figures and anomalies from a TensorBoard data provider."""

    def __init__(self, data: provider.DataProvider, ctx: Any, experiment: str,
                 cache: Optional[FigureCache] = None) -> None:
        self._data, self._ctx, self._experiment = data, ctx, experiment
        self._cache: FigureCache = OrderedDict() if cache is None else cache

    def runs(self) -> dict[str, int]:
        """Each run with layer figures or anomaly reports, and how many layer scalar tags it has (maybe 0).

        A run with only GradientAnomalyStopping has no layer figures, but its reports and flight
        records are worth a card.
        """
        listing = self._data.list_scalars(self._ctx, experiment_id=self._experiment, plugin_name="scalars")
        counts = {run: sum(1 for tag in tags if _is_layer_tag(tag)) for run, tags in listing.items()}
        texts = self._data.list_tensors(self._ctx, experiment_id=self._experiment, plugin_name="text",
                                        run_tag_filter=provider.RunTagFilter(tags=[REPORT_TAG]))
        own = self._data.list_tensors(self._ctx, experiment_id=self._experiment, plugin_name=PLUGIN_NAME,
                                      run_tag_filter=provider.RunTagFilter(tags=[FLIGHT_RECORD_TAG]))
        reported = {run for found in (texts, own) for run, tags in found.items() if tags}
        return {run: counts.get(run, 0) for run in sorted(set(counts) | reported) if counts.get(run) or run in reported}

    def figures(self, run: str) -> list[Figure]:
        """The run's figures, each a grid of layers (forward order) by the steps it was logged at.

        Read again only when the run has new points: a reload of an unchanged run is answered
        from the cache (callers must not change the figures).
        """
        listing = self._data.list_scalars(self._ctx, experiment_id=self._experiment, plugin_name="scalars",
                                          run_tag_filter=provider.RunTagFilter(runs=[run]))
        series_meta = listing.get(run, {})
        tags = [tag for tag in series_meta if _is_layer_tag(tag)]
        if not tags:
            return []
        signature = tuple(sorted((tag, series_meta[tag].max_step, series_meta[tag].max_wall_time) for tag in tags))
        cached = self._cache.get((self._experiment, run))
        if cached is not None and cached[0] == signature:
            return cached[1]
        figures = self._read_figures(run, tags)
        self._cache[(self._experiment, run)] = (signature, figures)
        while len(self._cache) > CACHED_RUNS:
            self._cache.popitem(last=False)
        return figures

    def _read_figures(self, run: str, tags: list[str]) -> list[Figure]:
        series = self._scalars(run, tags)
        forward = self.forward_order(run)
        grouped: dict[tuple[str, str, str], dict[str, dict[int, float]]] = {}
        for tag, points in series.items():
            parts = TAG.match(tag)
            assert parts is not None
            group = grouped.setdefault((parts["prefix"] or "", parts["kind"], parts["stat"]), {})
            group[parts["name"]] = {p.step: p.value for p in points}
        figures = [_figure(prefix, kind, stat, by_layer, forward)
                   for (prefix, kind, stat), by_layer in grouped.items()]
        return sorted(figures, key=_figure_rank)

    def anomalies(self, run: str) -> list[Anomaly]:
        """The steps where anomaly flags fired, each with the report written at that step."""
        listing = self._data.list_scalars(self._ctx, experiment_id=self._experiment, plugin_name="scalars",
                                          run_tag_filter=provider.RunTagFilter(runs=[run]))
        tags = [tag for tag in listing.get(run, {}) if ANOMALY_TAG.match(tag)]
        fired: dict[int, list[str]] = {}
        for tag, points in (self._scalars(run, tags) if tags else {}).items():
            flag = ANOMALY_TAG.match(tag)["flag"]  # type: ignore[index]
            for point in points:
                if point.value > 0 and flag not in fired.setdefault(point.step, []):
                    fired[point.step].append(flag)
        reports, records = self._texts(run, REPORT_TAG), self._flight_records(run)
        steps = sorted(set(fired) | set(reports) | set(records))
        return [Anomaly(step, fired.get(step, []), reports.get(step, ""), *_record_or_error(records.get(step)))
                for step in steps]

    def _flight_records(self, run: str) -> dict[int, Union[dict[str, Any], str]]:
        """The flight records by the step they were logged at: each the record, or why it cannot be drawn."""
        return {step: parse_record(text) for step, text in self._own_data(run, FLIGHT_RECORD_TAG).items()}

    def context(self, run: str) -> list[dict[str, Any]]:
        """The run's loss and learning rate, drawn above its heatmaps: ``{"tag", "steps", "values"}`` each.

        The first tag of each that :data:`CONTEXT_TAGS` finds (``train_loss``, ``loss``,
        ``train/loss``...; LearningRateMonitor's ``lr-<optimizer>``).
        """
        listing = self._data.list_scalars(self._ctx, experiment_id=self._experiment, plugin_name="scalars",
                                          run_tag_filter=provider.RunTagFilter(runs=[run]))
        tags = sorted(listing.get(run, {}), key=natural_key)
        chosen = [next((tag for tag in tags if pattern.search(tag)), None) for pattern in CONTEXT_TAGS]
        found = self._scalars(run, [tag for tag in chosen if tag]) if any(chosen) else {}
        return [{"tag": tag, "steps": [p.step for p in found[tag]], "values": [cell(p.value) for p in found[tag]]}
                for tag in chosen if tag in found]

    def forward_order(self, run: str) -> list[str]:
        """The modules in the order their forward hooks first fired, as ActivationMonitor recorded it."""
        order = self._latest_json(run, FORWARD_ORDER_TAG)
        return [str(name) for name in order] if isinstance(order, list) else []

    def lookups(self, run: str) -> dict[str, str]:
        """The watched embeddings and their weights' rows, as ActivationMonitor recorded them (latest fit)."""
        found = self._latest_json(run, LOOKUPS_TAG)
        return {str(row): str(weight) for row, weight in found.items()} if isinstance(found, dict) else {}

    def unjudged_ratios(self, run: str) -> frozenset[str]:
        """The update rows whose ratio LayerHealth does not judge, as GradientMonitor recorded them (latest fit)."""
        return self._ratio_rows(run, "unjudged")

    def scale_ratios(self, run: str) -> frozenset[str]:
        """The update rows of norms' scales, whose ratio LayerHealth judges apart (latest fit)."""
        return self._ratio_rows(run, "scales")

    def _ratio_rows(self, run: str, key: str) -> frozenset[str]:
        rows = self._latest_json(run, UNJUDGED_RATIOS_TAG)
        names = rows.get(key, []) if isinstance(rows, dict) else []
        return frozenset(str(name) for name in names) if isinstance(names, list) else frozenset()

    def _latest_json(self, run: str, tag: str) -> Any:
        """The newest entry of the tab's own ``tag`` in ``run``, parsed; None where there is none or it is no JSON."""
        texts = self._own_data(run, tag)
        try:
            return json.loads(texts[max(texts)]) if texts else None
        except ValueError:
            return None

    def histogram(self, run: str, tag: str, step: int) -> Optional[dict[str, Any]]:
        """The histogram logged under ``tag`` nearest to ``step``: its step and ``[left, right, count]`` bins."""
        found = self._data.read_tensors(self._ctx, experiment_id=self._experiment, plugin_name="histograms",
                                        downsample=MAX_POINTS,
                                        run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]))
        points = found.get(run, {}).get(tag, [])
        if not points:
            return None
        nearest = min(points, key=lambda p: (abs(p.step - step), p.step))
        return {"tag": tag, "step": nearest.step, "bins": nearest.numpy.tolist()}

    def _scalars(self, run: str, tags: list[str]) -> dict[str, list[provider.ScalarDatum]]:
        found = self._data.read_scalars(self._ctx, experiment_id=self._experiment, plugin_name="scalars",
                                        downsample=MAX_POINTS,
                                        run_tag_filter=provider.RunTagFilter(runs=[run], tags=tags))
        return found.get(run, {})

    def _own_data(self, run: str, tag: str) -> dict[int, str]:
        """The tab's own entries logged under ``tag`` (summaries of its plugin), by step."""
        return self._texts(run, tag, PLUGIN_NAME)

    def _texts(self, run: str, tag: str, plugin: str = "text") -> dict[int, str]:
        """The string entries logged under ``tag`` for ``plugin``, by step."""
        found = self._data.read_tensors(self._ctx, experiment_id=self._experiment, plugin_name=plugin,
                                        downsample=MAX_POINTS,
                                        run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]))
        texts = {}
        for point in found.get(run, {}).get(tag, []):
            value = point.numpy.item() if point.numpy.size == 1 else b"\n".join(point.numpy.ravel().tolist())
            texts[point.step] = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        return texts


def _record_or_error(found: Union[dict[str, Any], str, None]) -> tuple[Optional[dict[str, Any]], str]:
    return (None, found) if isinstance(found, str) else (found, "")


def _is_layer_tag(tag: str) -> bool:
    parts = TAG.match(tag)
    return parts is not None and parts["name"] not in NOT_LAYERS and parts["stat"] not in SKIPPED_STATS


def _figure(prefix: str, kind: str, stat: str, by_layer: dict[str, dict[int, float]], forward: list[str]) -> Figure:
    rows = layer_order(list(by_layer), forward)
    steps = sorted({step for points in by_layer.values() for step in points})
    values = [[by_layer[row].get(step) for step in steps] for row in rows]  # judged unrounded, as LayerHealth
    key = f"{prefix}-{kind}/{stat}" if prefix else f"{kind}/{stat}"
    return Figure(key, prefix, kind, stat, rows, steps, values)


def _figure_rank(figure: Figure) -> tuple[str, int, str]:
    plain = f"{figure.kind}/{figure.stat}"
    return figure.prefix, FIRST.index(plain) if plain in FIRST else len(FIRST), plain
