"""Which data a checkpoint trained on, so that a resume on other data is refused.

A checkpoint's data position (the epoch, the batch indices of it already trained) names batches of
the plan made from its data; applied to other data, the same numbers are other samples, and a
resume would skip some and repeat others without a word. So every checkpoint records the identity
of its data (``trainer.data`` in training_state.json), and a resume compares it with the data it
is given (``resume.check_resume_data``):

- ``manifest``: a hash of the data folder's manifest (``dflash_data.json``, written by ``data
  prepare``), over the entries that say what the data is (source, tokenizer, options, counts,
  token statistics, shards), not how the prepare ran (its time, workers, markers), so the same
  data prepared again is the same; None for data made otherwise;
- ``files``: every shard's name and size, in the order the data is read (a stat each, no read);
- ``id``: a short hash of both, what is compared.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# The manifest entries that say what the data is (data/prepare.py writes them).
MANIFEST_KEYS = ("version", "kind", "source", "tokenizer", "fingerprints", "options", "counts",
                 "tokens", "shards")


def _hash(obj: Any, size: int) -> str:
    raw = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.blake2b(raw, digest_size=size).hexdigest()


def manifest_hash(folder: str | Path) -> str | None:
    """The hash of a data folder's manifest (None: it has none, or it cannot be read; preflight
    refuses an unreadable one before a resume gets here)."""
    from dflash_core.data.manifest import MANIFEST

    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    return _hash({k: manifest[k] for k in MANIFEST_KEYS if k in manifest}, 16)


def data_identity(path: str | Path, files: list[Path], samples: int) -> dict:
    """The identity of the data at ``path`` whose shard files are ``files`` (as read)."""
    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    listed = [[f.name, f.stat().st_size] for f in files]
    manifest = manifest_hash(folder)
    return {"id": _hash({"manifest": manifest, "files": listed}, 6), "path": str(path.resolve()),
            "manifest": manifest, "files": listed, "samples": int(samples)}


def of_dataset(dataset) -> dict:
    """The identity of a data.ShardedDataset (its path, shard files and sample count)."""
    return data_identity(dataset.path, dataset.files, len(dataset))


def describe(identity: dict) -> str:
    """``<path> (data <id>: N shards, M samples[, manifest <hash>])``, for messages."""
    files = identity.get("files") or []
    made = f", manifest {identity['manifest'][:12]}" if identity.get("manifest") else \
        ", no manifest"
    return (f"{identity.get('path', '?')} (data {identity.get('id', '?')}: {len(files)} shards, "
            f"{identity.get('samples', '?')} samples{made})")
