"""drafter.fused_loss resolved for one device: auto = the fused loss where the drafter runs on
CUDA and Triton is installed (it ships with torch's CUDA wheels), the torch loss elsewhere; on =
the fused loss or a refusal in one line; off = the torch loss. Imports neither torch nor Triton:
the memory plan and preflight ask it before anything loads."""

from __future__ import annotations

import functools
import importlib.util

from dflash_core.config.errors import ConfigError

MODES = ("auto", "on", "off")
KEY = "drafter.fused_loss"


@functools.cache
def triton_installed() -> bool:
    """Whether Triton can be imported here (asked once; never imports it)."""
    return importlib.util.find_spec("triton") is not None


def refusal(mode: str, device_type: str) -> ConfigError | None:
    """Why ``mode`` cannot run on a drafter of ``device_type`` ("cuda", "cpu"), or None."""
    if mode not in MODES:
        return ConfigError(KEY, f"{mode!r} is not allowed; choose one of {list(MODES)}",
                           hint=f"set {KEY} to auto, on or off")
    if mode != "on":
        return None
    if device_type != "cuda":
        return ConfigError(KEY, f"on needs the drafters on CUDA GPUs, this run's are on the "
                                f"{device_type.upper()}",
                           hint=f"set {KEY}: auto (the torch loss off CUDA) or off")
    if not triton_installed():
        return ConfigError(KEY, "on needs Triton, which is not installed here",
                           hint=f"install the torch CUDA wheel's triton, or set {KEY}: auto "
                                "or off (the torch loss)")
    return None


def fused(mode: str, device_type: str) -> bool:
    """Whether the fused loss runs on a drafter of ``device_type``; ``on`` where it cannot run
    raises the refusal (a ConfigError naming drafter.fused_loss)."""
    refused = refusal(mode, device_type)
    if refused is not None:
        raise refused
    if mode == "off":
        return False
    return device_type == "cuda" and triton_installed()


def planned(mode: str) -> bool:
    """Whether a CUDA drafter will run the fused loss, for the memory plan (``on`` where it
    cannot run is refused at preflight, so the plan may take it as running)."""
    return mode == "on" or (mode == "auto" and triton_installed())
