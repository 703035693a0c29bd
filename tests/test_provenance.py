"""NonFiniteTrace: which module outputs and gradients held a NaN or an Inf, and in what order."""

import math

import torch

from lightning_hooks.measure._provenance import NEVER, NonFiniteTrace

NAN, INF = math.nan, math.inf
CPU = torch.device("cpu")


def went_bad(trace: NonFiniteTrace, size: int) -> list[bool]:
    return [position < NEVER for position in trace.first_nonfinite(size, CPU).tolist()]


def test_an_output_with_a_nan_or_either_infinity_anywhere_is_seen_and_others_are_not():
    big = torch.randn(1000)
    outputs = {
        "finite": big,
        "nan late": torch.cat([big, torch.tensor([NAN])]),
        "+inf": torch.tensor([1.0, INF, 2.0]),
        "-inf in half": torch.tensor([[1.0], [-INF]], dtype=torch.float16),
        "huge but finite": torch.tensor([-3e38, 3e38]),
        "inf in a complex part": torch.tensor([1 + 1j, complex(0, INF)]),
        "conjugated complex nan": torch.tensor([complex(NAN, 1)]).conj(),
        "inf in a tuple beside ints": (torch.ones(2), {"y": torch.tensor([INF])}, torch.arange(3)),
        "empty and integer": (torch.zeros(0), torch.arange(4)),
        "strided view": torch.tensor([[1.0, NAN], [2.0, 3.0]])[:, 0],
    }
    trace = NonFiniteTrace()
    for index, output in enumerate(outputs.values()):
        trace.output_hook(index)(torch.nn.Identity(), (), output)
    assert dict(zip(outputs, went_bad(trace, len(outputs)))) == {
        "finite": False, "nan late": True, "+inf": True, "-inf in half": True, "huge but finite": False,
        "inf in a complex part": True, "conjugated complex nan": True, "inf in a tuple beside ints": True,
        "empty and integer": False, "strided view": False,
    }


def test_gradients_are_checked_as_backward_accumulates_them_and_the_first_bad_comes_first():
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    trace = NonFiniteTrace()
    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(trace.grad_hook(index))
    (params[0] * torch.tensor([1.0, -INF, 1.0])).sum().backward(retain_graph=True)  # -inf * 1 = -inf
    (params[1] * 2).sum().backward()
    (params[2] * NAN).sum().backward()
    first = trace.first_nonfinite(3, CPU).tolist()
    assert first[1] == NEVER and first[0] < first[2] < NEVER
