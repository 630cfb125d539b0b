"""``data prepare``: conversations -> the shards the engine reads, with a manifest written last.

Rows are rendered in parallel (one process per core, forked so the tokenizer loads once) and come
back in source order, so the same source and options write the same shards. A row that cannot be
used is counted under its reason (``conversations.REASONS``) with a first example of each; none
is dropped in silence. A sample longer than ``max_length`` is cut to its first ``max_length``
tokens, as a run cuts it, and counted with where the cut fell (``cutting.py``). The output is written into a hidden folder beside ``--out`` (a marker
first, the manifest last) and swapped in at the end (``output.Staging``), under a lock that
refuses a second writer (``lock.OutputLock``): a prepare that fails, or is interrupted, leaves
``--out`` as it was, and never writes into its own input or replaces a folder it did not write.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from dflash_core.data.chat_render import (
    ChatRenderer, RenderStats, fingerprints, load_tokenizer,
)
from dflash_core.data.cutting import CutCounts, cut_sample, first_answer
from dflash_core.data.conversations import (
    Conversation, Malformed, RowError, read_rows, source_files, source_fingerprint, text_chars,
)
from dflash_core.data.lock import OutputLock
from dflash_core.data.manifest import MANIFEST, MARKER, VERSION, mark_finished, mark_started
from dflash_core.data.output import OWNER, Staging, check_apart, check_out
from dflash_core.data.progress import ProgressLine
from dflash_core.data.provenance import Origins, for_manifest, regen_record_for
from dflash_core.data.shards import DataError
from dflash_core.data.writing import write_shards

CHUNK_ROWS = 64  # rows per task sent to a worker: amortises the pickling of results


@dataclass
class PrepareOptions:
    source: str | Path
    out: str | Path
    tokenizer: str = "builtin:tiny"
    chat_template: str | Path | None = None
    trust_remote_code: bool = False  # a tokenizer of the folder's own code (auto_map) may run
    thinking: str = "keep"
    # 0 = no limit; longer samples are cut to their first max_length tokens (cutting.py)
    max_length: int = 0
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
    origins: Origins = field(default_factory=Origins)  # where the used rows' responses came from
    cuts: CutCounts = field(default_factory=CutCounts)

    def drop(self, reason: str, rid: str, detail: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self.examples.setdefault(reason, f"{rid}: {detail}")


# ------------------------------------------------------------------------------------------------
# Workers
# ------------------------------------------------------------------------------------------------

_WORKER: dict = {}  # set in the parent before forking; the children inherit it


def _render_chunk(rows: list) -> tuple[int, list, list, RenderStats, Origins]:
    renderer: ChatRenderer = _WORKER["renderer"]
    max_length: int = _WORKER["max_length"]
    max_chars: int = _WORKER["max_chars"]
    samples, drops, stats, origins = [], [], RenderStats(), Origins()
    for r in rows:
        if isinstance(r, Malformed):
            drops.append((r.reason, r.id, r.detail))
            continue
        if max_chars and (n := text_chars(r)) > max_chars:
            # The cost of a huge row is bounded: it is not tokenized (several times over, once
            # per assistant turn) only to be found too long.
            drops.append(("too_long_chars", r.id, f"{n} characters > {max_chars}"))
            continue
        row_stats = RenderStats()
        try:
            out = renderer.render(r, row_stats)
        except RowError as exc:
            drops.append((exc.reason, r.id, str(exc)))
            continue
        except Exception as exc:  # the tokenizer's own errors on odd text: this row's, counted
            drops.append(("render_error", r.id, f"{type(exc).__name__}: {exc}"[:300]))
            continue
        kept, why = [], []
        for s in out:
            ids, mask, cut = cut_sample(np.asarray(s.input_ids, np.int32),
                                        np.asarray(s.loss_mask, np.int8), max_length)
            if mask.any():
                kept.append((ids, mask, cut))
            elif cut is not None:
                at = first_answer(np.asarray(s.loss_mask))
                why.append(("too_long", r.id, f"{cut.length} tokens > {max_length}, and the "
                            f"first {max_length} hold no answer (the first starts at token "
                            f"{at})"))
            else:
                why.append(("no_assistant", r.id, "no trained token after rendering"))
        if not kept:  # the row is left out once, under its first sample's reason
            drops.append(why[0])
            continue
        # A used row: its counts (split, joined, server ids) and the turns of a split row
        # left out (a row is counted once: as used, or by one reason)
        stats.add(row_stats)
        origins.count(r)
        for reason, _, _ in why:
            stats.split_samples_dropped[reason] = stats.split_samples_dropped.get(reason, 0) + 1
        samples += kept
    return len(rows), samples, drops, stats, origins


def _die_with_parent() -> None:
    """A worker is killed with its parent (Linux): a killed prepare leaves no orphan holding its
    lock or printing broken pipes."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


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
    """Rows in a source, cheaply (the progress bar's total; 0 = unknown). A file that cannot be
    counted is not an error here: reading its rows says what is wrong with it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fmt, files = source_files(source)
    try:
        if fmt == "parquet":
            return sum(pq.ParquetFile(str(f)).metadata.num_rows for f in files)
        if fmt == "jsonl":
            n = 0
            for f in files:
                with open(f, "rb") as fh:
                    n += sum(1 for line in fh if line.strip())
            return n
    except (OSError, pa.ArrowException):
        pass
    return 0  # arrow: not worth a pass; the bar shows a count without a total


def max_chars_for(tok, max_length: int) -> int:
    """Characters that ``max_length`` tokens can hold at most: no token of a byte-level BPE or
    SentencePiece vocabulary decodes to more characters than its own spelling, so a text longer
    than this is over ``max_length`` tokens without tokenizing it (2x spare for the rest)."""
    if not max_length:
        return 0
    longest = max((len(t) for t in tok.get_vocab()), default=1)
    return 2 * max_length * max(1, longest)


# ------------------------------------------------------------------------------------------------
# The output folder
# ------------------------------------------------------------------------------------------------

def _ours(name: str) -> bool:
    """Entries a prepare writes in its folder (``--overwrite`` replaces a folder of only these)."""
    return (name in (MANIFEST, MARKER, OWNER, "state.json", "dataset_info.json")
            or name.startswith(".tmp-") or name.startswith(f".{MANIFEST}")
            or (name.startswith(("data-", "part-")) and name.endswith((".arrow", ".parquet"))))


def claim_output(out: Path, overwrite: bool) -> bool:
    """Refuse an output folder a prepare may not write (``output.check_out``); True when it
    holds an earlier prepare's data that ``overwrite`` replaces."""
    return check_out(out, "prepare", overwrite=overwrite, ours=_ours)


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

def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def check_options(opts: PrepareOptions) -> None:
    """The numbers and names the command line checks too, for callers of ``prepare``."""
    bad = [f"{k} must be >= {lo}, got {v}" for k, v, lo in (
        ("max_length", opts.max_length, 0), ("workers", opts.workers, 0),
        ("samples_per_shard", opts.samples_per_shard, 1)) if not isinstance(v, int) or v < lo]
    if opts.fmt not in ("arrow", "parquet"):
        bad.append(f"fmt must be arrow or parquet, got {opts.fmt!r}")
    if bad:
        raise DataError("; ".join(bad), hint="see dflash-tui data prepare --help")


def prepare(opts: PrepareOptions) -> dict:
    """Run a prepare; returns the manifest written. Raises DataError for bad input, before
    anything is written where it can be found out before. The output is written beside ``out``
    and swapped in at the end: a prepare that fails leaves ``out`` as it was."""
    t0 = time.monotonic()
    check_options(opts)
    fmt, files = source_files(opts.source)
    out = Path(opts.out).expanduser().resolve()  # a link: the folder it names
    check_apart(out, [("conversations source", opts.source), ("tokenizer folder",
                      opts.tokenizer), ("chat template", opts.chat_template)])
    claim_output(out, opts.overwrite)  # the cheap refusals before loading the tokenizer
    tok = load_tokenizer(opts.tokenizer, opts.chat_template, opts.trust_remote_code)
    renderer = ChatRenderer(tok, opts.thinking)
    with OutputLock(out, "prepare", _note):
        staging = Staging(out, _ours, _note)
        staging.recover()
        claim_output(out, opts.overwrite)  # again, now that no one else writes it
        stage = staging.begin("prepare")
        try:
            manifest = _prepare_into(stage, opts, fmt, files, tok, renderer, t0)
            staging.install()
        except BaseException:
            staging.abort()
            raise
    return manifest


def _prepare_into(stage: Path, opts: PrepareOptions, fmt: str, files: list[Path], tok,
                  renderer: ChatRenderer, t0: float) -> dict:
    src_fp = source_fingerprint(files)
    mark_started(stage, {"source": str(opts.source), "source_fingerprint": src_fp})
    workers = opts.workers or os.cpu_count() or 1
    total = count_rows(opts.source)
    bar = ProgressLine("prepare", total or None, "rows", enabled=opts.progress)
    tally = _Tally()
    _WORKER.update(renderer=renderer, max_length=opts.max_length,
                   max_chars=max_chars_for(tok, opts.max_length))
    pool = None
    try:
        chunks = _chunks(read_rows(opts.source), CHUNK_ROWS)
        if workers > 1:
            # Fork: the children inherit the loaded tokenizer; its own threads stay off so a
            # forked copy cannot deadlock on a lock held by a thread of the parent.
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            pool = mp.get_context("fork").Pool(workers, initializer=_die_with_parent)
            results = pool.imap(_render_chunk, chunks)
        else:
            results = map(_render_chunk, chunks)

        def samples() -> Iterator[dict]:
            for n_rows, chunk_samples, drops, stats, origins in results:
                tally.render.add(stats)
                tally.origins.add(origins)
                for reason, rid, detail in drops:
                    tally.drop(reason, rid, detail)
                for ids, mask, cut in chunk_samples:
                    tally.lengths.append(len(ids))
                    tally.trained.append(int(mask.sum()))
                    tally.cuts.add(cut)
                    yield {"input_ids": ids, "loss_mask": mask}
                tally.rows += n_rows
                bar.update(done=tally.rows, dropped=sum(tally.dropped.values()))

        shards = write_shards(samples(), stage, samples_per_shard=opts.samples_per_shard,
                              fmt=opts.fmt)
        bar.update(done=tally.rows)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        _WORKER.clear()
        bar.close()

    n = len(tally.lengths)
    if n == 0:
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
                   "split_samples_dropped": dict(sorted(
                       tally.render.split_samples_dropped.items())),
                   "joined_rows": tally.render.joined_rows,
                   "tool_call_turns": tally.render.tool_call_turns,
                   "tool_turns": tally.render.tool_turns,
                   "server_ids_turns": tally.render.server_ids_turns,
                   "server_ids_differ": tally.render.server_ids_differ,
                   "cut": tally.cuts.summary(opts.max_length, int(sum(tally.lengths)),
                                             int(sum(tally.trained)))},
        "examples": tally.examples,
        # where the responses came from (regenerated as text or token ids; provenance.py)
        "provenance": for_manifest(tally.origins, regen_record_for(files, src_fp)),
        "tokens": _stats(tally.lengths, tally.trained),
        "shards": [p.name for p in shards],
        "seconds": round(time.monotonic() - t0, 2),
        "workers": workers,
    }
    mark_finished(stage, manifest)
    return manifest


__all__ = ["PrepareOptions", "prepare", "claim_output", "count_rows", "MANIFEST", "MARKER"]
