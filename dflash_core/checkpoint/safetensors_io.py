"""Write a safetensors file straight from tensors in host memory, in chunks, with progress.

The safetensors library's own ``save_file`` first builds the whole file in memory (a second copy
of 10+ GB at the shipped size) and reports nothing until it is done. The format is simple: an
8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and byte
range, then the raw bytes in that order. Here each tensor is written from its own memory (cast
to another dtype first where asked, one tensor at a time), ``progress`` is told after every
chunk, and the file is fsynced before returning. ``safetensors.torch.load_file`` reads it.

The file's CRC-32 is computed from the same chunks as they are written (no second read), in a
second thread while each chunk goes to the disk (zlib and os.write both release the GIL), so it
costs no time beside the write (docs/checkpoint-format.md, "checksums.json").
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import torch

CHUNK = 64 << 20  # bytes per write call: progress granularity, and the GIL is free inside it

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
          torch.float8_e4m3fn: "F8_E4M3"}  # FP8 block-wise targets' weights (benchmarks)


class Written(NamedTuple):
    """What ``write_file`` put on disk: the tensors' bytes, the file's size and its CRC-32."""

    data_bytes: int
    size: int
    crc32: int


def read_header(path: str | os.PathLike) -> tuple[int, dict]:
    """(header length, header) of a safetensors file, without reading its tensors. Raises
    ValueError for a file shorter than its header or a header length past its end, OSError."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than its header")
        n = int.from_bytes(head, "little")
        if 8 + n > os.fstat(f.fileno()).st_size:  # a garbled length: do not try to read it
            raise ValueError(f"truncated: its header length {n} runs past the file's end")
        return n, json.loads(f.read(n))


def file_bytes(entries: list[tuple[str, torch.Tensor, torch.dtype | None]]) -> int:
    """The data bytes a file of these entries holds (the header aside)."""
    return sum(t.numel() * (dtype or t.dtype).itemsize for _, t, dtype in entries)


def _header(entries) -> bytes:
    meta, offset = {}, 0
    for name, t, dtype in entries:
        dtype = dtype or t.dtype
        n = t.numel() * dtype.itemsize
        meta[name] = {"dtype": DTYPES[dtype], "shape": list(t.shape),
                      "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class Crc32:
    """A CRC-32 over chunks given in order, computed in one worker thread beside the caller's I/O
    (a single worker keeps the order). ``value()`` waits for the chunks given so far."""

    def __init__(self):
        self._crc = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="crc32")
        self._last = None

    def _add(self, chunk) -> None:
        self._crc = zlib.crc32(chunk, self._crc)

    def add(self, chunk):
        """Queue ``chunk`` (it must not change until its future is done); returns that future."""
        self._last = self._pool.submit(self._add, chunk)
        return self._last

    def value(self) -> int:
        if self._last is not None:
            self._last.result()
        return self._crc

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _write(fd: int, view: memoryview) -> None:
    """All of ``view`` to ``fd`` (the one place bytes reach the disk: tests inject faults here)."""
    while view:
        n = os.write(fd, view)
        view = view[n:]


def write_file(path: str | os.PathLike, entries: list[tuple[str, torch.Tensor, torch.dtype | None]],
               progress: Callable[[int], None] | None = None,
               cancelled: Callable[[], bool] | None = None) -> Written:
    """Write ``entries`` ((name, host tensor, dtype to store or None) in file order) to ``path``
    and fsync it; returns what was written (the data bytes, the file's size, its CRC-32).
    ``progress(n)`` is called with each chunk's byte count; ``cancelled()`` true between chunks
    stops with InterruptedError."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    done = 0
    crc = Crc32()
    try:
        header = _header(entries)
        crc.add(header)
        _write(fd, memoryview(header))
        for _, t, dtype in entries:
            if dtype is not None and dtype != t.dtype:
                t = t.to(dtype)
            flat = t.contiguous().reshape(-1).view(torch.uint8)  # bf16 has no numpy dtype: bytes
            buf = memoryview(flat.numpy())
            for start in range(0, len(buf), CHUNK):
                if cancelled is not None and cancelled():
                    raise InterruptedError(f"write of {path} cancelled")
                part = buf[start: start + CHUNK]
                crc.add(part)  # of the bytes handed to the disk, while they go
                _write(fd, part)
                done += len(part)
                if progress is not None:
                    progress(len(part))
        os.fsync(fd)
        value = crc.value()
    finally:
        os.close(fd)
        crc.close()
    return Written(done, len(header) + done, value)
