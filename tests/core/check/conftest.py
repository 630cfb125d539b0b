from tests.core.models.dflash.test_drafter import reference_dflash  # noqa: F401  (the shared fixture)

import pytest


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a busy 2-core machine a second one spins at barriers and makes
    the tiny demo's ops several times slower (measured in demo.py)."""
    from dflash_core.demo import torch_threads

    with torch_threads(1):
        yield
