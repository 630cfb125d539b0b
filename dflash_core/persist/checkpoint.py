"""Atomic checkpoints and resume.

A checkpoint is ``<run_dir>/checkpoints/step-<N>/`` with
  config.json        the drafter config (interchange format, docs/checkpoint-format.md)
  model.safetensors  the drafter weights (interchange format)
  training_state.pt  optimizer, scheduler and trainer state; loads with weights_only=True
Everything is written to a hidden ``.tmp-step-<N>-<pid>`` folder, fsynced, then renamed into
place, so a crash at any moment leaves only complete ``step-*`` folders. Hidden folders (``.tmp-``,
``.old-``, ``.del-``) are ignored by readers and cleaned by the next save.
"""

from __future__ import annotations

import errno as errno_mod
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import torch as st

try:
    import numpy as np
except ImportError:  # numpy is optional for the engine; its RNG is then simply not captured
    np = None

CHECKPOINTS = "checkpoints"
FILES = ("config.json", "model.safetensors", "training_state.pt")
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_HIDDEN_RE = re.compile(r"^\.(tmp|old|del)-step-(\d+)-(\d+)$")  # kind, step, pid


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
    return all((folder / name).is_file() for name in FILES)


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


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_step(folder: str | os.PathLike) -> int:
    """The step number of a folder returned by list_checkpoints / latest_checkpoint."""
    name = Path(folder).name
    if m := _STEP_RE.match(name):
        return int(m.group(1))
    if m := _HIDDEN_RE.match(name):
        return int(m.group(2))
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


def _check_weights_only(obj: Any, where: str) -> None:
    """Refuse (before writing) anything torch.load(weights_only=True) would refuse to read."""
    if isinstance(obj, (torch.Tensor, str, bytes, int, float, bool, type(None), torch.Size,
                        torch.dtype, torch.device)):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise TypeError(f"{where}: key {k!r} of type {type(k).__name__} is not loadable "
                                "with weights_only=True")
            _check_weights_only(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_weights_only(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where}: {type(obj).__name__} is not loadable with weights_only=True; "
                    "store tensors, numbers, strings, lists or dicts")


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
                _remove(final)
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


def save_checkpoint(
    run_dir: str | os.PathLike, step: int, *, drafter_state: dict[str, torch.Tensor],
    drafter_config: dict, optimizer_state: dict, scheduler_state: dict, trainer_state: dict,
    keep: int,
) -> Path:
    """Write ``run_dir/checkpoints/step-<step>/`` atomically and prune to the newest ``keep``.

    Raises CheckpointError (an OSError, error_kind "io", with a hint) when the disk refuses; no
    partial folder is left either way. Put ``capture_rng_state()`` into ``trainer_state`` to make
    a resume reproducible.
    """
    training_state = {"format": FORMAT_VERSION, "step": int(step), "optimizer": optimizer_state,
                      "scheduler": scheduler_state, "trainer": trainer_state}
    _check_weights_only(training_state, "training_state")
    tensors = {k: v.detach().contiguous() for k, v in drafter_state.items()}

    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clean_hidden(root)
        _remove(tmp)
        tmp.mkdir()
        with open(tmp / "config.json", "w", encoding="utf-8") as f:
            json.dump(drafter_config, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        st.save_file(tensors, str(tmp / "model.safetensors"))
        _fsync_path(tmp / "model.safetensors")
        with open(tmp / "training_state.pt", "wb") as f:
            torch.save(training_state, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
        aside = None
        if final.exists():
            # A directory cannot be renamed over a non-empty one: move the old aside first
            # (readers still find it as step N until the new one is in place).
            aside = root / f".old-step-{step}-{os.getpid()}"
            os.rename(final, aside)
        os.rename(tmp, final)
        _fsync_path(root)
        if aside is not None:
            _remove(aside)
    except BaseException as exc:
        _remove(tmp)
        err = _io_error(exc, root) if isinstance(exc, Exception) else None
        if err is not None:
            raise err from exc
        raise
    try:
        _prune(root, keep, protect=final)
    except OSError:
        pass  # the new checkpoint is safe; pruning is retried by the next save
    return final


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu"
                    ) -> LoadedCheckpoint:
    """Read a checkpoint folder without pickle (safetensors + torch.load(weights_only=True))."""
    path = Path(path)
    missing = [name for name in FILES if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {missing}",
                              hint="resume from another checkpoint (latest_checkpoint skips "
                                   "incomplete ones)", errno=errno_mod.ENOENT)
    device = str(map_location)
    name = "model.safetensors"
    try:  # a truncated or garbled file is the checkpoint's fault: name it, not "a bug"
        drafter_state = st.load_file(str(path / name), device=device)
        name = "config.json"
        with open(path / name, encoding="utf-8") as f:
            drafter_config = json.load(f)
        name = "training_state.pt"
        state = torch.load(path / name, map_location=map_location, weights_only=True)
        name = "training_state.pt (its entries)"
        state = {k: state[k] for k in ("step", "optimizer", "scheduler", "trainer")}
    except Exception as exc:  # SafetensorError, JSONDecodeError, UnpicklingError, KeyError, ...
        raise CheckpointError(
            f"checkpoint {path} is damaged: {name} cannot be read ({type(exc).__name__}: {exc})",
            hint="resume from an older checkpoint (a resume falls back to the newest intact "
                 "one), or restore this one from a backup", errno=errno_mod.EIO) from exc
    return LoadedCheckpoint(
        step=int(state["step"]), drafter_state=drafter_state, drafter_config=drafter_config,
        optimizer_state=state["optimizer"], scheduler_state=state["scheduler"],
        trainer_state=state["trainer"], path=path,
    )
