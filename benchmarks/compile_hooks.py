"""What a compiled model does when forward hooks come and go between steps: graphs compiled, hooks run.

Why a monitor keeps its hooks for the whole fit on a model that holds a compiled module (see
docs/cost.md): run ``python benchmarks/compile_hooks.py``. Each case compiles a 3-layer MLP
(backend ``eager``: dynamo's behaviour, not inductor's code) and runs 12 steps, a forward hook on
the first layer at every third step (as a monitor logging every 3 steps would register it), and
counts the graphs dynamo compiled and the steps whose hook ran.
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

STEPS, EVERY = 12, 3


class Gate:
    """The monitor's flag: hooks return at once while it is False."""

    open = False


def run(toggle: bool, guard_hooks: bool) -> tuple[int, int, int]:
    """(graphs compiled, steps whose hook ran, steps that should have) for one way of hooking."""
    torch._dynamo.reset()
    counters.clear()
    torch._dynamo.config.skip_nnmodule_hook_guards = not guard_hooks
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    compiled = torch.compile(net, backend="eager")
    ran: list[int] = []
    gate = Gate()

    def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
        if gate.open:
            ran.append(1)

    kept = None if toggle else net[0].register_forward_hook(hook)
    for step in range(STEPS):
        gate.open = logged = (step + 1) % EVERY == 0
        handle = net[0].register_forward_hook(hook) if toggle and logged else None
        compiled(torch.randn(4, 16)).sum().backward()
        if handle is not None:
            handle.remove()
    if kept is not None:
        kept.remove()
    return int(counters["stats"]["unique_graphs"]), len(ran), STEPS // EVERY


def main() -> None:
    default = torch._dynamo.config.skip_nnmodule_hook_guards
    print(f"torch {torch.__version__}, {STEPS} steps, a hook wanted at every {EVERY}rd")
    print("| hooks | skip_nnmodule_hook_guards | graphs | hook ran at | of |")
    print("| --- | --- | --- | --- | --- |")
    for toggle, guard in ((False, False), (True, False), (True, True)):
        graphs, ran, wanted = run(toggle, guard)
        how = "registered and removed per logged step" if toggle else "kept, gated by a flag"
        print(f"| {how} | {not guard} | {graphs} | {ran} | {wanted} |")
    torch._dynamo.config.skip_nnmodule_hook_guards = default


if __name__ == "__main__":
    main()
