"""The judge's inputs recorded from real zoo runs, replayed through a fresh judge: the same verdicts, step by step."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import fault_zoo  # noqa: E402
from benchmarks.judge_replay import line, recording, replay, replayed_row  # noqa: E402
from lightning_hooks.output._health_verdicts import Verdicts  # noqa: E402


@pytest.mark.slow  # trains three small MLP runs (about 4 s)
def test_a_recorded_zoo_run_replays_to_the_verdicts_it_gave_and_the_recording_hooks_come_off(tmp_path):
    add = Verdicts.add
    with recording() as kept:
        fault_zoo.main(["--models", "mlp", "--faults", "healthy", "jump", "ramp", "--steps", "120", "--onset", "80"])
    assert Verdicts.add is add and fault_zoo.run_case.__module__ == "benchmarks.fault_zoo"  # the hooks came off
    path = tmp_path / "zoo.pkl"
    path.write_bytes(pickle.dumps(kept))
    cases = pickle.loads(path.read_bytes())
    assert [case.fault for case, _, _ in cases] == ["healthy", "jump", "ramp"]
    for case, healthy, row in cases:
        assert any(case.named.values()) == (case.fault != "healthy")  # the faults were named: something to replay
        assert replay(case.extra["events"]) == case.named, case.fault
        assert line(replayed_row(case, healthy, row)) == line(row)
