"""The run folder's record of the device time every segment of the run held
(``<run_dir>/device_hours.json``), kept beside the checkpoints' figures.

A checkpoint records the device-hours that led to its weights, and a resume goes on from that
figure; the time a segment held after its last checkpoint (a crash, a kill) is in no checkpoint.
This file keeps the total the run folder's segments held, written with each DeviceHours event
(about every half minute), so a resume can say what was held and lost: the total here less the
checkpoint's figure. Only node 0 (or the one node) writes it; a missing or unreadable file reads
as nothing held. A checkpoint's own figure is read here too (``read_checkpoint_figure``).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from dflash_core import strict_json
from dflash_core.observe.device_hours import RECORD_KEY, Figure
from dflash_core.checkpoint.layout import state_json

LEDGER = "device_hours.json"
_lock = threading.Lock()  # the periodic figure (the engine's thread) and an evaluation's


def read_held(run_dir: str | os.PathLike) -> tuple[float, float]:
    """(GPU-hours, host-hours) the run folder's segments held so far; (0, 0) without a record."""
    try:
        d = json.loads((Path(run_dir) / LEDGER).read_text(encoding="utf-8"))
        return max(0.0, float(d.get("gpu", 0.0))), max(0.0, float(d.get("host", 0.0)))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0, 0.0


def write_held(run_dir: str | os.PathLike, gpu: float, host: float, step: int) -> None:
    """Write the total whole (a temporary file renamed over it). Raises OSError."""
    path = Path(run_dir) / LEDGER
    tmp = path.with_name(f".{LEDGER}.{os.getpid()}.tmp")
    text = strict_json.dumps({"gpu": gpu, "host": host, "step": step}) + "\n"
    with _lock:
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def read_checkpoint_figure(folder: str | Path) -> Figure | None:
    """The figure a checkpoint folder recorded (its training_state.json, wherever the folder's
    format keeps it), without reading its tensors; None for a folder of another kind, or one
    written before the figure was."""
    try:
        state = json.loads(state_json(folder).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    trainer = state.get("trainer") if isinstance(state, dict) else None
    return Figure.from_record(trainer.get(RECORD_KEY)) if isinstance(trainer, dict) else None
