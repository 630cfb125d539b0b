"""``data prepare``: conversations -> the shards the engine reads, with a manifest written last.

Rows are rendered in parallel (one process per core, forked so the tokenizer loads once) and come
back in source order, so the same source and options write the same shards. A row that cannot be
used is counted under its reason (``conversations.REASONS``) with a first example of each; none
is dropped in silence. The output folder gets a marker first and the manifest last (``manifest``),
so an interrupted prepare is never taken for a finished one; shards are written under hidden
temporary names and renamed at the end (``writing.write_shards``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from dflash_core.data.chat_render import (
    ChatRenderer, RenderStats, fingerprints, load_tokenizer,
)
from dflash_core.data.conversations import (
    Conversation, Malformed, RowError, read_rows, source_files, source_fingerprint,
)
from dflash_core.data.manifest import MANIFEST, MARKER, VERSION, mark_finished, mark_started
from dflash_core.data.progress import ProgressLine
from dflash_core.data.shards import DataError
from dflash_core.data.writing import write_shards

CHUNK_ROWS = 64  # rows per task sent to a worker: amortises the pickling of results


@dataclass
class PrepareOptions:
    source: str | Path
    out: str | Path
    tokenizer: str = "builtin:tiny"
    chat_template: str | Path | None = None
    thinking: str = "keep"
    max_length: int = 0  # 0 = no limit; longer samples are counted under too_long
    workers: int = 0  # 0 = one per core
    overwrite: bool = False
    samples_per_shard: int = 10_000
    fmt: str = "arrow"
    progress: bool = True


@dataclass
class _Tally:
    rows: int = 0
    samples: int = 0
    dropped: dict = field(default_factory=dict)
    examples: dict = field(default_factory=dict)
    lengths: list = field(default_factory=list)
    trained: list = field(default_factory=list)
    render: RenderStats = field(default_factory=RenderStats)

    def drop(self, reason: str, rid: str, detail: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self.examples.setdefault(reason, f"{rid}: {detail}")


# ------------------------------------------------------------------------------------------------
# Workers
# ------------------------------------------------------------------------------------------------

_WORKER: dict = {}  # set in the parent before forking; the children inherit it


def _render_chunk(rows: list) -> tuple[int, list, list, RenderStats]:
    renderer: ChatRenderer = _WORKER["renderer"]
    max_length: int = _WORKER["max_length"]
    samples, drops, stats = [], [], RenderStats()
    for r in rows:
        if isinstance(r, Malformed):
            drops.append((r.reason, r.id, r.detail))
            continue
        try:
            out = renderer.render(r, stats)
        except RowError as exc:
            drops.append((exc.reason, r.id, str(exc)))
            continue
        for s in out:
            if max_length and len(s.input_ids) > max_length:
                drops.append(("too_long", r.id, f"{len(s.input_ids)} tokens > {max_length}"))
            elif not any(s.loss_mask):
                drops.append(("no_assistant", r.id, "no trained token after rendering"))
            else:
                samples.append((np.asarray(s.input_ids, np.int32),
                                np.asarray(s.loss_mask, np.int8)))
    return len(rows), samples, drops, stats


def _chunks(rows: Iterator[Conversation | Malformed], n: int) -> Iterator[list]:
    buf: list = []
    for r in rows:
        buf.append(r)
        if len(buf) == n:
            yield buf
            buf = []
    if buf:
        yield buf


def count_rows(source: str | Path) -> int:
    """Rows in a source, cheaply (the progress bar's total)."""
    import pyarrow.parquet as pq

    fmt, files = source_files(source)
    if fmt == "parquet":
        return sum(pq.ParquetFile(str(f)).metadata.num_rows for f in files)
    if fmt == "jsonl":
        n = 0
        for f in files:
            with open(f, "rb") as fh:
                n += sum(1 for line in fh if line.strip())
        return n
    return 0  # arrow: not worth a pass; the bar shows a count without a total


# ------------------------------------------------------------------------------------------------
# The output folder
# ------------------------------------------------------------------------------------------------

def claim_output(out: Path, overwrite: bool) -> None:
    """Refuse a folder that holds anything unless ``overwrite``; then empty it of our files."""
    if out.exists() and not out.is_dir():
        raise DataError("the output path is a file", file=out, hint="pass --out a folder")
    held = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if held and not overwrite:
        raise DataError(f"the output folder already holds {len(held)} entries "
                        f"({', '.join(held[:4])}{', ...' if len(held) > 4 else ''})", file=out,
                        hint="pass another --out, or --overwrite to replace what is there")
    foreign = [n for n in held if not _ours(n)]
    if foreign:  # --overwrite replaces data, it does not empty a folder of other things
        raise DataError(f"the output folder holds files a prepare does not write "
                        f"({', '.join(foreign[:4])})", file=out,
                        hint="pass --out an empty or new folder")
    for name in held:
        (out / name).unlink()
    out.mkdir(parents=True, exist_ok=True)


def _ours(name: str) -> bool:
    return (name in (MANIFEST, MARKER, "state.json", "dataset_info.json")
            or name.startswith(".tmp-") or name.startswith(f".{MANIFEST}")
            or (name.startswith(("data-", "part-")) and name.endswith((".arrow", ".parquet"))))


def _stats(lengths: list[int], trained: list[int]) -> dict:
    if not lengths:
        return {"samples": 0, "tokens": 0, "trained_tokens": 0}
    a = np.asarray(lengths)
    return {
        "samples": int(a.size), "tokens": int(a.sum()), "trained_tokens": int(sum(trained)),
        "trained_share": round(float(sum(trained) / a.sum()), 4),
        "length": {"min": int(a.min()), "mean": round(float(a.mean()), 1),
                   "p50": int(np.percentile(a, 50)), "p90": int(np.percentile(a, 90)),
                   "p99": int(np.percentile(a, 99)), "max": int(a.max())},
    }


# ------------------------------------------------------------------------------------------------
# prepare
# ------------------------------------------------------------------------------------------------

def prepare(opts: PrepareOptions) -> dict:
    """Run a prepare; returns the manifest written. Raises DataError for bad input (before any
    file is written where it can be found out before)."""
    t0 = time.monotonic()
    fmt, files = source_files(opts.source)
    tok = load_tokenizer(opts.tokenizer, opts.chat_template)
    renderer = ChatRenderer(tok, opts.thinking)
    out = Path(opts.out).expanduser()
    claim_output(out, opts.overwrite)
    src_fp = source_fingerprint(files)
    mark_started(out, {"source": str(opts.source), "source_fingerprint": src_fp})

    workers = opts.workers or os.cpu_count() or 1
    total = count_rows(opts.source)
    bar = ProgressLine("prepare", total or None, "rows", enabled=opts.progress)
    tally = _Tally()
    _WORKER.update(renderer=renderer, max_length=opts.max_length)
    pool = None
    try:
        chunks = _chunks(read_rows(opts.source), CHUNK_ROWS)
        if workers > 1:
            # Fork: the children inherit the loaded tokenizer; its own threads stay off so a
            # forked copy cannot deadlock on a lock held by a thread of the parent.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            pool = mp.get_context("fork").Pool(workers)
            results = pool.imap(_render_chunk, chunks)
        else:
            results = map(_render_chunk, chunks)

        def samples() -> Iterator[dict]:
            for n_rows, chunk_samples, drops, stats in results:
                tally.render.add(stats)
                for reason, rid, detail in drops:
                    tally.drop(reason, rid, detail)
                for ids, mask in chunk_samples:
                    tally.lengths.append(len(ids))
                    tally.trained.append(int(mask.sum()))
                    yield {"input_ids": ids, "loss_mask": mask}
                tally.rows += n_rows
                bar.update(done=tally.rows, dropped=sum(tally.dropped.values()))

        shards = write_shards(samples(), out, samples_per_shard=opts.samples_per_shard,
                              fmt=opts.fmt, overwrite=True)
        bar.update(done=tally.rows)
    except BaseException:
        for p in out.glob(".tmp-*"):
            p.unlink(missing_ok=True)  # the marker stays: the folder reads as unfinished
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        _WORKER.clear()
        bar.close()

    n = len(tally.lengths)
    if n == 0:
        for p in shards:
            p.unlink(missing_ok=True)
        first = "; ".join(f"{k}: {v} (e.g. {tally.examples[k]})" for k, v in
                          sorted(tally.dropped.items()))
        raise DataError(f"no row could be used ({first or 'the source is empty'})",
                        file=opts.source, hint="fix the rows by the reasons given, or check "
                        "--tokenizer / --chat-template / --max-length")
    manifest = {
        "version": VERSION,
        "kind": "prepare",
        "source": {"path": str(Path(opts.source).expanduser().resolve()), "format": fmt,
                   "files": len(files), "fingerprint": src_fp},
        "tokenizer": {"name": str(opts.tokenizer),
                      "chat_template_file": str(opts.chat_template) if opts.chat_template
                      else None},
        "fingerprints": fingerprints(tok),
        "options": {"thinking": opts.thinking, "max_length": opts.max_length,
                    "format": opts.fmt},
        "counts": {"rows": tally.rows, "rows_used": tally.rows -
                   sum(tally.dropped.values()), "samples": n,
                   "dropped": dict(sorted(tally.dropped.items())),
                   "split_rows": tally.render.split_rows,
                   "server_ids_turns": tally.render.server_ids_turns,
                   "server_ids_differ": tally.render.server_ids_differ},
        "examples": tally.examples,
        "tokens": _stats(tally.lengths, tally.trained),
        "shards": [p.name for p in shards],
        "seconds": round(time.monotonic() - t0, 2),
        "workers": workers,
    }
    mark_finished(out, manifest)
    return manifest


__all__ = ["PrepareOptions", "prepare", "claim_output", "count_rows", "MANIFEST", "MARKER"]
