"""Writing shards in the layouts ``shards.py`` reads (the demo and the tests make their data so).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_core.data.shards import IDS, MASK, DataError


_FORMATS = ("arrow", "arrow-file", "parquet")


def _features(has_mask: bool) -> dict:
    seq = {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "Sequence"}
    feats = {IDS: seq}
    if has_mask:
        feats[MASK] = {"feature": {"dtype": "int8", "_type": "Value"}, "_type": "Sequence"}
    return feats


def write_shards(samples: Iterable[dict], folder: str | Path, *, samples_per_shard: int = 10_000,
                 fmt: str = "arrow", batch_rows: int = 1000, overwrite: bool = False) -> list[Path]:
    """Write samples (dicts with ``input_ids`` and optional ``loss_mask``) as shards.

    ``fmt="arrow"``: IPC stream files in the layout of datasets' save_to_disk
    (``data-0000i-of-0000N.arrow`` + ``state.json`` + ``dataset_info.json``).
    ``"arrow-file"``: IPC file format; ``"parquet"``: row groups of ``batch_rows``; both as a plain
    folder of files. The loss_mask column is written when the first sample has one (later samples
    without it get all ones). Returns the shard paths.
    """
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be one of {_FORMATS}, got {fmt!r}")
    if samples_per_shard <= 0 or batch_rows <= 0:
        raise ValueError("samples_per_shard and batch_rows must be > 0")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    old = [p for p in folder.iterdir()
           if p.suffix in (".arrow", ".parquet") or p.name in ("state.json", "dataset_info.json")]
    if old and not overwrite:
        raise FileExistsError(f"{folder} already holds data files; pass overwrite=True")
    for p in old:
        p.unlink()

    ext = ".parquet" if fmt == "parquet" else ".arrow"
    tag = uuid.uuid4().hex[:8]
    has_mask: bool | None = None
    schema: pa.Schema | None = None
    tmp_files: list[Path] = []
    rows: list[dict] = []

    def flush_shard(shard: list[dict]) -> None:
        tmp = folder / f".tmp-{tag}-{len(tmp_files):05d}{ext}"
        batches = [_to_batch(shard[k:k + batch_rows], schema, has_mask)
                   for k in range(0, len(shard), batch_rows)]
        if fmt == "parquet":
            pq.write_table(pa.Table.from_batches(batches, schema), tmp, row_group_size=batch_rows)
        else:
            with pa.OSFile(str(tmp), "wb") as sink:
                new = pa.ipc.new_file if fmt == "arrow-file" else pa.ipc.new_stream
                with new(sink, schema) as writer:
                    for b in batches:
                        writer.write_batch(b)
        tmp_files.append(tmp)

    for s in samples:
        if has_mask is None:
            has_mask = s.get(MASK) is not None
            schema = pa.schema([(IDS, pa.list_(pa.int32()))]
                               + ([(MASK, pa.list_(pa.int8()))] if has_mask else []))
        rows.append(s)
        if len(rows) == samples_per_shard:
            flush_shard(rows)
            rows = []
    if rows or not tmp_files:
        if schema is None:
            has_mask = True
            schema = pa.schema([(IDS, pa.list_(pa.int32())), (MASK, pa.list_(pa.int8()))])
        flush_shard(rows)

    # Names carry the shard count, known only at the end: rename the temporary files now.
    n = len(tmp_files)
    out = []
    for k, tmp in enumerate(tmp_files):
        name = f"data-{k:05d}-of-{n:05d}{ext}" if fmt == "arrow" else f"part-{k:05d}{ext}"
        tmp.rename(folder / name)
        out.append(folder / name)
    if fmt == "arrow":
        state = {
            "_data_files": [{"filename": p.name} for p in out],
            "_fingerprint": uuid.uuid4().hex[:16],
            "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
            "_output_all_columns": False, "_split": None,
        }
        info = {"citation": "", "description": "", "features": _features(bool(has_mask)),
                "homepage": "", "license": ""}
        (folder / "state.json").write_text(json.dumps(state, indent=2), encoding="utf-8")
        (folder / "dataset_info.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
    return out


def _to_batch(rows: list[dict], schema: pa.Schema, has_mask: bool) -> pa.RecordBatch:
    ids = [np.asarray(r[IDS], dtype=np.int64) for r in rows]
    if ids and any(a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max) for a in ids):
        raise DataError("token ids must fit in int32 and be >= 0")
    cols = {IDS: pa.array([a.astype(np.int32) for a in ids], schema.field(IDS).type)}
    if has_mask:
        masks = []
        for r, a in zip(rows, ids):
            m = r.get(MASK)
            m = np.ones(len(a), np.int8) if m is None else np.asarray(m, dtype=np.int8)
            if len(m) != len(a):
                raise DataError(f"loss_mask has {len(m)} entries but input_ids has {len(a)}")
            masks.append(m)
        cols[MASK] = pa.array(masks, schema.field(MASK).type)
    return pa.record_batch(cols, schema=schema)
