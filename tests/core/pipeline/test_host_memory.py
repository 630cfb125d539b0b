import sys

import pytest

from dflash_core.pipeline import host_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_the_arena_cap_holds_and_free_pages_can_be_given_back(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert host_memory._libc() is not None, "glibc's mallopt/malloc_trim not found on Linux"
    assert host_memory.limit_arenas() is True
    assert host_memory.limit_arenas() is True  # once per process, then it stays
    junk = [bytearray(1 << 16) for _ in range(2000)]  # 128 MiB freed below: pages to give back
    del junk
    assert host_memory.give_back() is True
