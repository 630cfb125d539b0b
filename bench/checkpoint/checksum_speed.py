"""What a checkpoint's checksums cost, on a ~1 GiB file (docs/checkpoint-format.md,
"checksums.json").

    python bench/checkpoint/checksum_speed.py --dir /tmp/checksum-bench

- the write: the same 1 GiB written and fsynced in the writer's 64 MiB chunks, without a checksum
  and through ``safetensors_io.write_file`` (CRC-32 computed beside the writes);
- the resume's verification of the file: read only, then each candidate algorithm (zlib CRC-32,
  BLAKE2b, SHA-256) reading and hashing in one thread, then ``checksums.crc32_of`` (reads and
  CRC overlapped), each cold (the file's pages dropped with posix_fadvise first; a filesystem
  that ignores the advice reads from memory, and cold then equals warm) and warm;
- the hash functions alone on 64 MiB in memory.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
import common  # noqa: F401 - puts the repository on sys.path

from dflash_core.checkpoint import safetensors_io
from dflash_core.checkpoint.checksums import crc32_of

MB = 1e6


class _Crc:
    def __init__(self):
        self.value = 0

    def update(self, chunk) -> None:
        self.value = zlib.crc32(chunk, self.value)


class _Nothing:
    def update(self, chunk) -> None:
        pass


ALGOS = {"read only": _Nothing, "crc32 (zlib)": _Crc, "blake2b": hashlib.blake2b,
         "sha256": hashlib.sha256}


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_hashing(path: Path, make) -> float:
    """Seconds to read ``path`` in 16 MiB chunks, hashing each in this thread."""
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    h = make()
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/checksum-bench")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    n = int(args.gib * (1 << 30)) // 4 * 4
    tensor = torch.randn(n // 4)
    flat = memoryview(tensor.view(torch.uint8).numpy())
    path, plain = folder / "shard.safetensors", folder / "plain.bin"

    mem = flat[: 64 << 20]
    for name, make in list(ALGOS.items())[1:]:
        h, t = make(), time.perf_counter()
        for _ in range(4):
            h.update(mem)
        print(f"in memory: {name:13s} {4 * len(mem) / (time.perf_counter() - t) / MB:6.0f} MB/s")

    for _ in range(args.repeat):
        t = time.perf_counter()
        fd = os.open(plain, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for s in range(0, len(flat), safetensors_io.CHUNK):
            safetensors_io._write(fd, flat[s: s + safetensors_io.CHUNK])
        os.fsync(fd)
        os.close(fd)
        without = time.perf_counter() - t
        t = time.perf_counter()
        out = safetensors_io.write_file(path, [("w", tensor, None)])
        with_crc = time.perf_counter() - t
        print(f"write {n / 2**30:.2f} GiB + fsync: no checksum {n / without / MB:.0f} MB/s, "
              f"write_file with CRC-32 {n / with_crc / MB:.0f} MB/s")
    plain.unlink()
    size = path.stat().st_size
    for _ in range(args.repeat):
        for name, make in ALGOS.items():
            evict(path)
            cold = read_hashing(path, make)
            warm = read_hashing(path, make)
            print(f"verify, one thread: {name:13s} cold {size / cold / MB:6.0f} MB/s, "
                  f"warm {size / warm / MB:6.0f} MB/s")
        evict(path)
        t = time.perf_counter()
        crc = crc32_of(path)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        crc32_of(path)
        warm = time.perf_counter() - t
        assert crc == out.crc32, "the read's CRC is not the write's"
        print(f"verify, checksums.crc32_of (read and CRC overlapped): cold "
              f"{size / cold / MB:.0f} MB/s, warm {size / warm / MB:.0f} MB/s")
    path.unlink()


if __name__ == "__main__":
    main()
