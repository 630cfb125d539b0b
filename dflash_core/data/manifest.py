"""The manifest of a prepared data folder, and what says a folder is finished.

``prepare`` writes ``.dflash-prepare`` (a marker) before its first shard and ``dflash_data.json``
(the manifest: source, counts, token statistics, tokenizer and template fingerprints, where the
responses came from: ``provenance.py``) after its last, then removes the marker. So a folder
holding the marker and no manifest is a prepare that did not finish: ``check_data_folder`` refuses
it, and checks a finished one's fingerprints against the target's tokenizer.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dflash_core.data.shards import DataError

MANIFEST = "dflash_data.json"
MARKER = ".dflash-prepare"
VERSION = 1


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.parent / f".{path.name}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_manifest(folder: str | Path) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"unreadable manifest ({exc})", file=path,
                        hint="prepare the data again (dflash-tui data prepare ... --overwrite)"
                        ) from exc


def mark_started(folder: Path, info: dict) -> None:
    write_json_atomic(folder / MARKER, {"started": time.time(), "pid": os.getpid(), **info})


def mark_finished(folder: Path, manifest: dict) -> None:
    write_json_atomic(folder / MANIFEST, manifest)
    (folder / MARKER).unlink(missing_ok=True)


def is_unfinished(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / MARKER).exists() or (
        folder.is_dir() and not (folder / MANIFEST).exists()
        and any(p.name.startswith(".tmp-") for p in folder.iterdir()))


def check_data_folder(folder: str | Path, target_fingerprints: dict | None,
                      target_name: str = "the target") -> dict | None:
    """The manifest of a data folder (None for data made otherwise, which is not checked).
    Refuses an unfinished prepare, and data tokenized for another tokenizer or template, naming
    both sides."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    manifest = read_manifest(folder)
    if manifest is None:
        if is_unfinished(folder):
            raise DataError("a data prepare started in this folder and did not finish (no "
                            f"{MANIFEST})", file=folder,
                            hint="run dflash-tui data prepare again with --overwrite; partial "
                                 "shards are never taken for a finished data set")
        return None
    if target_fingerprints:
        fp = manifest.get("fingerprints", {})
        for key, what in (("tokenizer", "tokenizer"), ("chat_template", "chat template")):
            mine, theirs = fp.get(key), target_fingerprints.get(key)
            if mine and theirs and mine != theirs:
                made = manifest.get("tokenizer", {}).get("name", "?")
                raise DataError(
                    f"the data was prepared with the {what} of {made} (fingerprint {mine}), but "
                    f"{target_name} has {what} fingerprint {theirs}",
                    file=folder,
                    hint="prepare the data with the target's own tokenizer: dflash-tui data "
                         "prepare SOURCE --tokenizer TARGET_FOLDER --out NEW_FOLDER")
    return manifest
