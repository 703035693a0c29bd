"""The Layers tab's TensorBoard plugin: its routes over TensorBoard's data provider, and its ES module.

TensorBoard finds :class:`LayersPlugin` through the ``tensorboard_plugins`` entry point this
package declares, and shows a LAYERS tab when some run has layer figures or anomaly reports.
The tab's page is an iframe that loads ``index.js`` (a plain ES module, no build step, nothing
from the network; it imports the other modules of ``static/``), which fetches the routes below
by relative URL:

- ``runs``: the runs with layer figures or anomaly reports (GradientAnomalyStopping alone).
- ``run?run=<run>[&<threshold>=<value>...]``: one run's figures (layers by steps), the marks,
  the banner of layers unhealthy now and the anomaly timeline (each anomaly with its report and
  flight record, if any); judged with LayerHealth's bands
  (:class:`~lightning_hooks.output._health_verdicts.Bands`), any of them set by a query parameter
  of :data:`~lightning_hooks.tensorboard_plugin.verdicts.QUERY`.
- ``histogram?run=<run>&tag=<tag>&step=<step>``: the histogram a clicked cell opens.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from importlib import resources
from typing import Any, Callable

from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from tensorboard.context import RequestContext
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from lightning_hooks.output._health_verdicts import Bands
from lightning_hooks.output._plugin_data import PLUGIN_NAME
from lightning_hooks.tensorboard_plugin.run_data import CACHED_RUNS, Figure, FigureCache, RunReader, cell
from lightning_hooks.tensorboard_plugin.scales import colour_scale
from lightning_hooks.tensorboard_plugin.verdicts import Marks, bands_as_dict, bands_from_query, banner, judge, judged_as

TAB_NAME = "Layers"
_TYPES = {".js": "application/javascript", ".css": "text/css"}
#: The tab's files (ES modules and CSS), served as they are.
_STATIC = {f"/{file.name}": _TYPES[suffix] for file in resources.files(__package__).joinpath("static").iterdir()
           if (suffix := "." + file.name.rpartition(".")[2]) in _TYPES}


class LayersPlugin(base_plugin.TBPlugin):
    """TensorBoard's Layers tab: per run, one heatmap of layers by steps per figure, with verdicts."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._data = context.data_provider
        self._cache: FigureCache = OrderedDict()
        # The last answer per run and bands, with the figures it was judged from.
        self._answers: OrderedDict[tuple[str, str, Bands], tuple[list[Figure], dict[str, Any]]] = OrderedDict()

    def get_plugin_apps(self) -> dict[str, Callable[..., Any]]:
        """The routes, under ``/data/plugin/lightning_hooks_layers/``."""
        apps: dict[str, Callable[..., Any]] = {path: self._static(path) for path in _STATIC}
        apps.update({"/runs": _wsgi(self._runs_route), "/run": _wsgi(self._run_route),
                     "/histogram": _wsgi(self._histogram_route)})
        return apps

    def is_active(self) -> bool:
        """Whether some run has a layer figure or an anomaly report (the tab shows only then)."""
        if self._data is None:
            return False
        return bool(RunReader(self._data, RequestContext(), "").runs())

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        """An iframed ES module: ``index.js``."""
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name=TAB_NAME)

    def _reader(self, request: wrappers.Request) -> RunReader:
        return RunReader(self._data, plugin_util.context(request.environ), plugin_util.experiment_id(request.environ),
                         self._cache)

    def _static(self, path: str) -> Callable[..., Any]:
        body = resources.files(__package__).joinpath("static", path.lstrip("/")).read_bytes()

        return _wsgi(lambda request: http_util.Respond(request, body, _STATIC[path]))

    def _runs_route(self, request: wrappers.Request) -> wrappers.Response:
        runs = self._reader(request).runs()
        body = {"runs": list(runs), "thresholds": bands_as_dict(Bands()), "problems": Bands().titles()}
        return http_util.Respond(request, body, "application/json")

    def _run_route(self, request: wrappers.Request) -> wrappers.Response:
        started = time.perf_counter()
        run = _required(request, "run")
        try:
            limits = bands_from_query(request.args)
        except (TypeError, ValueError) as error:
            raise errors.InvalidArgumentError(str(error)) from None
        reader = self._reader(request)
        figures = reader.figures(run)
        if not figures and run not in reader.runs():
            raise errors.NotFoundError(f"run {run!r} has no layer figures (activations/, gradients/ or updates/ tags)"
                                       " and no anomaly reports (anomalies/report)")
        key = (plugin_util.experiment_id(request.environ), run, limits)
        answered = self._answers.get(key)  # judged again only when the run has new points
        if answered is not None and answered[0] is figures:
            body = answered[1]
        else:
            body = self._answer(reader, run, figures, limits)
        self._answers[key] = (figures, body)
        while len(self._answers) > CACHED_RUNS:
            self._answers.popitem(last=False)
        return http_util.Respond(request, {**body, "server_ms": round(1000 * (time.perf_counter() - started), 1)},
                                 "application/json")

    def _answer(self, reader: RunReader, run: str, figures: list[Figure], limits: Bands) -> dict[str, Any]:
        """The run route's answer: the figures with their marks, the banner, the anomalies."""
        unjudged = reader.unjudged_ratios(run)
        # Every figure of a step together, in the order the modules ran, as LayerHealth judges.
        replay = judge(figures, limits, unjudged, reader.forward_order(run), reader.scale_ratios(run),
                       reader.lookups(run))
        return {
            "run": run,
            "figures": [_figure_json(figure, marks, limits) for figure, marks in replay.figures],
            "context": reader.context(run),
            "banner": banner(replay, limits),
            "anomalies": [vars(anomaly) for anomaly in reader.anomalies(run)],  # flight records as written
            "forward_order": bool(reader.forward_order(run)),
            "thresholds": bands_as_dict(limits),
            "problems": limits.titles(),
        }

    def _histogram_route(self, request: wrappers.Request) -> wrappers.Response:
        run, tag, step = _required(request, "run"), _required(request, "tag"), _required(request, "step")
        if not re.fullmatch(r"-?[0-9]{1,18}", step):  # ASCII only ("²" passes isdigit), and few
            raise errors.InvalidArgumentError(f"`step` must be an integer of at most 18 digits, got {step[:40]!r}")
        found = self._reader(request).histogram(run, tag, int(step))
        if found is None:
            raise errors.NotFoundError(f"run {run!r} has no histogram {tag!r}")
        return http_util.Respond(request, found, "application/json")


def _wsgi(handler: Callable[[wrappers.Request], wrappers.Response]) -> Callable[..., Any]:
    """A WSGI app answering each request with ``handler``'s response (TensorBoard turns its errors into statuses)."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        return handler(wrappers.Request(environ))(environ, start_response)

    return app


def _required(request: wrappers.Request, name: str) -> str:
    value = request.args.get(name)
    if value is None:
        raise errors.InvalidArgumentError(f"missing query parameter `{name}`")
    return value


def _figure_json(figure: Figure, marks: Marks, limits: Bands) -> dict[str, Any]:
    return {
        "key": figure.key, "prefix": figure.prefix, "kind": figure.kind, "stat": figure.stat,
        "rows": figure.rows, "steps": figure.steps,
        # Four significant digits keep a 200-layer run's answer small (judged before, unrounded).
        "values": [[None if v is None else cell(v) for v in row] for row in figure.values],
        "marks": marks, "histograms": [figure.histogram_tag(row) for row in range(len(figure.rows))],
        "scale": colour_scale(figure, limits), "judged": judged_as(figure),
    }
