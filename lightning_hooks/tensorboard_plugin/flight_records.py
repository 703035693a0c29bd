"""Checking a flight record before the tab draws it: one that is malformed or foreign gets an error of its own.

A record is GradientAnomalyStopping's JSON object (``callbacks/_flight_recorder.record_json``).
One written by another version, edited by hand, or by another program under the same tag must
not reach the browser's drawing code: there it would stop every run's cards from drawing. So
each record is checked here, and one that fails is sent as its error, shown in its run's card.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

_NUMBER_STRINGS = frozenset({"NaN", "Infinity", "-Infinity"})


def parse_record(text: str) -> Union[dict[str, Any], str]:
    """The flight record in ``text``, or a sentence saying why it cannot be drawn."""
    try:
        record = json.loads(text)
    except ValueError as error:
        return f"the flight record is not JSON ({error})"
    problem = record_problem(record)
    return record if problem is None else f"the flight record cannot be drawn: {problem}"


def record_problem(record: Any) -> Optional[str]:
    """What is wrong with a flight record, or None when the tab can draw it."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    missing = sorted({"step", "steps", "losses", "layers", "norms", "onsets"} - set(record))
    if missing:
        return f"missing keys {missing} (written by another program or version?)"
    steps, layers, norms = record["steps"], record["layers"], record["norms"]
    n_steps = len(steps) if isinstance(steps, list) else -1
    n_layers = len(layers) if isinstance(layers, list) else -1
    checks = [
        (_is_int(record["step"]), "`step` is not an integer"),
        (isinstance(steps, list) and all(map(_is_int, steps)), "`steps` is not a list of integers"),
        (isinstance(layers, list) and all(isinstance(name, str) for name in layers), "`layers` is not a list of names"),
        (_numbers(record["losses"], n_steps), "`losses` is not one number a step"),
        (isinstance(norms, list) and len(norms) == n_steps and all(_numbers(row, n_layers) for row in norms),
         "`norms` is not one row of one number a layer per step"),
        (_usual(record.get("usual"), layers), "`usual` is not one [norm, factor] or null a layer"),
        (isinstance(record["onsets"], list) and all(isinstance(o, list) and len(o) == 2 and isinstance(o[0], str)
                                                    and _is_int(o[1]) for o in record["onsets"]),
         "`onsets` is not a list of [layer, step]"),
        (record.get("leader") is None or isinstance(record["leader"], str), "`leader` is not a name"),
        (record.get("lead") is None or _is_int(record["lead"]), "`lead` is not an integer"),
        (record.get("update_norms") in (None, []) or _numbers(record["update_norms"], n_steps),
         "`update_norms` is not one number a step"),
    ]
    return next((problem for ok, problem in checks if not ok), None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, str):
        return value in _NUMBER_STRINGS
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _numbers(values: Any, length: int) -> bool:
    return isinstance(values, list) and len(values) == length and all(map(_is_number, values))


def _usual(usual: Any, layers: Any) -> bool:
    if usual is None:
        return True
    return (isinstance(usual, list) and isinstance(layers, list) and len(usual) == len(layers)
            and all(u is None or _numbers(u, 2) for u in usual))
