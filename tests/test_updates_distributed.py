"""UpdateTransform on 2 CPU processes with gloo (DDP, FSDP2, FSDP1) against the same model whole in one.

Every transform binds (a scale, a ratio cap, a clip against a short history), so a norm taken
over one rank's shard instead of the whole parameter would move the parameters elsewhere.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # 2-process runs in new interpreters

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(out, kind, devices):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_dist_updates.py"), str(out), kind, str(devices)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [(json.load(open(out / f"rank{r}.json")), json.load(open(out / f"updates{r}.json"))) for r in range(devices)]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("whole"), "ddp", 1)[0]


def _close(a, b, tol):
    return all(abs(x - y) <= tol * (1 + abs(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "fsdp1"])
def test_two_ranks_train_as_the_whole_model_in_one_process(tmp_path, whole, kind):
    ranks = _run(tmp_path, kind, 2)
    (params0, updates0), (params1, updates1) = ranks
    assert params0["params"] == params1["params"]  # the ranks stay identical
    for name, values in whole[0]["params"].items():
        assert _close(params0["params"][name], values, 1e-5), name
    history, reference = updates0["norms"][0], whole[1]["norms"][0]
    assert updates1["norms"] == updates0["norms"]
    assert _close(history, reference, 1e-5)  # the norms of the whole parameters, on every rank
    assert max(history) > min(history) * 1.05  # norms that vary: the clip to mean + 0.5 std binds
    collectives = 0 if kind == "ddp" else 1
    assert all(calls.get("all_reduce", 0) == collectives and "cpu" not in calls for calls in updates0["calls"])
    assert len(updates0["calls"]) == 8
