"""The output folder of ``data regenerate``: one part per endpoint under ``parts/`` (a JSON line
per finished sample, so a re-run skips the ids there), their repair after a crash or a damaged
line, the settings that bind the folder once a sample was written, and the merge of the parts in
source order into conversations.jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from dflash_core.data.conversations import Conversation
from dflash_core.data.manifest import write_json_atomic
from dflash_core.data.provenance import REGEN_MANIFEST, REGEN_MERGED, turns_of
from dflash_core.data.shards import DataError

MERGED = REGEN_MERGED
MANIFEST = REGEN_MANIFEST
STATE = "regen_state.json"
PARTS = "parts"
DAMAGED = "parts-damaged.txt"  # lines of the parts that could not be read, kept for a look


def _part_line(raw: bytes) -> tuple[dict | None, str]:
    """(the sample, "") of a usable line of a parts file, or (None, why it is damaged)."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
    except ValueError as exc:
        return None, str(exc)
    if not (isinstance(row, dict) and isinstance(row.get("id"), (str, int))
            and isinstance(row.get("messages"), list)):
        return None, "not a sample (no id or no messages)"
    return row, ""


def read_part(data: bytes, on_row: Callable[[str, dict], None] | None = None
              ) -> tuple[list[tuple[str, bytes]], list[tuple[int, bytes, str]]]:
    """(id, line) of each usable line of a parts file's bytes, and (line number, line, why) of
    each damaged one. ``on_row``: called with each usable line's id and sample."""
    good, bad = [], []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        row, why = _part_line(raw)
        if row is None:
            bad.append((n, raw, why))
        else:
            good.append((str(row["id"]), raw))
            if on_row is not None:
                on_row(str(row["id"]), row)
    return good, bad


def repair_parts(out: Path) -> tuple[set[str], list[str]]:
    """The ids already done, from the parts, and what was damaged. A damaged line anywhere (a
    torn last line after a crash, a byte changed on disk) is moved to ``DAMAGED`` (kept, not
    deleted) and its sample is asked again; the part is rewritten atomically without it."""
    done: set[str] = set()
    damaged: list[str] = []
    for f in sorted((out / PARTS).glob("*.jsonl")):
        data = f.read_bytes()
        good, bad = read_part(data)
        done.update(rid for rid, _ in good)
        if not bad and (not data or data.endswith(b"\n")):
            continue
        damaged += [f"{PARTS}/{f.name} line {n}: {why}" for n, _, why in bad]
        if bad:
            with open(out / DAMAGED, "ab") as fh:
                fh.write(b"".join(raw + b"\n" for _, raw, _ in bad))
                fh.flush()
                os.fsync(fh.fileno())
        tmp = f.parent / f".{f.name}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(b"".join(raw + b"\n" for _, raw in good))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, f)
    return done, damaged


def has_samples(out: Path) -> bool:
    """Whether a sample was ever written in this folder (a usable line of a part)."""
    return any(read_part(f.read_bytes())[0] for f in sorted((out / PARTS).glob("*.jsonl")))


def check_state(out: Path, state: dict, generated: bool) -> str:
    """A re-run continues only the same job: same source, model and generation options, once a
    sample was written; a folder where nothing was generated takes the new settings. Returns a
    note on settings replaced ("" when none)."""
    path = out / STATE
    was: Any = None
    if path.exists():
        try:
            was = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(was, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            if generated:
                raise DataError(f"unreadable {STATE} ({exc}): the settings of the regeneration "
                                "in this folder are not known", file=path,
                                hint="pass another --out for a new regeneration (this one's "
                                     f"finished samples stay in {out / PARTS})") from exc
            was = None
    diff = [k for k in state if isinstance(was, dict) and was.get(k) != state[k]]
    if diff and generated:
        raise DataError(
            "this folder holds a regeneration with other settings: " + ", ".join(
                f"{k} {was.get(k)!r} (now {state[k]!r})" for k in diff), file=out,
            hint="re-run with the same settings to continue it, or pass another --out")
    if was != state:
        write_json_atomic(path, state)
    if diff:
        return ("nothing was generated in this folder yet: it takes the new settings (" +
                ", ".join(f"{k} {was.get(k)!r} -> {state[k]!r}" for k in diff) + ")")
    return ""


def merge(out: Path, rows: list[Conversation]) -> tuple[int, int]:
    """The parts, in source order, into conversations.jsonl (atomically). Reads only the lines
    ``repair_parts`` would keep, so a line damaged since never stops the merge. Returns the
    merged answers that came as text and with token ids (``provenance.turns_of``)."""
    by_id: dict[str, bytes] = {}
    turns: dict[str, tuple[int, int]] = {}

    def count(rid: str, row: dict) -> None:
        turns[rid] = turns_of(row)

    for f in sorted((out / PARTS).glob("*.jsonl")):
        by_id.update(read_part(f.read_bytes(), count)[0])
    missing = [r.id for r in rows if r.id not in by_id]
    if missing:  # every sample was counted done: a part lost lines while this ran
        raise DataError(f"{len(missing)} finished samples are missing from {out / PARTS} "
                        f"(e.g. {missing[0]}): the parts changed while this ran", file=out,
                        hint="run the same command again: it asks for them again")
    tmp = out / f".{MERGED}.tmp"
    with open(tmp, "wb") as fh:
        for r in rows:
            fh.write(by_id[r.id] + b"\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / MERGED)
    return (sum(turns[r.id][0] for r in rows), sum(turns[r.id][1] for r in rows))
