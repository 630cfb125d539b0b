"""Shared set-up for the dashboard tests: clock times on screen are local time, so pin the zone."""

import os
import time

import pytest


@pytest.fixture(autouse=True, scope="session")
def _utc():
    old = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if old is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = old
    time.tzset()


@pytest.fixture
def anyio_backend():
    # Textual runs on asyncio; the async tests use anyio's pytest plugin (no extra dependency).
    return "asyncio"
