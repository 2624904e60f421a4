"""One CPU thread for a test module of tiny models.

Tiny matrices run fastest on one thread, and a single thread leaves the other
cores to the other test processes (pytest-xdist's second worker, torchrun
jobs). Import the fixture into a module to use it there:
``from tests.support.threads import one_thread  # noqa: F401``.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Set torch to one thread for the module; the earlier count comes back after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
