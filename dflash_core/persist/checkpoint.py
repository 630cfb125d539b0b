"""Atomic, verifiable checkpoints and resume.

A checkpoint is ``<run_dir>/checkpoints/step-<N>/`` with
  config.json          the drafter config (interchange format, docs/checkpoint-format.md)
  model.safetensors    the drafter weights in the dtype it is served in (interchange format)
  training_state.json  step, scheduler and trainer state, and the skeleton of the optimizer state
  training_state-<k>-of-<n>.safetensors  float32 master weights, optimizer moments, RNG tensors:
                       n disjoint shards (one per writer, so several write at once)
  checksums.json       each file's size and CRC-32, written last (format 3)
No pickle anywhere. Folders of format 2 (no checksums.json) and format 1 (``training_state.pt``,
float32 ``model.safetensors``) still load, said to be unverifiable. The folder is assembled by
``begin_save`` (hidden folder, the small files), the writers (``write_plans``: here, or in writer
processes, async_writer.py; each returns its files' checksums) and ``finish_save`` (checksums.json,
fsync, rename, prune). Everything is written to a hidden ``.tmp-step-<N>-<pid>`` folder, fsynced,
then renamed into place, so a crash at any moment leaves only complete ``step-*`` folders. Hidden
folders (``.tmp-``, ``.old-``, ``.del-``) are ignored by readers and cleaned by the next save. A
damaged folder is never deleted: ``set_aside`` renames it ``damaged-step-<N>``, which nothing
reads, prunes or overwrites.
"""

from __future__ import annotations

import errno as errno_mod
import json
import os
import random
import re
import shutil
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors import torch as st

from dflash_core.persist import safetensors_io, state_tree

try:
    import numpy as np
except ImportError:  # numpy is optional for the engine; its RNG is then simply not captured
    np = None

CHECKPOINTS = "checkpoints"
STATE_JSON = "training_state.json"
FILES = ("config.json", "model.safetensors", STATE_JSON)  # plus the shards STATE_JSON names
CHECKSUMS = "checksums.json"  # every other file's size and CRC-32; written last (format 3)
LEGACY_STATE = "training_state.pt"  # format 1, read only
FORMAT_VERSION = 3
MASTER = "master"  # prefix of the float32 master weights in the shards
# Prefix of tensors written to model.safetensors only, never to the training state: DSpark's
# copies of the target's embed_tokens and lm_head (frozen: no master, no optimizer state).
SERVED = "served"
_STEP_RE = re.compile(r"^step-(\d+)$")
_HIDDEN_RE = re.compile(r"^\.(tmp|old|del)-step-(\d+)-(\d+)$")  # kind, step, pid
_DAMAGED_RE = re.compile(r"^damaged-step-(\d+)(-.+)?$")
READ_CHUNK = 16 << 20  # bytes per read when a file's checksum is verified


class CheckpointError(OSError):
    """A checkpoint could not be written or read (disk full, permissions, damaged files)."""

    error_kind = "io"

    def __init__(self, message: str, hint: str = "", errno: int | None = None):
        super().__init__(message)
        self.hint = hint
        self.errno = errno


@dataclass
class LoadedCheckpoint:
    step: int
    drafter_state: dict[str, torch.Tensor]
    drafter_config: dict
    optimizer_state: dict
    scheduler_state: dict
    trainer_state: dict
    path: Path | None = None
    format: int = FORMAT_VERSION
    note: str = ""  # what could not be checked (a folder written before checksums); "" verified


# --------------------------------------------------------------------------------------------
# RNG state as plain tensors and primitives, so it survives torch.load(weights_only=True)
# --------------------------------------------------------------------------------------------

def capture_rng_state() -> dict:
    """Python, numpy (legacy global) and torch CPU/CUDA generator states."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"].cpu())
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"],
                             s["has_gauss"], s["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        # A resume on fewer GPUs restores the ones that exist.
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)


# --------------------------------------------------------------------------------------------
# Listing
# --------------------------------------------------------------------------------------------

def _is_complete(folder: Path) -> bool:
    """All fixed files there (format 2, or format 1's training_state.pt). The folder was renamed
    into place only once every file was written; load_checkpoint checks the shards."""
    if not all((folder / name).is_file() for name in FILES[:2]):
        return False
    return (folder / STATE_JSON).is_file() or (folder / LEGACY_STATE).is_file()


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest step first.

    A save that replaced an existing step-N moves the old one aside to ``.old-step-N-*`` first;
    if it died before the new one took its place, that old folder still counts as step N.
    """
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    aside: dict[int, Path] = {}
    for entry in root.iterdir():
        if (m := _STEP_RE.match(entry.name)) and _is_complete(entry):
            found[int(m.group(1))] = entry
        elif (m := _HIDDEN_RE.match(entry.name)) and m.group(1) == "old" and _is_complete(entry):
            aside[int(m.group(2))] = entry
    for step, folder in aside.items():
        found.setdefault(step, folder)
    return [found[s] for s in sorted(found)]


def step_folders(run_dir: str | os.PathLike) -> list[Path]:
    """Every ``step-<N>`` folder, complete or not, oldest step first (an ``.old-`` copy stands
    for a step whose folder is missing or incomplete, as in list_checkpoints): what a resume
    looks at, so that a damaged or incomplete one is named and set aside, not passed over."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    aside: dict[int, Path] = {}
    for entry in root.iterdir():
        if (m := _STEP_RE.match(entry.name)) and entry.is_dir():
            found[int(m.group(1))] = entry
        elif (m := _HIDDEN_RE.match(entry.name)) and m.group(1) == "old" and _is_complete(entry):
            aside[int(m.group(2))] = entry
    for step, folder in aside.items():
        if step not in found or not _is_complete(found[step]):
            found[step] = folder
    return [found[s] for s in sorted(found)]


def damaged_folders(run_dir: str | os.PathLike) -> list[Path]:
    """The ``damaged-step-<N>`` folders set aside so far, oldest step first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    hits = [(int(m.group(1)), e.name, e) for e in root.iterdir()
            if (m := _DAMAGED_RE.match(e.name))]
    return [e for _, _, e in sorted(hits)]


def set_aside(folder: str | os.PathLike) -> Path:
    """Move a damaged checkpoint out of the way of readers, saves and pruning, keeping it for
    inspection (never deleted); returns where it went: ``damaged-step-<N>``, with the time and
    this process's id added when that name is taken."""
    folder = Path(folder)
    dest = folder.parent / f"damaged-step-{checkpoint_step(folder)}"
    if dest.exists():
        dest = dest.with_name(f"{dest.name}-{int(time.time())}-{os.getpid()}")
    os.rename(folder, dest)
    return dest


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_step(folder: str | os.PathLike) -> int:
    """The step number of a folder returned by list_checkpoints / latest_checkpoint /
    step_folders / damaged_folders."""
    name = Path(folder).name
    if m := _STEP_RE.match(name):
        return int(m.group(1))
    if m := _HIDDEN_RE.match(name):
        return int(m.group(2))
    if m := _DAMAGED_RE.match(name):
        return int(m.group(1))
    raise ValueError(f"{folder} is not a checkpoint folder")


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------

def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # works for files and, on POSIX, directories
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _io_error(exc: BaseException, root: Path) -> CheckpointError | None:
    """Map an I/O failure (OSError, or safetensors' own error wrapping one) to CheckpointError."""
    code = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    if not isinstance(exc, OSError):
        # safetensors reports I/O as SafetensorError("... I/O error: ... (os error 28) ...").
        m = re.search(r"os error (\d+)", str(exc))
        if not (m or "I/O error" in str(exc)):
            return None
        code = int(m.group(1)) if m else None
    if code in (errno_mod.ENOSPC, errno_mod.EDQUOT):
        hint = f"free disk space in {root}, or set run.output_dir to a disk with room"
    elif code in (errno_mod.EACCES, errno_mod.EPERM, errno_mod.EROFS):
        hint = f"make {root} writable, or set run.output_dir to a writable folder"
    else:
        hint = f"check the disk holding {root} (free space, permissions), or change run.output_dir"
    return CheckpointError(f"checkpoint write failed in {root}: {exc}", hint=hint, errno=code)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _clean_hidden(root: Path) -> None:
    """Remove what earlier saves left behind; put back a step moved aside by a save that died."""
    for entry in list(root.iterdir()):
        m = _HIDDEN_RE.match(entry.name)
        if not m:
            continue
        kind, step, pid = m.group(1), int(m.group(2)), int(m.group(3))
        if kind == "tmp" and pid != os.getpid() and _pid_alive(pid):
            continue  # another live process is writing it right now
        final = root / f"step-{step}"
        if kind == "old" and not _is_complete(final) and _is_complete(entry):
            if final.exists():
                set_aside(final)  # incomplete, so damaged: kept, never deleted
            os.rename(entry, final)
            continue
        _remove(entry)


BEST = "best"  # checkpoints/best: JSON naming the checkpoint with the highest exact tau


def read_best(run_dir: str | os.PathLike) -> dict | None:
    """{"step", "path", "tau"} of the best checkpoint so far, or None (none yet, or unreadable)."""
    try:
        with open(Path(run_dir) / CHECKPOINTS / BEST, encoding="utf-8") as f:
            best = json.load(f)
        return best if isinstance(best, dict) and "step" in best else None
    except (OSError, ValueError):
        return None


def mark_best(run_dir: str | os.PathLike, folder: str | os.PathLike, step: int, tau: float) -> None:
    """Point checkpoints/best at ``folder`` (written to a temporary file and renamed, so a reader
    never sees half of it). Pruning keeps the folder it names."""
    root = Path(run_dir) / CHECKPOINTS
    tmp = root / f".{BEST}-{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"step": int(step), "path": Path(folder).name, "tau": float(tau)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / BEST)


def _prune(root: Path, keep: int, protect: Path) -> None:
    if keep <= 0:
        return
    complete = [p for p in list_checkpoints(root.parent) if _STEP_RE.match(p.name)]
    best = read_best(root.parent)
    for old in complete[:-keep]:
        if old == protect:
            continue  # a resume from an earlier step must not delete what it just wrote
        if best is not None and old.name == best.get("path"):
            continue  # the best checkpoint so far stays, whatever its age
        # Rename first: a crash mid-delete then leaves a hidden folder, never a partial step-*.
        doomed = root / f".del-{old.name}-{os.getpid()}"
        os.rename(old, doomed)
        _remove(doomed)


@dataclass
class FilePlan:
    """One safetensors file of a checkpoint: (name in the file, name of the source tensor, dtype
    to store or None to keep it) in file order."""

    name: str
    entries: list[tuple[str, str, torch.dtype | None]]


def shard_name(k: int, n: int) -> str:
    return f"training_state-{k + 1:05d}-of-{n:05d}.safetensors"


def plan_files(tensors: dict[str, torch.Tensor], drafter_keys: list[str],
               served_dtype: torch.dtype | None, writers: int,
               served_keys: list[str] = ()) -> list[list[FilePlan]]:
    """Split a checkpoint's tensors over ``writers``: writer 0 writes model.safetensors (the
    master weights, then the ``served/<key>`` tensors of ``served_keys``, cast to
    ``served_dtype``) and every writer one shard of the training state, the largest tensors
    first to the writer with the fewest bytes so far, so all finish together. ``tensors`` maps
    source names (``master/<key>``, ``optimizer/...``, ``served/<key>``) to tensors (or anything
    with numel, shape and dtype). Returns each writer's files."""
    def nbytes(t, dtype=None):
        return t.numel() * (dtype or t.dtype).itemsize
    sources = [(k, f"{MASTER}/{k}") for k in drafter_keys] + [(k, f"{SERVED}/{k}")
                                                              for k in served_keys]
    model = [(k, src, served_dtype if tensors[src].dtype.is_floating_point else None)
             for k, src in sources]
    load = [0] * writers
    load[0] = sum(nbytes(tensors[src], dt) for _, src, dt in model)
    shards: list[list[str]] = [[] for _ in range(writers)]
    served_only = {f"{SERVED}/{k}" for k in served_keys}
    for name in sorted((n for n in tensors if n not in served_only),
                       key=lambda n: -nbytes(tensors[n])):
        w = min(range(writers), key=lambda i: load[i])
        shards[w].append(name)
        load[w] += nbytes(tensors[name])
    plans = [[FilePlan(shard_name(w, writers), [(n, n, None) for n in sorted(shards[w])])]
             for w in range(writers)]
    plans[0].insert(0, FilePlan("model.safetensors", model))
    return plans


@dataclass
class SaveJob:
    """What one checkpoint writes: the small files (written by begin_save) and each writer's
    safetensors files, whose tensors are named in ``tensors``."""

    step: int
    drafter_config: dict
    state: dict  # training_state.json
    tensors: dict[str, torch.Tensor]
    plans: list[list[FilePlan]]
    sums: dict[str, dict] = field(default_factory=dict)  # of the files written so far (file_sum)
    # Tensors that never change in a run (the served-only frozen copies): staged once.
    static: frozenset = frozenset()

    @property
    def bytes_total(self) -> int:
        return sum(_plan_bytes(f, self.tensors) for files in self.plans for f in files)


def _plan_bytes(f: FilePlan, tensors) -> int:
    return sum(tensors[src].numel() * (dt or tensors[src].dtype).itemsize
               for _, src, dt in f.entries)


def make_job(step: int, *, drafter_state: dict[str, torch.Tensor], drafter_config: dict,
             optimizer_state: dict, scheduler_state: dict, trainer_state: dict,
             served_dtype: torch.dtype | None = None, writers: int = 1,
             served_extra: dict[str, torch.Tensor] | None = None) -> SaveJob:
    """Take a checkpoint's state apart into JSON and named tensors (references, not copies).
    ``served_extra``: tensors written into model.safetensors only (cast to ``served_dtype``),
    never into the training state: DSpark's frozen copies (dspark_format.frozen_tensors).
    Raises TypeError, before anything is written, on state a checkpoint cannot hold."""
    tensors: dict[str, torch.Tensor] = {}
    served_extra = served_extra or {}
    for k, v in drafter_state.items():
        if not torch.is_tensor(v):
            raise TypeError(f"drafter_state[{k!r}]: {type(v).__name__} is not a tensor")
        tensors[f"{MASTER}/{k}"] = v.detach()
    for k, v in served_extra.items():
        if k in drafter_state:
            raise TypeError(f"served_extra[{k!r}] is also a trained weight")
        if not torch.is_tensor(v):
            raise TypeError(f"served_extra[{k!r}]: {type(v).__name__} is not a tensor")
        tensors[f"{SERVED}/{k}"] = v.detach()
    state = {"format": FORMAT_VERSION, "step": int(step),
             "served_dtype": str(served_dtype).removeprefix("torch.") if served_dtype else "",
             "optimizer": state_tree.flatten(optimizer_state, "optimizer", tensors),
             "scheduler": state_tree.flatten(scheduler_state, "scheduler", tensors),
             "trainer": state_tree.flatten(trainer_state, "trainer", tensors)}
    for name, t in tensors.items():
        if t.dtype not in safetensors_io.DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} cannot be stored in safetensors here")
    plans = plan_files(tensors, list(drafter_state), served_dtype, writers, list(served_extra))
    state["shards"] = [f.name for files in plans for f in files if f.name != "model.safetensors"]
    return SaveJob(int(step), drafter_config, state, tensors, plans,
                   static=frozenset(f"{SERVED}/{k}" for k in served_extra))


def file_sum(size: int, crc: int) -> dict:
    """A file's entry in checksums.json."""
    return {"bytes": int(size), "crc32": f"{crc & 0xFFFFFFFF:08x}"}


def tmp_folder(run_dir: str | os.PathLike, step: int) -> Path:
    """Where step ``step`` is assembled; named after this process, which renames it."""
    return Path(run_dir) / CHECKPOINTS / f".tmp-step-{step}-{os.getpid()}"


def _fail(exc: BaseException, root: Path, tmp: Path | None):
    if tmp is not None:
        _remove(tmp)
    if isinstance(exc, CheckpointError):
        raise exc
    err = _io_error(exc, root) if isinstance(exc, Exception) else None
    if err is not None:
        raise err from exc
    raise exc


def _write_json(path: Path, obj: Any, indent: int) -> tuple[int, int]:
    """Write ``obj`` as JSON and fsync it; returns (size, CRC-32) of the bytes written."""
    raw = json.dumps(obj, indent=indent).encode("utf-8")
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return len(raw), zlib.crc32(raw)


def begin_save(run_dir: str | os.PathLike, job: SaveJob) -> Path:
    """Make the hidden folder of ``job`` with its small files (config.json, training_state.json,
    their checksums kept in ``job.sums``); returns it. Raises CheckpointError when the disk
    refuses (nothing left behind)."""
    root = Path(run_dir) / CHECKPOINTS
    tmp = tmp_folder(run_dir, job.step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clean_hidden(root)
        _remove(tmp)
        tmp.mkdir()
        for name, obj in (("config.json", job.drafter_config), (STATE_JSON, job.state)):
            job.sums[name] = file_sum(*_write_json(tmp / name, obj, 1 if name == STATE_JSON
                                                   else 2))
    except BaseException as exc:
        _fail(exc, root, tmp)
    return tmp


def write_plans(folder: Path, files: list[FilePlan], tensors: dict[str, torch.Tensor],
                progress: Callable[[int], None] | None = None,
                cancelled: Callable[[], bool] | None = None) -> tuple[int, dict[str, dict]]:
    """One writer's files into ``folder`` (each fsynced); returns the data bytes written and
    each file's checksum entry (file_sum), computed as it was written. Errors are raised as they
    come (the caller maps them: CheckpointError or a writer's report)."""
    done, sums = 0, {}
    for f in files:
        entries = [(name, tensors[src], dt) for name, src, dt in f.entries]
        out = safetensors_io.write_file(folder / f.name, entries, progress, cancelled)
        done += out.data_bytes
        sums[f.name] = file_sum(out.size, out.crc32)
    return done, sums


def _write_checksums(tmp: Path, sums: dict[str, dict]) -> None:
    """checksums.json, the folder's last file: every other file there must have its entry (a
    writer that reported none, or a file nobody reported, fails the save)."""
    there = {p.name for p in tmp.iterdir()} - {CHECKSUMS}
    if there != set(sums):
        raise CheckpointError(
            f"checkpoint {tmp}: files and checksums disagree (written {sorted(there)}, "
            f"checksummed {sorted(sums)})", hint="a bug: report it; the previous checkpoint "
            "stands", errno=errno_mod.EIO)
    _write_json(tmp / CHECKSUMS, {"format": FORMAT_VERSION, "algorithm": "crc32",
                                  "files": {n: sums[n] for n in sorted(sums)}}, 1)


def finish_save(run_dir: str | os.PathLike, step: int, tmp: Path, keep: int,
                sums: dict[str, dict], note: Callable[[str], None] | None = None) -> Path:
    """Write checksums.json (``sums``: every file's entry), make the hidden folder step-<step>
    (fsync, rename) and prune to ``keep``. A step-<step> already there is replaced when it is
    intact; a damaged or incomplete one is set aside first (kept), and ``note`` told so."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step-{step}"
    try:
        _write_checksums(tmp, sums)
        _fsync_path(tmp)
        aside = None
        if final.exists():
            wrong = verify(final, read=False).problems  # sizes only: no second read of GBs
            if wrong:
                moved = set_aside(final)
                if note is not None:
                    note(f"checkpoint {final} is damaged ({'; '.join(wrong)}): moved it to "
                         f"{moved} (kept, not deleted) before writing step {step} again")
            else:
                # A directory cannot be renamed over a non-empty one: move the old aside first
                # (readers still find it as step N until the new one is in place).
                aside = root / f".old-step-{step}-{os.getpid()}"
                os.rename(final, aside)
        os.rename(tmp, final)
        _fsync_path(root)
        if aside is not None:
            _remove(aside)
    except BaseException as exc:
        _fail(exc, root, tmp)
    try:
        _prune(root, keep, protect=final)
    except OSError:
        pass  # the new checkpoint is safe; pruning is retried by the next save
    return final


def abandon_save(tmp: Path) -> None:
    """A save that failed or whose writer died: its hidden folder goes, the previous stands."""
    _remove(tmp)


def save_checkpoint(
    run_dir: str | os.PathLike, step: int, *, drafter_state: dict[str, torch.Tensor],
    drafter_config: dict, optimizer_state: dict, scheduler_state: dict, trainer_state: dict,
    keep: int, served_dtype: torch.dtype | None = None, note: Callable[[str], None] | None = None,
    served_extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``run_dir/checkpoints/step-<step>/`` atomically, in this thread, and prune to the
    newest ``keep``. ``served_dtype``: the dtype of model.safetensors (None: as given).
    ``note``: told when a damaged step-<step> already there is set aside. ``served_extra``:
    tensors for model.safetensors only (make_job).

    Raises CheckpointError (an OSError, error_kind "io", with a hint) when the disk refuses; no
    partial folder is left either way. Put ``capture_rng_state()`` into ``trainer_state`` to make
    a resume reproducible. The training loop writes in the background instead (async_writer.py).
    """
    job = make_job(step, drafter_state={k: v.detach().cpu() for k, v in drafter_state.items()},
                   drafter_config=drafter_config, optimizer_state=optimizer_state,
                   scheduler_state=scheduler_state, trainer_state=trainer_state,
                   served_dtype=served_dtype, served_extra=served_extra)
    tensors = {k: v.cpu() for k, v in job.tensors.items()}
    tmp = begin_save(run_dir, job)
    try:
        for files in job.plans:
            job.sums.update(write_plans(tmp, files, tensors)[1])
    except BaseException as exc:
        _fail(exc, Path(run_dir) / CHECKPOINTS, tmp)
    return finish_save(run_dir, step, tmp, keep, job.sums, note)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def _check_safetensors(path: Path) -> None:
    """A safetensors file whose size is what its header says (a truncated one is damaged)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than its header")
        n = int.from_bytes(head, "little")
        if 8 + n > os.fstat(f.fileno()).st_size:  # a garbled length: do not try to read it
            raise ValueError(f"truncated: its header length {n} runs past the file's end")
        meta = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
    size = path.stat().st_size
    if size != 8 + n + end:
        raise ValueError(f"truncated: {size} bytes, its header says {8 + n + end}")


def _crc32_of(path: Path, progress: Callable[[int], None] | None = None) -> int:
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
            return f"{_crc32_of(folder / name, seen):08x}"
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


def _read_checksums(folder: Path) -> dict[str, dict]:
    record = json.loads((folder / CHECKSUMS).read_text(encoding="utf-8"))
    sums = record["files"]
    for name, entry in sums.items():
        if not (isinstance(entry.get("bytes"), int) and isinstance(entry.get("crc32"), str)):
            raise ValueError(f"entry of {name!r} is {entry!r}")
    return sums


def verify(folder: str | os.PathLike, *, read: bool = True,
           progress: Callable[[int, int, int, int], None] | None = None) -> Verified:
    """Check a checkpoint folder against its checksums.json: every file there, of its recorded
    size and (``read``) CRC-32; the files training_state.json names all present. ``read`` False
    checks sizes and headers only (no file is read whole). Folders written before checksums
    (formats 1 and 2) get the checks they allow (files present, safetensors sizes as their
    headers say) and a note that they cannot be verified. ``progress(bytes_read, bytes_total,
    files_read, files_total)`` as the files are read."""
    folder = Path(folder)
    problems: list[str] = []
    flagged: set[str] = set()

    def wrong(name: str, what: str) -> None:
        problems.append(f"{name} {what}")
        flagged.add(name)

    if not (folder / STATE_JSON).exists() and (folder / LEGACY_STATE).is_file():
        for name in FILES[:2]:
            if not (folder / name).is_file():
                wrong(name, "is missing")
        _check_sizes(folder, ["model.safetensors"], flagged, wrong)
        return Verified(1, problems, "written before checksums (format 1): it cannot be "
                                     "verified")
    sums: dict[str, dict] | None = None
    if (folder / CHECKSUMS).is_file():
        try:
            sums = _read_checksums(folder)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            wrong(CHECKSUMS, f"cannot be read ({type(exc).__name__}: {exc})")
    if not (folder / STATE_JSON).is_file():
        wrong(STATE_JSON, "is missing")
    if sums is not None:
        order = [n for n in FILES if n in sums] + sorted(n for n in sums if n not in FILES)
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
            for name, got in _crc32_all(folder, [n for n in present if n not in flagged],
                                        sums, progress):
                if isinstance(got, OSError):
                    wrong(name, f"cannot be read ({got})")
                elif got != sums[name]["crc32"]:
                    wrong(name, f"does not match its checksum (crc32 {got}, written "
                                f"{sums[name]['crc32']}): it changed after it was written")
    fmt = 3 if sums is not None else 2
    state = None
    if (folder / STATE_JSON).is_file() and STATE_JSON not in flagged:
        try:
            state = json.loads((folder / STATE_JSON).read_text(encoding="utf-8"))
            fmt = max(fmt, int(state.get("format", 2)))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            wrong(STATE_JSON, f"cannot be read ({type(exc).__name__}: {exc})")
    if fmt >= 3 and sums is None and CHECKSUMS not in flagged:
        wrong(CHECKSUMS, "is missing (a format-3 checkpoint writes it last)")
    shards = state.get("shards", []) if isinstance(state, dict) else []
    shards = shards if isinstance(shards, list) else []
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
            _check_safetensors(folder / name)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            wrong(name, f"cannot be read ({exc})" if not str(exc).startswith("truncated")
                  else f"is {exc}")


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The files of a checkpoint folder of format 2 or 3 (for sizes and progress)."""
    path = Path(path)
    state = json.loads((path / STATE_JSON).read_text(encoding="utf-8"))
    extra = (CHECKSUMS,) if (path / CHECKSUMS).is_file() else ()
    return [path / n for n in ("config.json", "model.safetensors", STATE_JSON, *state["shards"],
                               *extra)]


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu",
                    progress: Callable[[int, int, int, int], None] | None = None
                    ) -> LoadedCheckpoint:
    """Verify a checkpoint folder (``verify``: every file against checksums.json, read whole),
    then read it without pickle (safetensors, JSON; format 1's training_state.pt with
    weights_only=True). The drafter state is the float32 master weights where the folder holds
    them. Raises CheckpointError naming every file that is missing, truncated or changed.
    ``progress(bytes_read, bytes_total, files_read, files_total)`` is called as the files are
    verified (then they are read again from the page cache), or, in a folder without checksums,
    as the training-state shards are read."""
    path = Path(path)
    checked = verify(path, progress=progress)
    if checked.problems:
        missing = checked.kind == "incomplete"
        raise CheckpointError(
            f"checkpoint {path} is {checked.kind}: {'; '.join(checked.problems)}",
            hint="resume from an older checkpoint (a resume sets this one aside and falls back "
                 "to the newest intact one), or restore this one from a backup",
            errno=errno_mod.ENOENT if missing else errno_mod.EIO)
    if checked.format >= 3:
        progress = None  # verify read every byte and said so
    legacy = checked.format == 1
    device = str(map_location)
    name = "config.json"
    try:  # a truncated or garbled file is the checkpoint's fault: name it, not "a bug"
        with open(path / name, encoding="utf-8") as f:
            drafter_config = json.load(f)
        name = "model.safetensors"
        _check_safetensors(path / name)
        if legacy:
            drafter_state = st.load_file(str(path / name), device=device)
            name = LEGACY_STATE
            state = torch.load(path / name, map_location=map_location, weights_only=True)
            name = f"{LEGACY_STATE} (its entries)"
            state = {k: state[k] for k in ("step", "optimizer", "scheduler", "trainer")}
        else:
            name = STATE_JSON
            with open(path / name, encoding="utf-8") as f:
                skeleton = json.load(f)
            shards = [path / n for n in skeleton["shards"]]
            sizes = [p.stat().st_size for p in shards]
            total = sum(sizes)
            tensors: dict[str, torch.Tensor] = {}
            read = 0
            for i, (shard, size) in enumerate(zip(shards, sizes)):
                name = shard.name
                _check_safetensors(shard)
                in_shard = 0
                with safe_open(str(shard), framework="pt", device=device) as f:
                    for key in f.keys():
                        t = tensors[key] = f.get_tensor(key)
                        in_shard += t.numel() * t.element_size()  # its header is not counted
                        if progress is not None:
                            progress(read + min(in_shard, size), total, i, len(shards))
                read += size  # so the last report is total of total
                if progress is not None:
                    progress(read, total, i + 1, len(shards))
            name = f"{STATE_JSON} (its entries)"
            prefix = f"{MASTER}/"
            drafter_state = {k[len(prefix):]: v for k, v in tensors.items()
                             if k.startswith(prefix)}
            if not drafter_state:  # no master copy: the served weights are the state
                drafter_state = st.load_file(str(path / "model.safetensors"), device=device)
            state = {k: state_tree.unflatten(skeleton[k], tensors)
                     for k in ("step", "optimizer", "scheduler", "trainer")}
    except Exception as exc:  # SafetensorError, JSONDecodeError, UnpicklingError, KeyError, ...
        raise CheckpointError(
            f"checkpoint {path} is damaged: {name} cannot be read ({type(exc).__name__}: {exc})",
            hint="resume from an older checkpoint (a resume falls back to the newest intact "
                 "one), or restore this one from a backup", errno=errno_mod.EIO) from exc
    return LoadedCheckpoint(
        step=int(state["step"]), drafter_state=drafter_state, drafter_config=drafter_config,
        optimizer_state=state["optimizer"], scheduler_state=state["scheduler"],
        trainer_state=state["trainer"], path=path, format=checked.format, note=checked.note,
    )
