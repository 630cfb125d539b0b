"""The checksums of a checkpoint folder: checksums.json (each file's size and CRC-32, written
last, format 3) and ``verify``, which checks a folder against it. Folders written before checksums
(formats 1 and 2) get the checks they allow: files present, safetensors sizes as their headers say.
"""

from __future__ import annotations

import errno as errno_mod
import json
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dflash_core import strict_json
from dflash_core.checkpoint import safetensors_io
from dflash_core.checkpoint.layout import (
    CHECKSUMS, FORMAT_VERSION, LEGACY_STATE, SERVED_FILES, STATE_JSON, STATE_PATH,
    CheckpointError, shard_path, state_json,
)

READ_CHUNK = 16 << 20  # bytes per read when a file's checksum is verified


def file_sum(size: int, crc: int) -> dict:
    """A file's entry in checksums.json."""
    return {"bytes": int(size), "crc32": f"{crc & 0xFFFFFFFF:08x}"}


def write_json(path: Path, obj: Any, indent: int) -> tuple[int, int]:
    """Write ``obj`` as JSON and fsync it; returns (size, CRC-32) of the bytes written."""
    raw = strict_json.dumps(obj, indent=indent).encode("utf-8")
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return len(raw), zlib.crc32(raw)


def write_checksums(tmp: Path, sums: dict[str, dict]) -> None:
    """checksums.json, the folder's last file: every other file there, its subfolder's included,
    must have its entry by relative path (a writer that reported none, or a file nobody
    reported, fails the save)."""
    there = {p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()} - {CHECKSUMS}
    if there != set(sums):
        raise CheckpointError(
            f"checkpoint {tmp}: files and checksums disagree (written {sorted(there)}, "
            f"checksummed {sorted(sums)})", hint="a bug: report it; the previous checkpoint "
            "stands", errno=errno_mod.EIO)
    write_json(tmp / CHECKSUMS, {"format": FORMAT_VERSION, "algorithm": "crc32",
                                 "files": {n: sums[n] for n in sorted(sums)}}, 1)


def check_safetensors(path: Path) -> dict:
    """A safetensors file whose size is what its header says (a truncated one is damaged);
    returns its tensors' entries (name -> dtype, shape, data_offsets), read from the header."""
    n, meta = safetensors_io.read_header(path)
    tensors = {k: v for k, v in meta.items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    size = path.stat().st_size
    if size != 8 + n + end:
        raise ValueError(f"truncated: {size} bytes, its header says {8 + n + end}")
    return tensors


def crc32_of(path: Path, progress: Callable[[int], None] | None = None) -> int:
    """A file's CRC-32, read in large chunks into two buffers: one is read while the other's
    CRC is computed in a second thread, so a cold file is verified at the disk's read rate."""
    bufs = [bytearray(READ_CHUNK), bytearray(READ_CHUNK)]
    busy = [None, None]  # the CRC still reading each buffer
    crc = safetensors_io.Crc32()
    try:
        with open(path, "rb", buffering=0) as f:
            i = 0
            while True:
                if busy[i] is not None:
                    busy[i].result()
                n = f.readinto(bufs[i])
                if not n:
                    break
                busy[i] = crc.add(memoryview(bufs[i])[:n])
                if progress is not None:
                    progress(n)
                i ^= 1
        return crc.value()
    finally:
        crc.close()


VERIFY_FILES_AT_ONCE = 4  # files read at once: each shard is one writer's, and a disk serves
                          # several streams faster than one


def _crc32_all(folder: Path, names: list[str], sums: dict[str, dict],
               progress: Callable[[int, int, int, int], None] | None
               ) -> list[tuple[str, str | OSError]]:
    """(name, its CRC-32 as hex, or the OSError that stopped the read) of each file, several
    read at once; ``progress(bytes_read, bytes_total, files_read, files_total)`` as they go."""
    total = sum(sums[n]["bytes"] for n in names)
    lock = threading.Lock()
    state = [0, 0]  # bytes read, files done

    def seen(n: int, file_done: bool = False) -> None:
        with lock:  # one call at a time, the counts only growing
            state[0] += n
            state[1] += file_done
            if progress is not None:
                progress(min(state[0], total), total, state[1], len(names))

    def one(name: str) -> str | OSError:
        try:
            return f"{crc32_of(folder / name, seen):08x}"
        except OSError as exc:
            return exc
        finally:
            seen(0, True)
    if not names:
        return []
    with ThreadPoolExecutor(min(VERIFY_FILES_AT_ONCE, len(names)),
                            thread_name_prefix="verify") as pool:
        return list(zip(names, pool.map(one, names)))


@dataclass
class Verified:
    """What ``verify`` found in a checkpoint folder."""

    format: int  # 1, 2 (no checksums) or 3
    problems: list[str]  # what is wrong, each naming its file (empty: nothing found)
    note: str = ""  # what could not be checked ("" when every file matched its checksum)

    @property
    def kind(self) -> str:
        """"incomplete" when files are only missing, else "damaged"."""
        return "incomplete" if self.problems and all(
            p.endswith(" is missing") or " is missing (" in p for p in self.problems) \
            else "damaged"


def read_checksums(folder: Path) -> dict[str, dict]:
    record = json.loads((folder / CHECKSUMS).read_text(encoding="utf-8"))
    sums = record["files"]
    for name, entry in sums.items():
        if not (isinstance(entry.get("bytes"), int) and isinstance(entry.get("crc32"), str)):
            raise ValueError(f"entry of {name!r} is {entry!r}")
    return sums


def verify(folder: str | os.PathLike, *, read: bool = True,
           progress: Callable[[int, int, int, int], None] | None = None,
           contents: tuple[str, ...] | None = None) -> Verified:
    """Check a checkpoint folder against its checksums.json: every file there, of its recorded
    size and (``read``) CRC-32; the files training_state.json names all present (it is looked for
    in the subfolder, then at the top level: ``state_json``). ``read`` False
    checks sizes and headers only (no file is read whole). Folders written before checksums
    (formats 1 and 2) get the checks they allow (files present, safetensors sizes as their
    headers say) and a note that they cannot be verified. ``progress(bytes_read, bytes_total,
    files_read, files_total)`` as the files are read. ``contents``: only these files are read
    (the others' sizes checked), for a reader that uses only them (eval: the weights)."""
    folder = Path(folder)
    problems: list[str] = []
    flagged: set[str] = set()

    def wrong(name: str, what: str) -> None:
        problems.append(f"{name} {what}")
        flagged.add(name)

    if not state_json(folder).exists() and (folder / LEGACY_STATE).is_file():
        for name in SERVED_FILES:
            if not (folder / name).is_file():
                wrong(name, "is missing")
        _check_sizes(folder, ["model.safetensors"], flagged, wrong)
        return Verified(1, problems, "written before checksums (format 1): it cannot be "
                                     "verified")
    sums: dict[str, dict] | None = None
    if (folder / CHECKSUMS).is_file():
        try:
            sums = read_checksums(folder)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            wrong(CHECKSUMS, f"cannot be read ({type(exc).__name__}: {exc})")
    sj = state_json(folder)
    state_rel = sj.relative_to(folder).as_posix()
    if not sj.is_file() and sums is not None and STATE_PATH not in sums:
        state_rel = next((n for n in sums if n.endswith(STATE_JSON)), state_rel)  # format 3's
    if not sj.is_file():
        wrong(state_rel, "is missing")
    if sums is not None:
        known = (*SERVED_FILES, state_rel)
        order = [n for n in known if n in sums] + sorted(n for n in sums if n not in known)
        present = [n for n in order if (folder / n).is_file()]
        for name in order:
            if name not in present:
                if name not in flagged:
                    wrong(name, "is missing")
                continue
            try:
                size, want = (folder / name).stat().st_size, sums[name]["bytes"]
            except OSError as exc:  # gone since it was listed (another node set it aside)
                wrong(name, f"cannot be read ({exc})")
                continue
            if size != want:
                wrong(name, f"is truncated: {size} bytes of the {want} written" if size < want
                      else f"is {size} bytes, {want} were written")
        if read:
            for name, got in _crc32_all(folder, [n for n in present if n not in flagged
                                                 and (contents is None or n in contents)],
                                        sums, progress):
                if isinstance(got, OSError):
                    wrong(name, f"cannot be read ({got})")
                elif got != sums[name]["crc32"]:
                    wrong(name, f"does not match its checksum (crc32 {got}, written "
                                f"{sums[name]['crc32']}): it changed after it was written")
    fmt = 3 if sums is not None else 2
    state = None
    if sj.is_file() and state_rel not in flagged:
        try:
            state = json.loads(sj.read_text(encoding="utf-8"))
            fmt = max(fmt, int(state.get("format", 2)))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            wrong(state_rel, f"cannot be read ({type(exc).__name__}: {exc})")
    if fmt >= 3 and sums is None and CHECKSUMS not in flagged:
        wrong(CHECKSUMS, "is missing (a checkpoint of format 3 or later writes it last)")
    shards = state.get("shards", []) if isinstance(state, dict) else []
    shards = [shard_path(state_rel, n) for n in shards] if isinstance(shards, list) else []
    for name in ("config.json", "model.safetensors", *shards):
        if name not in flagged and not (folder / name).is_file():
            wrong(name, "is missing")
        elif sums is not None and name not in sums and name not in flagged:
            wrong(name, f"has no checksum in {CHECKSUMS}")
    note = ""
    if sums is None:
        _check_sizes(folder, ["model.safetensors", *shards], flagged, wrong)
        note = (f"written before checksums (format {fmt}): it cannot be verified"
                if fmt < 3 else "")
    elif not read:
        note = "sizes checked, contents not read"
    return Verified(fmt, problems, note)


def _check_sizes(folder: Path, names: list[str], flagged: set[str], wrong) -> None:
    """Safetensors files whose size is what their header says (reads the headers only)."""
    for name in names:
        if name in flagged or not (folder / name).is_file():
            continue
        try:
            check_safetensors(folder / name)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            wrong(name, f"cannot be read ({exc})" if not str(exc).startswith("truncated")
                  else f"is {exc}")
