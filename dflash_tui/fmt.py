"""Small text helpers shared by the state model, the panels and the post-mortem: sizes, durations,
percentages, and the bar / sparkline glyphs (plain characters, so they read in any terminal)."""

from __future__ import annotations

import re
import time
from typing import Sequence

from dflash_core.units import GiB as GIB  # one definition of the unit
from dflash_core.units import size_text

_SPARK = "▁▂▃▄▅▆▇█"
_EIGHTHS = " ▏▎▍▌▋▊▉"
_EXC_PREFIX = re.compile(r"^[\w.]+(Error|Exception): ")


def gib(n: float) -> str:
    """Bytes in a narrow column: 80.1G, or 300M for a small size (units.size_text)."""
    return size_text(n, short=True)


def duration(seconds: float | None) -> str:
    if seconds is None or seconds < 0 or seconds != seconds:
        return "-"
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    if h >= 100:
        return f"{h // 24}d{h % 24:02d}h"
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def pct(frac: float) -> str:
    return f"{round(frac * 100)}%"


def rate(x: float) -> str:
    """Throughput in a few characters: 950, 31.2k, 1.4M."""
    if x >= 1e6:
        return f"{x / 1e6:.1f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}" if x >= 10 else f"{x:.2f}"


def clock(ts: float) -> str:
    """Local wall-clock time of an event."""
    return time.strftime("%H:%M:%S", time.localtime(ts))


def bar(frac: float, width: int) -> tuple[str, str]:
    """A horizontal bar of `width` cells with eighth-cell resolution: (filled part, empty part),
    so the caller can style them apart."""
    if width <= 0:
        return "", ""
    frac = min(max(frac, 0.0), 1.0)
    full, part = divmod(round(frac * width * 8), 8)
    filled = "█" * full + (_EIGHTHS[part] if part and full < width else "")
    return filled, "░" * (width - len(filled))


def spark(values: Sequence[float], width: int, top: float | None = None) -> str:
    """The last `width` values as one line of block glyphs, scaled to `top` (default: their max)."""
    vals = list(values)[-width:] if width > 0 else []
    if not vals:
        return ""
    hi = top if top is not None else max(vals)
    if hi <= 0:
        return _SPARK[0] * len(vals)
    return "".join(_SPARK[min(len(_SPARK) - 1, max(0, round(v / hi * (len(_SPARK) - 1))))]
                   for v in vals)


def short_message(message: str) -> str:
    """First line of an error message without the exception's class name, which the error kind
    already says: "torch.OutOfMemoryError: CUDA out of memory" -> "CUDA out of memory"."""
    first = message.splitlines()[0] if message else ""
    return _EXC_PREFIX.sub("", first, count=1)


def building(b) -> str:
    """'building demo target 40% (step 240/600, loss 2.10)': the builder's words without the
    name they repeat."""
    detail = b.message
    if detail.startswith(b.what):
        detail = detail[len(b.what):].strip(" :,")
    return f"building {b.what} {b.fraction:.0%}" + (f" ({detail})" if detail else "")
