"""Suite-wide guards: no test leaks process-wide state into the next."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """Give torch's thread count back after each test (a test that runs on one thread must not set it for the rest)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
