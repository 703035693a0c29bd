"""The shared gradient measurement's parts on their own, hot (back to back) and cold (a backward between calls).

Times, on ``D x Linear(64, 64)`` with SGD and one process, the step's one gradient read
(``torch.stack(torch._foreach_norm(grads))``, what ``whole_step.py`` calls "one gradient read"),
gathering the gradients, ``measure_step`` (gather, read, figures, flags), ``agree`` (the votes and
the transfer started) and ``Agreed.checks`` (the transfer read, the flags by name), for the two
gradient callbacks of the Quick start (two detectors at their defaults), and one small tensor
operation. "hot" calls each part back to back, as a micro-benchmark does; "cold" runs a backward
pass of the model before each call, as a training step does, so the caches hold the step's
tensors and not the code's. Medians of the thread's CPU time, in us. Run it with ``PYTHONPATH``
pointing at the tree to time.

    python benchmarks/measure_parts.py --depth 100
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from typing import Any, Callable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=100)
    parser.add_argument("--calls", type=int, default=150)
    args = parser.parse_args()
    import torch

    from lightning_hooks.distributed._rank_agreement import agree
    from lightning_hooks.distributed._step_measure import _params_with_grads, measure_step
    from lightning_hooks.measure._sharding import ShardGroupCache
    from lightning_hooks.measure.anomalies import AnomalyDetector

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(args.depth)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(32, 64)
    trainer = types.SimpleNamespace(precision_plugin=types.SimpleNamespace(), optimizers=[optimizer], world_size=1,
                                    strategy=types.SimpleNamespace(root_device=torch.device("cpu")))
    detectors, shards = [AnomalyDetector(), AnomalyDetector()], ShardGroupCache()

    def backward() -> None:
        optimizer.zero_grad()
        model(batch).sum().backward()

    backward()
    grads = [p.grad for p in model.parameters()]
    steps = measure_step(trainer, optimizer, detectors, shards, exact=False)
    agreed = agree(trainer, detectors, steps, [{}, {}], [{}, {}])
    parts: dict[str, Callable[[], Any]] = {
        "one gradient read": lambda: torch.stack(torch._foreach_norm(grads)),
        "gather": lambda: _params_with_grads(optimizer),
        "measure_step": lambda: measure_step(trainer, optimizer, detectors, shards, exact=False),
        "agree": lambda: agree(trainer, detectors, steps, [{}, {}], [{}, {}]),
        "checks": lambda: agreed.checks(False),
        "one small op": lambda: steps[0].figures.group_norms.sum(),
    }
    for mode in ("hot", "cold"):
        cells = []
        for name, part in parts.items():
            times = []
            for _ in range(args.calls):
                if mode == "cold":
                    backward()
                    grads[:] = [p.grad for p in model.parameters()]
                start = time.thread_time()
                part()
                times.append(time.thread_time() - start)
            cells.append(f"{name} {statistics.median(times[10:]) * 1e6:.0f}")
        print(f"{mode:4s}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
