"""Reading training data: tokenized shards on disk, opened without loading them.

Data on disk is a ``datasets`` save_to_disk folder, or a folder of ``.arrow`` (IPC stream or file
format) / ``.parquet`` files, with a list-of-int column ``input_ids`` and an optional list-of-0/1
column ``loss_mask`` of the same length per row (absent = every token trains).

Arrow shards are memory-mapped: opening a 4 GB data set reads only record-batch headers and the list
offsets (to get every sample's length and to check that ``loss_mask`` matches ``input_ids``); token
values are paged in by the OS when ``get`` touches them. Parquet cannot be mapped: its lengths are
computed once at open, one row group at a time, and ``get`` decodes (and caches) a row group.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


IDS = "input_ids"
MASK = "loss_mask"
MIN_LENGTH = 2  # a sample needs at least one (context, next token) pair to train anything
_ARROW_FILE_MAGIC = b"ARROW1"


class DataError(ValueError):
    """Bad training data. The message names the file and the problem; ``hint`` says how to fix."""

    error_kind = "data"

    def __init__(self, message: str, *, file: str | Path | None = None, hint: str = ""):
        self.file = str(file) if file is not None else ""
        self.hint = hint
        super().__init__(f"{self.file}: {message}" if self.file else message)


_FIX_COLUMNS = (
    "each row needs input_ids (a list of token ids) and optionally loss_mask (a list of 0/1 of the "
    "same length); re-tokenize the data or point data.path at the right folder"
)


def _check_list_type(schema: pa.Schema, name: str, path: Path, *, allow_bool: bool) -> bool:
    """True when ``name`` is a usable list-of-integers column, False when absent."""
    if schema.get_field_index(name) < 0:
        return False
    tp = schema.field(name).type
    if not (pa.types.is_list(tp) or pa.types.is_large_list(tp)):
        raise DataError(f"column {name!r} has type {tp}, expected a list of integers",
                        file=path, hint=_FIX_COLUMNS)
    item = tp.value_type
    if not (pa.types.is_integer(item) or (allow_bool and pa.types.is_boolean(item))):
        raise DataError(f"column {name!r} holds {item} values, expected integers",
                        file=path, hint=_FIX_COLUMNS)
    return True


def _check_schema(schema: pa.Schema, path: Path) -> bool:
    """Validate the columns; returns whether a loss_mask column is present."""
    if not _check_list_type(schema, IDS, path, allow_bool=False):
        raise DataError(f"no {IDS!r} column (columns: {schema.names})", file=path,
                        hint=_FIX_COLUMNS)
    return _check_list_type(schema, MASK, path, allow_bool=True)


class _ListColumn:
    """Offsets (as numpy) and values of one list column of one record batch.

    Integer values are a zero-copy numpy view (of the memory map for Arrow shards). Boolean values
    are bit-packed and cannot be viewed, so those are sliced lazily per row instead.
    """

    def __init__(self, arr: pa.Array, name: str, path: Path, row_base: int):
        if arr.null_count:
            row = row_base + int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(f"row {row}: {name} is null", file=path,
                            hint=f"drop rows without {name} before training")
        # offsets of a (possibly sliced) list array index into the un-sliced child ``values``
        self.offsets = arr.offsets.to_numpy()
        values = arr.values
        if values.null_count:
            raise DataError(f"column {name!r} holds null token values", file=path,
                            hint="drop or repair the rows with missing values")
        self._values: Any
        try:
            self._values = values.to_numpy(zero_copy_only=True)
        except pa.ArrowInvalid:
            self._values = values

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row(self, r: int) -> np.ndarray:
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        if isinstance(self._values, np.ndarray):
            return self._values[a:b]
        return self._values.slice(a, b - a).to_numpy(zero_copy_only=False)


class _Chunk:
    """One record batch of a shard: lengths computed and loss_mask agreement checked at once."""

    def __init__(self, batch: pa.RecordBatch, has_mask: bool, path: Path, row_base: int):
        self.ids = _ListColumn(batch.column(IDS), IDS, path, row_base)
        self.lengths = self.ids.lengths()
        self.mask = None
        if has_mask:
            self.mask = _ListColumn(batch.column(MASK), MASK, path, row_base)
            bad = np.flatnonzero(self.mask.lengths() != self.lengths)
            if bad.size:
                r = int(bad[0])
                raise DataError(
                    f"row {row_base + r}: loss_mask has {int(self.mask.lengths()[r])} entries but "
                    f"input_ids has {int(self.lengths[r])} ({bad.size} such rows in this batch)",
                    file=path,
                    hint="loss_mask must be exactly as long as input_ids in every row; "
                         "fix the tokenization script, or drop the loss_mask column to train on "
                         "every token",
                )

    def get(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.ids.row(r).astype(np.int64)  # copies: the caller never holds the memory map
        if self.mask is None:
            return ids, np.ones(len(ids), dtype=np.uint8)
        return ids, (self.mask.row(r) != 0).astype(np.uint8)


def _locate(starts: np.ndarray, i: int) -> tuple[int, int]:
    """(chunk, row within chunk) for row ``i`` given the chunks' first-row offsets."""
    c = int(np.searchsorted(starts, i, side="right")) - 1
    return c, i - int(starts[c])


def _starts(counts: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)[:-1]]).astype(np.int64)


class _ArrowShard:
    def __init__(self, path: Path):
        self.path = path
        try:
            source = pa.memory_map(str(path), "r")
            if source.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                schema = reader.schema
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            else:
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                schema = reader.schema
                batches = list(reader)  # zero-copy: the batches point into the memory map
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise DataError(
                f"not a readable Arrow IPC file or stream ({exc})", file=path,
                hint="the file is corrupt or truncated, or is not Arrow: re-create it (e.g. "
                     "datasets save_to_disk) or remove it from the folder",
            ) from exc
        has_mask = _check_schema(schema, path)
        self.chunks: list[_Chunk] = []
        row = 0
        for b in batches:
            self.chunks.append(_Chunk(b, has_mask, path, row))
            row += b.num_rows
        self.has_mask = has_mask
        self._starts = _starts([len(c.lengths) for c in self.chunks])
        self.lengths = (np.concatenate([c.lengths for c in self.chunks]).astype(np.int64)
                        if self.chunks else np.zeros(0, np.int64))

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        c, r = _locate(self._starts, i)
        return self.chunks[c].get(r)


class _ParquetShard:
    """Parquet is decoded, not mapped: lengths are taken once at open (one row group at a time, so
    memory stays bounded) and ``get`` decodes its row group, keeping a few recent ones."""

    CACHE = 4

    def __init__(self, path: Path):
        self.path = path
        try:
            self._file = pq.ParquetFile(str(path), memory_map=True)
            schema = self._file.schema_arrow
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise DataError(f"not a readable Parquet file ({exc})", file=path,
                            hint="re-create the file or remove it from the folder") from exc
        self.has_mask = _check_schema(schema, path)
        self._columns = [IDS, MASK] if self.has_mask else [IDS]
        counts = [self._file.metadata.row_group(g).num_rows
                  for g in range(self._file.num_row_groups)]
        self._starts = _starts(counts) if counts else np.zeros(0, np.int64)
        self._cache: OrderedDict[int, tuple[np.ndarray, list[_Chunk]]] = OrderedDict()
        self._lock = threading.Lock()  # several loader threads may share one data set
        lengths = [np.concatenate([c.lengths for c in self._read_group(g)[1]] or [np.zeros(0)])
                   for g in range(len(counts))]
        self.lengths = (np.concatenate(lengths).astype(np.int64) if lengths
                        else np.zeros(0, np.int64))

    def _read_group(self, g: int) -> tuple[np.ndarray, list[_Chunk]]:
        try:
            table = self._file.read_row_group(g, columns=self._columns)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise DataError(f"row group {g} is unreadable ({exc})", file=self.path,
                            hint="re-create the file or remove it from the folder") from exc
        base = int(self._starts[g])
        chunks, row = [], base
        for b in table.to_batches():  # to_batches aligns the chunks of both columns
            chunks.append(_Chunk(b, self.has_mask, self.path, row))
            row += b.num_rows
        return _starts([len(c.lengths) for c in chunks]), chunks

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        g, r = _locate(self._starts, i)
        with self._lock:
            if g in self._cache:
                self._cache.move_to_end(g)
            else:
                self._cache[g] = self._read_group(g)
                if len(self._cache) > self.CACHE:
                    self._cache.popitem(last=False)
            starts, chunks = self._cache[g]
        c, rr = _locate(starts, r)
        return chunks[c].get(rr)


def _resolve_files(path: Path) -> list[Path]:
    """The shard files of a data path, in order."""
    if not path.exists():
        raise DataError("data path does not exist", file=path,
                        hint="set data.path in config.yaml to a datasets save_to_disk folder or a "
                             "folder of .arrow / .parquet files")
    if path.is_file():
        return [path]
    dd = path / "dataset_dict.json"
    if dd.exists():  # a DatasetDict: one save_to_disk folder per split
        try:
            splits = json.loads(dd.read_text(encoding="utf-8")).get("splits", [])
        except (OSError, ValueError) as exc:
            raise DataError(f"unreadable dataset_dict.json ({exc})", file=dd) from exc
        if "train" in splits or len(splits) == 1:
            return _resolve_files(path / ("train" if "train" in splits else splits[0]))
        raise DataError(f"holds several splits {splits} and none is 'train'", file=path,
                        hint=f"set data.path to one split folder, e.g. {path / splits[0]}"
                        if splits else "")
    state = path / "state.json"
    if state.exists():  # datasets save_to_disk: state.json lists the shards in order
        try:
            names = [d["filename"] for d in
                     json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"unreadable state.json ({exc})", file=state,
                            hint="re-save the data set with datasets save_to_disk") from exc
        files = [path / n for n in names]
        for f in files:
            if not f.exists():
                raise DataError("listed in state.json but missing", file=f,
                                hint="copy the whole save_to_disk folder again")
    else:
        # hidden files are skipped: write_shards' temporaries, editor and OS droppings
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")
                       and p.suffix in (".arrow", ".parquet"))
    if not files:
        raise DataError("no .arrow or .parquet files in this folder", file=path,
                        hint="point data.path at the folder that holds the data shards")
    return files


class ShardedDataset:
    """Random access to tokenized samples spread over many shard files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files: list[Path] = _resolve_files(self.path)
        self._shards = [_ParquetShard(f) if f.suffix == ".parquet" else _ArrowShard(f)
                        for f in self.files]
        counts = [len(s.lengths) for s in self._shards]
        self._starts = _starts(counts)
        self.lengths: np.ndarray = np.concatenate([s.lengths for s in self._shards])
        self.has_loss_mask = all(s.has_mask for s in self._shards)
        if len(self.lengths) == 0:
            raise DataError("the data set holds no samples", file=self.path,
                            hint="point data.path at a non-empty tokenized data set")

    @classmethod
    def open(cls, path: str | Path) -> "ShardedDataset":
        return cls(path)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int64, loss_mask uint8 of 0/1) of sample ``i``; both fresh arrays."""
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        s, r = _locate(self._starts, i)
        return self._shards[s].get(r)

    __getitem__ = get

    def __repr__(self) -> str:
        return f"ShardedDataset({str(self.path)!r}, samples={len(self)}, files={len(self.files)})"
