"""Tokenized Arrow shards -> length-bucketed, token-budget batches -> a bounded prefetch queue.

Data on disk is a ``datasets`` save_to_disk folder, or a folder of ``.arrow`` (IPC stream or file
format) / ``.parquet`` files, with a list-of-int column ``input_ids`` and an optional list-of-0/1
column ``loss_mask`` of the same length per row (absent = every token trains).

Arrow shards are memory-mapped: opening a 4 GB data set reads only record-batch headers and the list
offsets (to get every sample's length and to check that ``loss_mask`` matches ``input_ids``); token
values are paged in by the OS when ``get`` touches them. Parquet cannot be mapped: its lengths are
computed once at open, one row group at a time, and ``get`` decodes (and caches) a row group.

Everything here is plain numpy/torch on the CPU; nothing imports the engine.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

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


# --------------------------------------------------------------------------------------------
# Reading shards
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Writing shards (demo and tests)
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Hold-out and batch planning
# --------------------------------------------------------------------------------------------

def _rng(*keys: int) -> np.random.Generator:
    # masking keeps negative seeds valid for SeedSequence
    return np.random.default_rng([k & 0xFFFF_FFFF_FFFF_FFFF for k in keys])


def eval_size(dataset_len: int, eval_prompts: int, eval_fraction: float = 0.0) -> int:
    """Number of held-out samples under DataConfig's rule (fraction 0 = exactly eval_prompts)."""
    if eval_fraction > 0:
        return max(1, int(round(dataset_len * eval_fraction)))
    return eval_prompts


def split_eval(dataset_len: int, n_eval: int, seed: int, *, lengths: np.ndarray | None = None,
               min_length: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic hold-out: (train_indices, eval_indices), both sorted, disjoint, covering all.

    With ``lengths``, eval samples are drawn only among samples of at least ``min_length`` tokens
    (long enough for a prompt plus something to decode)."""
    pool = np.arange(dataset_len)
    if lengths is not None and min_length > 0:
        pool = pool[np.asarray(lengths)[:dataset_len] >= min_length]
    if n_eval < 0:
        raise ValueError(f"n_eval must be >= 0, got {n_eval}")
    if n_eval > len(pool) or (n_eval and n_eval >= dataset_len):  # keep something to train on
        raise DataError(
            f"cannot hold out {n_eval} eval samples from {len(pool)} eligible of {dataset_len}",
            hint="lower data.eval_prompts / data.eval_fraction, or use a larger data set")
    chosen = np.sort(_rng(seed, 0xE7A1).choice(pool, size=n_eval, replace=False))
    train = np.setdiff1d(np.arange(dataset_len), chosen, assume_unique=True)
    return train, chosen


def plan_epoch(lengths: np.ndarray, *, token_budget: int, max_seqs: int, max_length: int,
               seed: int, epoch: int, shard: tuple[int, int] = (0, 1),
               indices: np.ndarray | None = None, window: int = 8192) -> list[list[int]]:
    """Length-bucketed batches of sample ids for one epoch.

    Samples (``indices``, default all) are shuffled, cut into windows of ``window`` samples, sorted
    by length inside each window (similar lengths -> little padding, while the window keeps the
    order random), and grouped greedily so that ``n * longest <= token_budget`` and
    ``n <= max_seqs``, with lengths truncated to ``max_length``. Samples shorter than 2 tokens are
    skipped. Batch order is shuffled. Deterministic for (seed, epoch); ``shard=(rank, world)``
    keeps global batches ``rank, rank + world, ...``.
    """
    if max_length > token_budget:
        raise ValueError(f"max_length {max_length} exceeds token_budget {token_budget}")
    if max_seqs <= 0 or token_budget <= 0 or window <= 0:
        raise ValueError("token_budget, max_seqs and window must be > 0")
    rank, world = shard
    lengths = np.asarray(lengths)
    ids = np.arange(len(lengths)) if indices is None else np.asarray(indices, dtype=np.int64)
    eff = np.minimum(lengths[ids], max_length)
    ids = ids[eff >= MIN_LENGTH]
    rng = _rng(seed, epoch)
    ids = ids[rng.permutation(len(ids))]
    eff = np.minimum(lengths[ids], max_length)

    batches: list[list[int]] = []
    for w0 in range(0, len(ids), window):
        w_ids, w_len = ids[w0:w0 + window], eff[w0:w0 + window]
        order = np.argsort(-w_len, kind="stable")  # longest first; ties keep the random order
        w_ids, w_len = w_ids[order], w_len[order]
        i = 0
        while i < len(w_ids):
            # the first sample is the longest of its batch, so it alone sets the padded width
            k = min(max_seqs, token_budget // int(w_len[i]))
            batches.append(w_ids[i:i + k].tolist())
            i += k
    order = rng.permutation(len(batches))
    return [batches[j] for j in order][rank::world]


def padding_fraction(batches: list[list[int]], lengths: np.ndarray, max_length: int) -> float:
    """Share of padded token slots that hold padding, over a plan."""
    lengths = np.asarray(lengths)
    useful = padded = 0
    for b in batches:
        eff = np.minimum(lengths[b], max_length)
        useful += int(eff.sum())
        padded += len(b) * int(eff.max())
    return 1.0 - useful / padded if padded else 0.0


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------

@dataclass
class Batch:
    input_ids: torch.Tensor  # [n, L] int64, right-padded with 0
    loss_mask: torch.Tensor  # [n, L] int64 0/1, 0 on padding
    attention_mask: torch.Tensor  # [n, L] int64, 1 on real tokens
    lengths: torch.Tensor  # [n] int64, after truncation to max_length
    indices: list[int]  # sample ids in the data set
    epoch: int
    batch_index: int  # global index in the epoch's plan (shared by all workers)
    num_tokens: int  # real tokens
    padded_tokens: int  # n * L
    padding_frac: float

    def __len__(self) -> int:
        return len(self.indices)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Batch":
        return replace(self, input_ids=fn(self.input_ids), loss_mask=fn(self.loss_mask),
                       attention_mask=fn(self.attention_mask), lengths=fn(self.lengths))

    def pin(self) -> "Batch":
        """A copy in pinned memory (fast, asynchronous host-to-GPU copies); no-op without CUDA."""
        if not torch.cuda.is_available():
            return self
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))


def collate(dataset: ShardedDataset, indices: list[int], *, max_length: int, epoch: int = 0,
            batch_index: int = 0) -> Batch:
    """Read, truncate and right-pad samples into one Batch."""
    rows = [dataset.get(i) for i in indices]
    lens = np.array([min(len(ids), max_length) for ids, _ in rows], dtype=np.int64)
    n, width = len(rows), int(lens.max()) if rows else 0
    ids_np = np.zeros((n, width), np.int64)
    mask_np = np.zeros((n, width), np.int64)
    for r, ((ids, mask), k) in enumerate(zip(rows, lens)):
        ids_np[r, :k] = ids[:k]
        mask_np[r, :k] = mask[:k]
    attn = (np.arange(width)[None, :] < lens[:, None]).astype(np.int64)
    num, padded = int(lens.sum()), n * width
    return Batch(
        input_ids=torch.from_numpy(ids_np), loss_mask=torch.from_numpy(mask_np),
        attention_mask=torch.from_numpy(attn), lengths=torch.from_numpy(lens),
        indices=[int(i) for i in indices], epoch=epoch, batch_index=batch_index,
        num_tokens=num, padded_tokens=padded,
        padding_frac=1.0 - num / padded if padded else 0.0,
    )


class BatchStream:
    """The epochs of a run as Batches, resumable at batch granularity.

    Every worker plans the same global epoch (same seed, same lengths) and takes the batches with
    ``batch_index % world == rank``. Resuming with the set of batch indices already done in the
    start epoch gives the same sample order with nothing repeated and nothing lost.
    """

    def __init__(self, dataset: ShardedDataset, *, token_budget: int, max_seqs: int,
                 max_length: int, seed: int, epochs: int,
                 exclude: Iterable[int] | np.ndarray = (), window: int = 8192):
        self.dataset = dataset
        self.token_budget, self.max_seqs, self.max_length = token_budget, max_seqs, max_length
        self.seed, self.epochs, self.window = seed, epochs, window
        excl = np.fromiter(exclude, dtype=np.int64) if not isinstance(exclude, np.ndarray) \
            else exclude.astype(np.int64)
        self.indices = np.setdiff1d(np.arange(len(dataset)), excl)
        self._plans: OrderedDict[int, list[list[int]]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, dataset: ShardedDataset, data_cfg: Any, *, seed: int, epochs: int,
                    exclude: Iterable[int] | np.ndarray = ()) -> "BatchStream":
        """From a ``DataConfig`` (token_budget, max_seqs_per_batch, max_length)."""
        return cls(dataset, token_budget=data_cfg.token_budget,
                   max_seqs=data_cfg.max_seqs_per_batch, max_length=data_cfg.max_length,
                   seed=seed, epochs=epochs, exclude=exclude)

    def plan(self, epoch: int) -> list[list[int]]:
        """The global plan of one epoch (cached: several workers ask for the same one)."""
        with self._lock:
            if epoch not in self._plans:
                self._plans[epoch] = plan_epoch(
                    self.dataset.lengths, token_budget=self.token_budget, max_seqs=self.max_seqs,
                    max_length=self.max_length, seed=self.seed, epoch=epoch,
                    indices=self.indices, window=self.window)
                while len(self._plans) > 3:
                    self._plans.popitem(last=False)
            return self._plans[epoch]

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in epoch 0; later epochs differ by a few (windows are re-drawn)."""
        return len(self.plan(0))

    def total_batches(self) -> int:
        """Global batches over all epochs (plans every epoch: for LR schedules)."""
        return sum(len(self.plan(e)) for e in range(self.epochs))

    def padding_frac(self, epoch: int = 0) -> float:
        return padding_fraction(self.plan(epoch), self.dataset.lengths, self.max_length)

    def iter_batches(self, start_epoch: int = 0, done: set[int] | None = None,
                     worker: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
        """This worker's batches from ``start_epoch`` on, skipping batch indices in ``done``
        (those of ``start_epoch`` already trained) for the start epoch only."""
        rank, world = worker
        done = done or set()
        for epoch in range(start_epoch, self.epochs):
            plan = self.plan(epoch)
            for bi in range(rank, len(plan), world):
                if epoch == start_epoch and bi in done:
                    continue
                yield collate(self.dataset, plan[bi], max_length=self.max_length, epoch=epoch,
                              batch_index=bi)


# --------------------------------------------------------------------------------------------
# Prefetch
# --------------------------------------------------------------------------------------------

_END = object()  # sentinel: the source is exhausted (or failed; then .error is set)


class Prefetcher:
    """A daemon thread that keeps a bounded queue of ready batches ahead of the consumer.

    Every blocking call waits at most ``_POLL`` seconds and then re-checks ``stop``, so ``close()``
    returns promptly even when the queue is full. An exception in the source is kept in ``.error``
    and raised by ``get``; the consumer never hangs on a dead producer.
    """

    _POLL = 0.05

    def __init__(self, source: Iterable[Any], capacity: int, *, pin: bool = False,
                 on_depth: Callable[[int, int], None] | None = None, name: str = "prefetch",
                 stop: threading.Event | None = None, depth_interval: float = 0.2,
                 start: bool = True):
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.queue: queue.Queue = queue.Queue(maxsize=capacity)
        self.stop = stop or threading.Event()
        self.error: BaseException | None = None
        self.exhausted = False
        self.produced = 0
        self._source = source
        self._pin = pin
        self._on_depth = on_depth
        self._depth_interval = depth_interval
        self._last_report = (-1, 0.0)
        self._report_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        if start:
            self.thread.start()

    def start(self) -> None:
        self.thread.start()

    # producer side -----------------------------------------------------------------------

    def _run(self) -> None:
        it = iter(self._source)
        try:
            for item in it:
                if self.stop.is_set():
                    return
                if self._pin and hasattr(item, "pin"):
                    item = item.pin()
                if not self._put(item):
                    return
                self.produced += 1
        except BaseException as exc:  # reported to the consumer, never lost in a dead thread
            self.error = exc
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    pass
            self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=self._POLL)
            except queue.Full:
                continue
            self._report()
            return True
        return False

    # consumer side -----------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> Any | None:
        """The next batch; None on timeout, once stopped, or once exhausted (see ``exhausted``).
        Raises the source's exception if it failed."""
        if self.error is not None:
            raise self.error
        if self.exhausted:
            return None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = self._POLL if deadline is None else deadline - time.monotonic()
            try:
                if left > 0:
                    item = self.queue.get(timeout=min(self._POLL, left))
                else:
                    item = self.queue.get_nowait()
                break
            except queue.Empty:
                if self.error is not None:
                    raise self.error
                if (deadline is not None and left <= self._POLL) or self.stop.is_set():
                    return None
        if item is _END:
            if self.error is not None:
                raise self.error
            self.exhausted = True
            return None
        self._report()
        return item

    def __iter__(self) -> Iterator[Any]:
        """Batches until the source ends or ``stop`` is set."""
        while not self.exhausted and not self.stop.is_set():
            item = self.get(timeout=self._POLL)
            if item is not None:
                yield item

    def depth(self) -> int:
        return self.queue.qsize()

    def _report(self) -> None:
        if self._on_depth is None:
            return
        depth, now = self.queue.qsize(), time.monotonic()
        with self._report_lock:
            last_depth, last_t = self._last_report
            # rate-limited, but empty and full (the states an operator cares about) always show
            edge = depth in (0, self.capacity) and depth != last_depth
            if not edge and (depth == last_depth or now - last_t < self._depth_interval):
                return
            self._last_report = (depth, now)
        try:
            self._on_depth(depth, self.capacity)
        except Exception:
            pass  # telemetry must never stop the data flowing

    def close(self, timeout: float = 2.0) -> bool:
        """Stop the thread and drop what is queued; True when the thread is gone."""
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        while True:  # release queued (possibly pinned) batches
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        return not self.thread.is_alive()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
