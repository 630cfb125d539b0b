"""The published folder: config.json and model.safetensors copied byte for byte, README.md the
card. An older checkpoint whose config.json leaves out a key a server reads (models/
served_keys.stated: ``is_causal``, DSpark's ``sample_from_anchor``, ...) is published with that
key added, as this engine computes it, so no reader falls back on a default of its own; the
card names what was added. It is written into a hidden sibling and renamed into place, so an
interrupted publish leaves no half folder under the name; a folder there already is replaced
only when publish wrote it (its card's mark) and ``overwrite`` is given, and never when it holds
other files."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dflash_core.checkpoint.checksums import crc32_of, read_checksums
from dflash_core.checkpoint.layout import SERVED_FILES
from dflash_core.publish import card, facts as facts_mod, source
from dflash_core.publish.errors import PublishError

FILES = (*SERVED_FILES, card.CARD)  # all a published folder holds


@dataclass(frozen=True)
class Published:
    out: Path
    checkpoint: Path
    how: str  # how the checkpoint was chosen
    facts: facts_mod.Facts
    replaced: bool  # an earlier publish's folder was replaced
    note: str  # what verification could not check ("" when all matched)


def _listing(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def check_out(out: Path, overwrite: bool) -> bool:
    """Whether ``out`` is an earlier publish's folder to replace (False: new or empty); refuses
    a file, a folder publish did not write, and its own without ``overwrite``."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise PublishError(f"--out {out} is a file, not a folder; nothing was written",
                           "pass --out a new folder")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise PublishError(f"--out {out}: {parent} is a file; nothing was written",
                               "pass --out a new folder")
    if not out.exists():
        return False
    try:
        held = sorted(p.name for p in out.iterdir())
    except OSError as exc:
        raise PublishError(f"--out {out} cannot be read ({exc.strerror})",
                           "pass --out a folder you can read and write") from exc
    if not held:
        return False
    if not card.written_by_publish(out):
        again = " (not even with --overwrite)" if overwrite else ""
        raise PublishError(f"--out {out} holds {len(held)} entries publish did not write "
                           f"({_listing(held)}); nothing was overwritten{again}",
                           "pass --out a new folder; --overwrite replaces only a folder an "
                           f"earlier publish wrote (its {card.CARD} ends with its mark)")
    foreign = [n for n in held if n not in FILES]
    if foreign:
        raise PublishError(f"--out {out} holds files publish does not write ({_listing(foreign)})"
                           "; nothing was overwritten", f"move them out of {out}, or pass "
                           "another --out")
    if not overwrite:
        raise PublishError(f"--out {out} holds an earlier publish; nothing was overwritten",
                           "pass --overwrite to replace it, or another --out")
    return True


def _crc32(path: Path) -> tuple[int, str]:
    return path.stat().st_size, f"{crc32_of(path):08x}"


def _copy(src: Path, dst: Path, want: dict | None) -> None:
    """Copy one file and check the copy against the checkpoint's checksum (or the source's own
    CRC, for a folder written before checksums)."""
    shutil.copyfile(src, dst)
    with open(dst, "rb") as f:
        os.fsync(f.fileno())
    size, crc = _crc32(dst)
    expect = (want["bytes"], want["crc32"]) if want else _crc32(src)
    if (size, crc) != tuple(expect):
        raise PublishError(f"the copy of {src} differs from the checkpoint's file (crc32 {crc}, "
                           f"{size} bytes; the checkpoint's {expect[1]}, {expect[0]} bytes): "
                           "it changed while it was copied; nothing was published",
                           "publish again once nothing writes the checkpoint")


def _sums(folder: Path) -> dict:
    try:
        return read_checksums(folder)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # none (a folder written before checksums): the source's own CRC is compared


def completed_config(folder: Path, objective: str) -> tuple[str | None, dict]:
    """(config.json's text with the serving keys it leaves unstated added, those keys); (None,
    {}) when it states them all (this engine's checkpoints since they are written)."""
    from dflash_core.models.served_keys import unstated

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    added = unstated(config, objective)
    if not added:
        return None, {}
    for key, value in added.items():
        where, _, name = key.rpartition(".")
        (config.setdefault(where, {}) if where else config)[name or key] = value
    return json.dumps(config, indent=2), added


def publish(path: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
            note: Callable[[str], None] = lambda s: None) -> Published:
    """Publish the checkpoint ``path`` names (a run folder or a step folder) into ``out``.
    Raises PublishError for bad input (nothing written), OSError for a failed write (``out`` as
    it was)."""
    path, out = Path(path), Path(out)
    ours = check_out(out, overwrite)  # before the checkpoint is read whole: fail fast
    src = source.choose(path)
    note(f"publishing {src.folder}: {src.how}")
    if src.note:
        note(f"{src.folder}: {src.note}")
    f = facts_mod.gather(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.publish-{os.getpid()}"
    old = out.parent / f".{out.name}.publish-old-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        sums = _sums(src.folder)
        config_text, added = completed_config(src.folder, f.objective)
        for name in SERVED_FILES:
            if name == "config.json" and config_text is not None:
                (stage / name).write_text(config_text, encoding="utf-8")
            else:
                _copy(src.folder / name, stage / name, sums.get(name))
        if added:
            listed = ", ".join(f"{k} {json.dumps(v)}" for k, v in added.items())
            note(f"config.json: the checkpoint leaves out keys a server reads; stated as this "
                 f"engine computes them: {listed}")
        (stage / card.CARD).write_text(card.render(f, out, src.folder, src.how, added),
                                       encoding="utf-8")
        ours = check_out(out, overwrite)  # again: a folder may have appeared meanwhile
        if ours:
            os.rename(out, old)
            os.rename(stage, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            if out.is_dir():
                out.rmdir()  # empty (checked): the staged folder takes its name
            os.rename(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)  # put the earlier publish back
        raise
    return Published(out, src.folder, src.how, f, ours, src.note)
