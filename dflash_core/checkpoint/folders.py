"""A run's checkpoint folders: which are complete (listing, the latest, their steps), the
damaged ones set aside, the best one's marker, pruning, and cleaning what dead saves left.

Hidden folders (``.tmp-``, ``.old-``, ``.del-``) are ignored by readers and cleaned by the next
save. A damaged folder is never deleted: ``set_aside`` renames it ``damaged-step-<N>``, which
nothing reads, prunes or overwrites.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from dflash_core import strict_json
from dflash_core.checkpoint.layout import CHECKPOINTS, LEGACY_STATE, SERVED_FILES, state_json
from dflash_core.pids import pid_alive

_STEP_RE = re.compile(r"^step-(\d+)$")
_HIDDEN_RE = re.compile(r"^\.(tmp|old|del)-step-(\d+)-(\d+)$")  # kind, step, pid
_DAMAGED_RE = re.compile(r"^damaged-step-(\d+)(-.+)?$")


def _is_complete(folder: Path) -> bool:
    """All fixed files there: the served ones and training_state.json (in its subfolder, or at
    the top level in formats 2 and 3), or format 1's training_state.pt. The folder was renamed
    into place only once every file was written; load_checkpoint checks the shards."""
    if not all((folder / name).is_file() for name in SERVED_FILES):
        return False
    return state_json(folder).is_file() or (folder / LEGACY_STATE).is_file()


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest step first.

    A save that replaced an existing step-N moves the old one aside to ``.old-step-N-*`` first;
    if it died before the new one took its place, that old folder still counts as step N.
    """
    return [f for f in step_folders(run_dir) if _is_complete(f)]


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


def remove_folder(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def clean_hidden(root: Path) -> None:
    """Remove what earlier saves left behind; put back a step moved aside by a save that died."""
    for entry in list(root.iterdir()):
        m = _HIDDEN_RE.match(entry.name)
        if not m:
            continue
        kind, step, pid = m.group(1), int(m.group(2)), int(m.group(3))
        if kind == "tmp" and pid != os.getpid() and pid_alive(pid):
            continue  # another live process is writing it right now
        final = root / f"step-{step}"
        if kind == "old" and not _is_complete(final) and _is_complete(entry):
            if final.exists():
                set_aside(final)  # incomplete, so damaged: kept, never deleted
            os.rename(entry, final)
            continue
        remove_folder(entry)


BEST = "best"  # checkpoints/best: JSON naming the checkpoint with the highest exact tau


def read_best(run_dir: str | os.PathLike) -> dict | None:
    """{"step", "path", "tau", "prompt_set"} of the best checkpoint so far, or None (none yet, or
    unreadable). "prompt_set": the set whose exact tau it is ("" = the held-out prompts; a
    marker written before sets were recorded has none)."""
    try:
        with open(Path(run_dir) / CHECKPOINTS / BEST, encoding="utf-8") as f:
            best = json.load(f)
        return best if isinstance(best, dict) and "step" in best else None
    except (OSError, ValueError):
        return None


def mark_best(run_dir: str | os.PathLike, folder: str | os.PathLike, step: int, tau: float,
              prompt_set: str = "") -> None:
    """Point checkpoints/best at ``folder`` (written to a temporary file and renamed, so a reader
    never sees half of it), ``tau`` measured on ``prompt_set`` (eval.best_set). Pruning keeps the
    folder it names."""
    root = Path(run_dir) / CHECKPOINTS
    tmp = root / f".{BEST}-{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(strict_json.dumps({"step": int(step), "path": Path(folder).name,
                                   "tau": float(tau), "prompt_set": prompt_set}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / BEST)


def delete_folder(path: Path) -> str:
    """Delete ``path``; "" when it is gone, else why not (the first error met)."""
    errors: list[str] = []

    def seen(_fn, where, exc_info) -> None:
        if not errors:
            errors.append(f"{exc_info[1].strerror or exc_info[1]}: {where}"
                          if isinstance(exc_info[1], OSError) else str(exc_info[1]))

    shutil.rmtree(path, onerror=seen)
    return "" if not path.exists() else (errors[0] if errors else "still there")


def _undeletable(folder: Path) -> str:
    """Why ``folder`` cannot be deleted whole ("" when it can, as far as a probe tells): a file
    made and removed in each of its folders fails where the folder is read-only (another user's
    files, a read-only snapshot, an immutable folder). Asked before anything is removed, so that
    such a checkpoint stays whole under its name instead of half deleted."""
    for where in [folder, *(p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink())]:
        probe = where / f".prune-probe-{os.getpid()}"
        try:
            probe.open("xb").close()
            probe.unlink()
        except OSError as exc:
            return f"{exc.strerror or exc}: {where}"
    return ""


# Folders prune could not delete, said once each in this process (every save tries again).
_SAID: set[str] = set()


def prune(root: Path, keep: int, protect: Path) -> list[str]:
    """Delete all but the newest ``keep`` step folders in ``root`` (0: keep all), never
    ``protect`` nor the one checkpoints/best names. Returns one line per folder that could not
    be deleted, the first time it could not (it stays under its own name; the next save tries
    again). A failure here never touches the run's own new checkpoint."""
    if keep <= 0:
        return []
    left: list[str] = []
    complete = [p for p in list_checkpoints(root.parent) if _STEP_RE.match(p.name)]
    best = read_best(root.parent)
    for old in complete[:-keep]:
        if old == protect:
            continue  # a resume from an earlier step must not delete what it just wrote
        if best is not None and old.name == best.get("path"):
            continue  # the best checkpoint so far stays, whatever its age
        why = _undeletable(old)
        if not why:
            # Rename first: a crash mid-delete then leaves a hidden folder, never a partial
            # step-*.
            doomed = root / f".del-{old.name}-{os.getpid()}"
            try:
                os.rename(old, doomed)
            except OSError as exc:
                why = f"{exc.strerror or exc}: {old}"
            else:
                why = delete_folder(doomed)
                # What could not be deleted goes back under its name: visible, not hidden.
                if why and not old.exists():
                    try:
                        os.rename(doomed, old)
                        why = why.replace(str(doomed), str(old))
                    except OSError:
                        pass
                if why and not _is_complete(old if old.exists() else doomed):
                    why += "; partly deleted, so no longer a checkpoint: remove the rest"
                if why and not old.exists():
                    why += f"; left as {doomed}"
        if why and str(old) not in _SAID:
            _SAID.add(str(old))
            left.append(f"{old.name} ({why})")
        elif not why:
            _SAID.discard(str(old))
    return left
