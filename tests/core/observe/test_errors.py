"""Worker exceptions classified: the kind, and a hint that names what to change."""

import pytest
import torch

from dflash_core.config import ConfigError
from dflash_core.levers import OOM_LEVERS
from dflash_core.observe.errors import classify, error_event

OOM_TEXT = ("CUDA out of memory. Tried to allocate 30.00 GiB (GPU 0; 139.80 GiB total capacity; "
            "12.00 GiB already allocated)")


@pytest.mark.parametrize("role, key", [("target", "data.token_budget"),
                                       ("drafter", "drafter.micro_block_tokens"),
                                       ("loader", "data.prefetch_batches")])
def test_an_oom_names_the_size_asked_for_and_the_key_of_its_role(role, key):
    kind, hint = classify(torch.OutOfMemoryError(OOM_TEXT), role=role, device="cpu",
                          phase="training")
    assert kind == "oom"
    assert "30.00 GiB" in hint and key in hint
    for lever in OOM_LEVERS[role]:  # every lever of the role, with what it sizes
        assert f"{lever.key} ({lever.sizes})" in hint
    assert hint.startswith("out of memory on cpu during training")


def test_a_runtime_error_that_says_out_of_memory_is_an_oom():
    kind, hint = classify(RuntimeError("DefaultCPUAllocator: out of memory"), role="target",
                          device="", phase="forward")
    assert kind == "oom" and "unknown size" in hint and "data.token_budget" in hint


def test_the_kind_and_hint_an_exception_carries_win():
    exc = ConfigError("data.path", "no such folder", hint="set data.path")
    assert classify(exc, role="loader", device="", phase="preflight") == ("config",
                                                                         "set data.path")


@pytest.mark.parametrize("exc, kind", [(OSError("disk full"), "io"),
                                       (RuntimeError("CUDA error: an illegal memory access"),
                                        "cuda"),
                                       (ValueError("bad shape"), "internal")])
def test_other_exceptions(exc, kind):
    got, hint = classify(exc, role="drafter", device="cuda:7", phase="training")
    assert got == kind and hint


def test_error_event_says_who_failed_where_and_why():
    try:
        raise torch.OutOfMemoryError(OOM_TEXT)
    except torch.OutOfMemoryError as exc:
        ev = error_event(exc, source="drafter-0", role="drafter", device="cpu", phase="training")
    assert (ev.error_kind, ev.source, ev.device, ev.phase, ev.fatal) == (
        "oom", "drafter-0", "cpu", "training", True)
    assert "OutOfMemoryError" in ev.message and "Traceback" in ev.traceback
    assert "drafter.micro_block_tokens" in ev.hint
