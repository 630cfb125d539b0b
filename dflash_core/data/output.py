"""The output folder of a data verb: never the input, never a folder someone else wrote.

- ``check_apart``: an output folder that is, holds, or lies inside one of the verb's inputs (the
  source, the tokenizer folder, the template file) is refused before anything is written.
- ``OWNER`` (``.dflash-owner.json``) is written into every folder a data verb makes, naming the
  verb. ``check_out`` refuses a folder that holds entries and no such marker, whatever the flags:
  ``--overwrite`` replaces only what a prepare wrote.
- ``Staging``: prepare writes into a hidden sibling (``.<name>.partial``) and swaps it in at the
  end, so a prepare that fails or is interrupted leaves the old folder as it was.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable, Iterable

from dflash_core.data.manifest import MANIFEST, MARKER
from dflash_core.data.shards import DataError

OWNER = ".dflash-owner.json"
REGEN_STATE = "regen_state.json"  # regenerate's settings: marks its folders of old versions


def _listing(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def check_apart(out: Path, inputs: Iterable[tuple[str, str | Path | None]]) -> None:
    """Refuse an output that is, holds, or lies inside an input. ``inputs``: (what, path); paths
    that do not exist (``builtin:tiny``, a hub name) are skipped."""
    o = out.expanduser().resolve()
    for what, p in inputs:
        if p is None or not Path(p).expanduser().exists():
            continue
        r = Path(p).expanduser().resolve()
        if o == r:
            why = f"is the {what} itself"
        elif r.is_relative_to(o):
            why = f"holds the {what} {p}"
        elif o.is_relative_to(r) and r.is_dir():
            why = f"is inside the {what} {p}"
        else:
            continue
        raise DataError(f"--out {why}: a data verb never writes into its own input", file=out,
                        hint=f"pass --out a new folder outside it (e.g. {o.name}-out beside "
                             "it)")


def written_by(folder: Path) -> str | None:
    """The data verb that wrote ``folder`` ("prepare", "regenerate"), or None. Folders of earlier
    versions, made before the marker, are known by their manifest or settings file."""
    try:
        owner = json.loads((folder / OWNER).read_text(encoding="utf-8"))
        if isinstance(owner, dict) and owner.get("verb") in ("prepare", "regenerate"):
            return owner["verb"]
    except (OSError, ValueError):
        pass
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        if isinstance(manifest, dict) and manifest.get("kind") == "prepare":
            return "prepare"
    except (OSError, ValueError):
        pass
    if (folder / MARKER).is_file():
        return "prepare"  # an unfinished prepare of an earlier version
    if (folder / REGEN_STATE).is_file():
        return "regenerate"
    return None


def mark_owner(folder: Path, verb: str) -> None:
    (folder / OWNER).write_text(json.dumps({"verb": verb, "created": time.time(),
                                            "host": socket.gethostname()}) + "\n",
                                encoding="utf-8")


def check_out(out: Path, verb: str, *, overwrite: bool,
              ours: Callable[[str], bool] | None = None) -> bool:
    """Whether ``out`` already holds the output of ``verb`` (False: new or empty). Refuses a
    file, a folder of entries no data verb wrote, one of another verb, and (prepare) one that
    holds data without ``overwrite`` or holds files besides a prepare's (``ours`` names those)."""
    for parent in [out, *out.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise DataError(f"{'--out' if parent == out else parent} is a file, not a folder",
                                file=out, hint="pass --out a folder (new or empty)")
            break
    if not out.exists():
        return False
    try:
        held = sorted(p.name for p in out.iterdir())
    except OSError as exc:
        raise DataError(f"cannot read the output folder ({exc.strerror})", file=out,
                        hint="pass --out a folder you can read and write") from exc
    if not held:
        return False
    by = written_by(out)
    if by is None:
        again = " (even with --overwrite)" if overwrite else ""
        raise DataError(f"--out holds {len(held)} entries no data verb wrote ({_listing(held)}); "
                        f"they are never replaced{again}", file=out,
                        hint=f"pass --out a new folder (e.g. {out.name}-{verb}d); --overwrite "
                             f"replaces only a folder a data {verb} wrote (it holds {OWNER})")
    if by != verb:
        raise DataError(f"--out holds the output of data {by}, not of data {verb}", file=out,
                        hint=f"pass --out a new folder for the {verb}")
    if verb != "prepare":
        return True
    if not overwrite:
        what = "a prepared data set" if (out / MANIFEST).is_file() else \
            "an unfinished prepare"
        raise DataError(f"--out already holds {what} ({_listing(held)})", file=out,
                        hint="pass another --out, or --overwrite to replace it (it replaces "
                             "only what a prepare wrote)")
    foreign = [n for n in held if ours is not None and not ours(n)]
    if foreign:
        raise DataError(f"--out holds files a prepare does not write ({_listing(foreign)}); "
                        "--overwrite would delete them", file=out,
                        hint=f"move them out of {out}, or pass another --out")
    return True


# ------------------------------------------------------------------------------------------------
# Write beside, swap in at the end
# ------------------------------------------------------------------------------------------------

def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.ENOTSUP):
        return False  # this file system cannot: the caller renames twice
    raise OSError(err, os.strerror(err), str(b))


class Staging:
    """A prepare's output, written into ``.<name>.partial`` beside ``out`` and swapped in by
    ``install``. Call under the output's lock: the hidden siblings are then this writer's."""

    def __init__(self, out: Path, ours: Callable[[str], bool], note: Callable[[str], None]):
        self.out, self.ours = out, ours
        self.dir = out.parent / f".{out.name}.partial"
        self.old = out.parent / f".{out.name}.old"
        self.note = note

    def recover(self) -> None:
        """Undo what a writer killed at the wrong moment left: a swap half done (the old folder
        put back, before the output is checked)."""
        if self.old.exists() and written_by(self.old):
            if self.out.exists():
                shutil.rmtree(self.old)
            else:
                os.rename(self.old, self.out)
                self.note(f"put back {self.out}, which an interrupted replacement had moved "
                          f"to {self.old.name}")

    def begin(self, verb: str) -> Path:
        """The staging folder, empty but for the owner marker (a killed writer's partial
        output, if any, removed)."""
        if self.dir.exists():
            if not written_by(self.dir) and any(self.dir.iterdir()):
                raise DataError(f"{self.dir.name} beside --out holds files no data verb wrote",
                                file=self.out, hint=f"move {self.dir} away, or pass another "
                                                    "--out")
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        mark_owner(self.dir, verb)
        return self.dir

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def install(self) -> None:
        """The staged folder becomes ``out``; the old one (a prepare's, checked) is removed."""
        if not self.out.exists():
            os.rename(self.dir, self.out)
            return
        foreign = [p.name for p in self.out.iterdir() if not self.ours(p.name)]
        if foreign:  # put there while this prepare ran: never deleted
            raise DataError(f"--out now holds files a prepare does not write "
                            f"({_listing(foreign)}); the new data was not put in", file=self.out,
                            hint=f"move them out of {self.out} and run again, or pass another "
                                 "--out")
        if not any(self.out.iterdir()):
            # An empty folder the user made is kept (its permissions, a shell standing in it,
            # a mount): the files move in, the manifest last.
            self._install_in_place()
            return
        try:
            if _exchange(self.dir, self.out):
                shutil.rmtree(self.dir)  # now the old data
            else:
                os.rename(self.out, self.old)
                os.rename(self.dir, self.out)
                shutil.rmtree(self.old)
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.EXDEV, errno.EACCES, errno.EPERM):
                raise
            self._install_in_place()  # out is a mount point: it cannot be renamed

    def _install_in_place(self) -> None:
        """File by file into ``out``, the marker set meanwhile and the manifest moved last: an
        interruption leaves a folder every reader refuses as unfinished, never a mix taken for
        finished."""
        (self.out / MARKER).write_text("{}", encoding="utf-8")
        for p in self.out.iterdir():
            if p.name != MARKER:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        staged = sorted(self.dir.iterdir(), key=lambda p: p.name == MANIFEST)
        for p in staged:
            shutil.move(str(p), str(self.out / p.name))
        (self.out / MARKER).unlink(missing_ok=True)
        self.dir.rmdir()
