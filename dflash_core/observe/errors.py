"""Turn any exception of a worker into an Error event: classified, placed, with a hint.

An exception may carry ``error_kind`` and ``hint`` attributes (ConfigError, DataError,
TargetLoadError, CheckpointError do); otherwise the kind is inferred here.

Importing this module does not import torch (the dashboard and the sinks use it): torch's own
exceptions are only looked for when the process has imported torch already.
"""

from __future__ import annotations

import re
import sys
import traceback as tb

from dflash_core.levers import oom_advice
from dflash_core.observe.events import Error
from dflash_core.units import GiB


def _torch():
    """torch if this process has imported it, else None: an exception can only be one of
    torch's when torch is loaded, so looking for one never imports it."""
    return sys.modules.get("torch")


def _is_oom(exc: BaseException) -> bool:
    torch = _torch()
    return (torch is not None and isinstance(exc, torch.OutOfMemoryError)) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def _free_memory(device: str) -> str:
    torch = _torch()
    if device.startswith("cuda") and torch is not None and torch.cuda.is_available():
        try:
            free, total = torch.cuda.mem_get_info(torch.device(device))
            return f"{free / GiB:.2f} GiB free of {total / GiB:.1f} GiB"
        except Exception:
            return "free memory unknown"
    return "host memory"


def classify(exc: BaseException, *, role: str, device: str, phase: str) -> tuple[str, str]:
    """(error_kind, hint) for an exception raised by a worker of ``role`` on ``device``."""
    error_kind = getattr(exc, "error_kind", None)
    hint = getattr(exc, "hint", "") or ""
    if error_kind:
        return error_kind, hint
    if _is_oom(exc):
        asked = re.search(r"[Tt]ried to allocate ([0-9.]+ [GMK]i?B)", str(exc))
        size = asked.group(1) if asked else "unknown size"
        return "oom", (f"out of memory on {device or 'cpu'} during {phase}: asked for {size}, "
                       f"{_free_memory(device)}. Lower {oom_advice(role)} in config.yaml.")
    if isinstance(exc, OSError):
        return "io", "check the path, permissions and free disk space named in the message"
    text = str(exc)
    if "CUDA" in text or "cuda" in type(exc).__module__ or "NCCL" in text:
        return "cuda", ("a CUDA error usually leaves the device unusable: restart the run (r on "
                        "the dashboard, --resume headless)")
    return "internal", "a bug in dflash: the traceback says where"


def error_from_exception(
    exc: BaseException, *, error_kind: str, source: str, hint: str = "", fatal: bool = True,
    device: str = "", phase: str = "",
) -> Error:
    """An Error event for ``exc`` whose kind is already known: its message and traceback."""
    return Error(
        error_kind=error_kind, source=source, message=f"{type(exc).__name__}: {exc}",
        traceback="".join(tb.format_exception(exc)), hint=hint, fatal=fatal, device=device,
        phase=phase,
    )


def error_event(exc: BaseException, *, source: str, role: str, device: str, phase: str,
                fatal: bool = True) -> Error:
    """An Error event for an exception of a worker: classified, with a hint."""
    error_kind, hint = classify(exc, role=role, device=device, phase=phase)
    return error_from_exception(exc, error_kind=error_kind, source=source, hint=hint, fatal=fatal,
                                device=device, phase=phase)
