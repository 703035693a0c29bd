"""Record the judge's inputs of fault-zoo and fault-sweep cases once; replay the judge on them in seconds.

Training the zoo and the sweep takes many minutes; the judge is host-side and pure. ``record``
runs ``benchmarks/fault_zoo.py`` or ``benchmarks/fault_sweep.py`` (their own arguments after the
first two) and keeps, per case, what LayerHealth's judge was given: each logged step's figures,
the forward order, and the steps the zoo's probe read the verdict at. ``replay`` feeds them to a
fresh judge (this tree's) and prints each case whose row changed, before and after: a judge rule
tried on 200 cases in about a minute, with the training left out. A replay of an unchanged judge
gives every row as recorded (the flight leader and the losses are the recording's).

    python benchmarks/judge_replay.py record zoo.pkl zoo
    python benchmarks/judge_replay.py record sweep.pkl sweep --groups optim rates
    python benchmarks/judge_replay.py replay zoo.pkl sweep.pkl
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import pickle
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import fault_sweep, fault_zoo  # noqa: E402
from lightning_hooks.callbacks._judged_rows import lookups  # noqa: E402
from lightning_hooks.callbacks.health import LayerHealth  # noqa: E402
from lightning_hooks.output._findings import SCALE_RATIO  # noqa: E402
from lightning_hooks.output._health_verdicts import JUDGED, Verdicts, judged_figure  # noqa: E402

Event = tuple[Any, ...]  # ("bands", Bands) | ("add", figure, step, values) | ("order", names) | ("read", step)
#                          | ("vectors", figure, step, values[, scales]): the 1-D rows, and which are norms' scales


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[fault_zoo.Case, fault_zoo.Case, dict[str, Any]]]]:
    """While open, every case the zoo or the sweep judges is kept as ``(case, healthy twin, row)``.

    Each case's ``extra["events"]`` holds its judge's inputs, in order.
    """
    events: list[Event] = []
    kept: list[tuple[fault_zoo.Case, fault_zoo.Case, dict[str, Any]]] = []
    init, add, order = Verdicts.__init__, Verdicts.add, LayerHealth.record_forward_order
    figures = LayerHealth.record_figures
    read, run, judge = fault_zoo.Probe.on_train_batch_end, fault_zoo.run_case, fault_zoo.judge_case

    def run_case(*args: Any, **kwargs: Any) -> fault_zoo.Case:
        events.clear()
        case = run(*args, **kwargs)
        case.extra["events"] = list(events)
        return case

    def judge_case(case: fault_zoo.Case, healthy: Optional[fault_zoo.Case]) -> dict[str, Any]:
        row = judge(case, healthy)
        kept.append((case, healthy, row))  # the sweep adds its variant's fields to ``row`` after
        return row

    Verdicts.__init__ = lambda self, bands: (events.append(("bands", bands)), init(self, bands))[-1]
    Verdicts.add = lambda self, figure, step, values: (events.append(("add", figure, step, dict(values))),
                                                      add(self, figure, step, values))[-1]
    def record_figures(self: LayerHealth, blocks: Any, metrics: Any, step: int) -> None:
        for block in blocks:  # the 1-D rows' ratios and norms, kept apart so a replay may judge them
            figure = JUDGED.get((block.kind, block.stat))
            kept = {n: v for n, v in zip(block.rows, block.values)
                    if figure in ("ratio", "norm") and (n in self._vectors or n in self._scales)}
            if kept:
                events.append(("vectors", figure, step, kept, sorted(self._scales & set(kept))))
        figures(self, blocks, metrics, step)

    LayerHealth.record_figures = record_figures
    LayerHealth.record_forward_order = lambda self, names: (events.append(("order", list(names))),
                                                            order(self, names))[-1]
    fault_zoo.Probe.on_train_batch_end = lambda self, trainer, *a: (events.append(("read", trainer.global_step - 1)),
                                                                    read(self, trainer, *a))[-1]
    fault_zoo.run_case = fault_sweep.run_case = run_case
    fault_zoo.judge_case = fault_sweep.judge_case = judge_case
    try:
        yield kept
    finally:
        Verdicts.__init__, Verdicts.add, LayerHealth.record_forward_order = init, add, order
        LayerHealth.record_figures = figures
        fault_zoo.Probe.on_train_batch_end = read
        fault_zoo.run_case = fault_sweep.run_case = run
        fault_zoo.judge_case = fault_sweep.judge_case = judge


def replay(events: Sequence[Event], lookups: Optional[Mapping[str, str]] = None) -> dict[int, list[str]]:
    """The layers a fresh judge names at each step the probe read, as the probe lists them.

    ``lookups``: the model's embeddings, as LayerHealth hands them to its judge (not in the older recordings).
    """
    verdicts: Optional[Verdicts] = None
    named: dict[int, list[str]] = {}
    for event in events:
        if event[0] == "bands":
            verdicts = Verdicts(event[1])
            verdicts.judge.lookups = dict(lookups or {})
        elif event[0] == "add" and event[1] != SCALE_RATIO:  # a scale's ratio: from its "vectors" event
            verdicts.add(*event[1:])
        elif event[0] == "vectors":  # as LayerHealth passes them on today (the recording kept them all)
            figure, step, values = event[1:4]
            # recorded before the scales were: a 1-D ``weight`` (every one in the recorded models is a norm's)
            known = event[4] if len(event) > 4 else [row for row in values if row.rpartition(".")[2] == "weight"]
            scales = {row: v for row, v in values.items()
                      if judged_figure(figure, row, v, set(values) - set(known), set(known)) == SCALE_RATIO}
            if scales:
                verdicts.add(SCALE_RATIO, step, scales)
        elif event[0] == "order":  # as LayerHealth.record_forward_order
            depth = verdicts.judge.depth
            ranked = [*event[1], *(name for name in depth if name not in set(event[1]))]
            depth.clear()
            depth.update((name, i) for i, name in enumerate(ranked))
        elif event[0] == "read":
            ongoing = sorted(((p, layer, e) for (p, layer), e in verdicts.episodes.items() if e.ongoing),
                             key=verdicts.order)
            named[event[1]] = list(dict.fromkeys(f"{layer} ({p})" for p, layer, _ in ongoing))
    return named


def replayed_row(case: fault_zoo.Case, healthy: Optional[fault_zoo.Case], row: dict[str, Any]) -> dict[str, Any]:
    """A recorded case's row with this tree's judge: the zoo's, or the sweep's (graded) where it was one."""
    again = dataclasses.replace(case, named=replay(case.extra["events"], lookups_of(row["model"])),
                                onset=first_ran(case))
    new = fault_zoo.judge_case(again, again if healthy is case else healthy)
    if "group" not in row:
        return new
    new.update({key: row[key] for key in ("group", "variant", "every", "growth", "jump", "hold") if key in row})
    if new["fault"] not in ("healthy", "data"):
        new["culprit_first"] = fault_zoo.is_culprit(new["first"] or "", case.culprit)
    return fault_sweep.grade(new)


def first_ran(case: fault_zoo.Case) -> int:
    """An abrupt fault's onset as a recording made before the zoo kept it says: the first step its culprit ran.

    The culprit's outputs are in a logged step's figures where it ran there. Where logged steps from the nominal
    onset on lack them (a top-1 MoE's expert routed no token), the first logged step that holds them; else the
    onset recorded (a recording made since holds the first step that called it).
    """
    if case.fault not in fault_zoo.ABRUPT:
        return case.onset
    logged = [(e[2], case.culprit in e[3]) for e in case.extra["events"]
              if e[0] == "add" and e[1] == "level" and e[2] >= case.onset]
    ran = next((step for step, held in logged if held), None)
    return case.onset if ran is None or all(held for _, held in logged[:1]) else ran


@functools.cache
def lookups_of(model: str) -> dict[str, str]:
    """The embeddings of a recipe's model, named as its rows are (the Lightning module holds it as ``model``).

    A variant (``mixer+@blocks.3.token_fc1``, ``qwen3~o_proj``) has its base recipe's model.
    """
    base = fault_zoo.RECIPES.get(model) or fault_zoo.RECIPES[re.split(r"[+~]", model)[0]]
    return {f"model.{row}": f"model.{weight}" for row, weight in lookups(base.build()).items()}


def line(row: dict[str, Any]) -> str:
    """The row as its benchmark prints it, less the seconds."""
    return (fault_sweep.describe(row) if "group" in row else fault_zoo.format_row(row)).rsplit("|", 2)[0]


def main(argv: Optional[list[str]] = None) -> None:
    """``record OUT.pkl zoo|sweep [their arguments]`` or ``replay REC.pkl ...``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("record", "replay"))
    parser.add_argument("paths", nargs="+", help="record: the file to write, then zoo or sweep; replay: the files")
    args, rest = parser.parse_known_args(argv)
    if args.action == "record":
        out, bench = args.paths[0], args.paths[1]
        with recording() as kept:
            try:
                (fault_zoo if bench == "zoo" else fault_sweep).main([*args.paths[2:], *rest])
            finally:  # a run stopped keeps what it ran
                Path(out).write_bytes(pickle.dumps(kept))
        return
    for path in args.paths:
        cases = pickle.loads(Path(path).read_bytes())
        changed = ok = never = 0
        for case, healthy, row in cases:
            new = replayed_row(case, healthy, row)
            never += new.get("goal") == "never ran"
            ok += new.get("ok", True) and new.get("goal") != "never ran"
            if line(new) != line(row):
                changed += 1
                print(f"before {line(row)}\nafter  {line(new)}")
        print(f"{path}: {len(cases)} cases, {changed} changed, {ok} of {len(cases) - never} meet the goals (a zoo row"
              f" counts as met; {never} whose fault never ran left out)")


if __name__ == "__main__":
    main()
