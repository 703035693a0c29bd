"""Suite-wide guards: no test leaks process-wide state into the next."""

from collections.abc import Iterator

import pytest
import torch

from lightning_hooks.measure import _update_passes


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """Give torch's thread count back after each test (a test that runs on one thread must not set it for the rest)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(params=["C pass", "tensor ops"])
def c_pass(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways the CPU measures gradients: the C pass (float64 sums, where built), the tensor ops (float32 norms)."""
    if request.param == "C pass" and not _update_passes.NATIVE_PASSES:
        pytest.skip("the C passes are not built (or are off)")
    monkeypatch.setattr(_update_passes, "NATIVE_PASSES", request.param == "C pass")
    return request.param == "C pass"
