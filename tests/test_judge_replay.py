"""The judge's inputs recorded from real zoo runs, replayed through a fresh judge: the same verdicts, step by step."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import fault_zoo  # noqa: E402
from benchmarks.judge_replay import first_ran, line, recording, replay, replayed_row  # noqa: E402
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


def test_an_abrupt_faults_onset_is_the_first_logged_step_its_culprit_ran_and_a_ramps_is_as_recorded():
    def case(fault: str, ran_from: int) -> fault_zoo.Case:
        events = [("add", "level", step, {"model.other": 1.0, **({"model.expert": 2.0} if step >= ran_from else {})})
                  for step in range(195, 210)]  # a top-1 MoE's expert routed no token before ``ran_from``
        return fault_zoo.Case("moe-top1", fault, "model.expert", 201, 300, [], {}, extra={"events": events})

    assert first_ran(case("jump", 204)) == 204  # not called at 201-203: the figures could see it from 204 on
    assert first_ran(case("dead", 204)) == 204
    assert first_ran(case("jump", 0)) == 201  # called at the onset: as recorded
    assert first_ran(case("ramp", 204)) == 201  # a ramp's growth counts from the nominal onset: as recorded
    assert fault_zoo.ABRUPT == ("jump", "dead")
