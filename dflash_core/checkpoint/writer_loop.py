"""A checkpoint writer's loop, run in a writer process (``writer_main``) or a writer thread
(``serve``): it gets the staging arena once and then, per checkpoint, the files to write from it,
and reports its bytes and its end (async_writer.py hands out the work and assembles the folder).
A writer process imports this module, not the one that watches it."""

from __future__ import annotations

import os
import queue
import time
from pathlib import Path
from typing import Callable

import torch

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint import safetensors_io
from dflash_core.checkpoint.staging import views

POLL_S = 0.2


def clock() -> float:
    """Seconds, for the writers' times and the write rate measured from them (one place, so a
    test can model a disk of any speed without waiting for it)."""
    return time.monotonic()


def _error_report(exc: BaseException) -> tuple[int | None, str]:
    code = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    return code, f"{type(exc).__name__}: {exc}"


def serve(index: int, jobs, results, progress: torch.Tensor, alive: Callable[[], bool],
          cancelled: Callable[[], bool] | None = None) -> None:
    """A writer's loop: ("arena", arena, layout) | ("write", job_id, folder, files) |
    ("probe", job_id, path, nbytes) | None (end). Reports ("done", job_id, index, bytes,
    seconds, {file: checksum entry}) or ("error", job_id, index, errno, message) on
    ``results``. A write stops between chunks once ``alive()`` is false or ``cancelled()`` true
    (a writer thread cannot be killed)."""
    def stop() -> bool:
        return not alive() or (cancelled is not None and cancelled())
    tensors: dict[str, torch.Tensor] = {}
    while alive():
        try:
            msg = jobs.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if msg is None:
            return
        if msg[0] == "arena":
            tensors = views(msg[1], msg[2])
            continue
        job_id = msg[1]
        progress[index] = 0
        t0 = clock()
        try:
            if msg[0] == "write":
                def add(n: int) -> None:
                    progress[index] += n
                done, sums = ckpt.write_plans(Path(msg[2]), msg[3], tensors, progress=add,
                                              cancelled=stop)
            else:
                done, sums = _probe(Path(msg[2]), msg[3]), {}
            results.put(("done", job_id, index, done, clock() - t0, sums))
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, the loop goes on
            code, text = _error_report(exc)
            results.put(("error", job_id, index, code, text))


def _probe(path: Path, nbytes: int) -> int:
    """Write ``nbytes`` and fsync: the disk's write rate, measured the way checkpoints write
    (through the same chunked writes)."""
    chunk = memoryview(bytes(min(nbytes, safetensors_io.CHUNK)))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            n = min(left, len(chunk))
            safetensors_io._write(fd, chunk[:n])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
    return nbytes


def writer_main(index: int, jobs, results, progress: torch.Tensor) -> None:
    """Entry point of a writer process. It stops once its parent is gone (checked between
    chunks). Not PR_SET_PDEATHSIG: that signal follows the thread that started the process, and
    a writer replaced from a drafter thread was killed, its write lost, when that thread ended."""
    torch.set_num_threads(2)  # casts to the served dtype; the host's cores belong to training
    parent = os.getppid()
    serve(index, jobs, results, progress, alive=lambda: os.getppid() == parent)


__all__ = ["serve", "writer_main", "clock"]
