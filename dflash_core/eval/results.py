"""Results on disk, one JSONL file per (prompt set, decoder), continued when run again.

``<out>/<set>/plain.jsonl`` holds the target decoding alone (the speedup's baseline and the
lossless check's reference); ``<out>/<set>/drafter-<label>.jsonl`` one drafter's. Lines:

- first, the header: ``{"kind": "header", "format": 1, "settings": {...}}``, what the results
  depend on (target, tokenizer and template, prompt file, drafter, thinking, temperature, seed,
  new-token limit, batch size, cache, dtype, device). A file is continued only under the same
  settings; otherwise the run is refused, naming what changed (a file with no batch measured
  yet is started again: nothing in it would be lost).
- per prompt: ``{"kind": "prompt", "index", "id", "batch", "prompt_tokens", "tokens",
  "acceptance", "proposed"}`` (and ``"lossless"`` when the greedy check found a difference; a
  drafter's greedy line also ``"served_acceptance"``, its rounds counted as vLLM's counters count
  them, each of ``"served_drafts"`` drafts (``"served_proposed"`` per round where the target's
  window left fewer): summary.vllm_count);
- per batch, after its prompts: ``{"kind": "batch", "batch", "prompts", "seconds",
  "prefill_seconds"}``.

A batch is appended in one write and flushed to disk; a batch without its closing line (the
process stopped while writing) is cut off when the file is opened again and decoded anew.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from dflash_core import strict_json
from dflash_core.eval.errors import EvalInputError

FORMAT = 1
PLAIN = "plain.jsonl"


@dataclass
class Batch:
    number: int
    prompts: list[int]
    seconds: float
    prefill_seconds: float

    @classmethod
    def from_record(cls, x: dict) -> Batch:
        """The batch its closing line in the file stands for."""
        return cls(int(x["batch"]), list(x["prompts"]), float(x["seconds"]),
                   float(x["prefill_seconds"]))


@dataclass
class ResultsFile:
    path: Path
    settings: dict
    prompts: dict[int, dict] = field(default_factory=dict)  # index -> its line
    batches: list[Batch] = field(default_factory=list)

    @property
    def next_batch(self) -> int:
        return 1 + max((b.number for b in self.batches), default=-1)

    def done(self, index: int) -> bool:
        return index in self.prompts

    def append(self, lines: list[dict], batch: Batch) -> None:
        """The batch's prompt lines and its closing line, in one write, on disk when this
        returns."""
        record = {"kind": "batch", "batch": batch.number, "prompts": batch.prompts,
                  "seconds": round(batch.seconds, 6),
                  "prefill_seconds": round(batch.prefill_seconds, 6)}
        text = "".join(strict_json.dumps(x, separators=(",", ":")) + "\n"
                       for x in [*lines, record])
        size = self.path.stat().st_size
        try:
            _append_text(self.path, text)
        except OSError as exc:
            try:  # the batch's part that reached the disk goes: no torn batch is left behind
                with open(self.path, "r+b") as fh:
                    fh.truncate(size)
            except OSError:
                pass  # cut off when the file is opened again, as after a crash
            raise write_failed(self.path, exc, f"every whole batch before it is kept "
                               f"({len(self.prompts)} prompts in this file), the one being "
                               "written is not") from exc
        for x in lines:
            self.prompts[int(x["index"])] = x
        # held as it reads back (times rounded as written), so a table made now and one made
        # again from the file are the same to the last digit
        self.batches.append(Batch.from_record(record))


def _append_text(path: Path, text: str) -> None:
    """``text`` appended in one write, on disk when this returns."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


FULL = (errno.ENOSPC, errno.EDQUOT)


def write_failed(path: Path, exc: OSError, kept: str) -> EvalInputError:
    """The one line of a write that failed: the disk full (or another OSError), what was kept,
    and that the same command continues once it can write."""
    why = exc.strerror or str(exc)
    if exc.errno in FULL:
        return EvalInputError(f"the disk is full: cannot write {path} ({why}); {kept}",
                              hint="free space on that disk and run the same command again: it "
                                   "continues where it stopped")
    return EvalInputError(f"cannot write {path} ({why}); {kept}",
                          hint="make the --out folder writable and run the same command again: "
                               "it continues where it stopped")


def _differences(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def _holds_results(path: Path) -> bool:
    """Whether the file holds a whole batch after its header: one that holds none (a run that
    stopped before its first batch was measured) loses nothing when it is started again."""
    with open(path, "rb") as fh:
        fh.readline()
        for raw_line in fh:
            try:
                if json.loads(raw_line).get("kind") == "batch":
                    return True
            except (ValueError, AttributeError):
                continue  # a torn line: cut off when the file is opened
    return False


def check_header(path: Path, settings: dict) -> None:
    """Refuse (EvalInputError) a results file at ``path`` written under other settings, unless
    no prompt's results are in it yet (it is started again); nothing is written (every file is
    checked before any is started)."""
    settings = json.loads(json.dumps(settings))
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb") as fh:
        first = fh.readline()
    try:
        header = json.loads(first)
        assert header.get("kind") == "header"
    except (ValueError, AssertionError, AttributeError) as exc:
        raise EvalInputError(f"{path} is not a results file of this evaluation (no header)",
                             hint="pass another --out, or move the file away") from exc
    if (header.get("format") != FORMAT or header.get("settings") != settings) \
            and _holds_results(path):
        diff = _differences(header.get("settings") or {}, settings)
        raise EvalInputError(f"{path} holds results of other settings ("
                             + "; ".join(diff[:3]) + ("; ..." if len(diff) > 3 else "") + ")",
                             hint="pass another --out for these settings, or delete the file "
                                  "to measure it again")


def open_results(path: Path, settings: dict, about: dict | None = None) -> ResultsFile:
    """The results file at ``path``: continued when it exists with the same settings (a torn
    last batch cut off), else started with a header (``about``: what is said, not compared,
    such as where the files were), as is one that holds no batch yet. Raises EvalInputError
    when it holds results of other settings."""
    settings = json.loads(json.dumps(settings))  # as it reads back (tuples as lists)
    fresh = not path.is_file() or path.stat().st_size == 0
    if not fresh:
        check_header(path, settings)  # not ours, or other settings' results: refused
        fresh = not _holds_results(path)
    if fresh:
        header = {"kind": "header", "format": FORMAT, "settings": settings,
                  "about": about or {}}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(strict_json.dumps(header) + "\n", encoding="utf-8")
            os.replace(tmp, path)
        except OSError as exc:
            raise write_failed(path, exc, "nothing of it was written") from exc
        finally:
            tmp.unlink(missing_ok=True)
        return ResultsFile(path, settings)
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    res = ResultsFile(path, settings)
    pending: list[dict] = []
    good = len(lines[0]) + 1  # bytes up to the end of the last complete batch
    at = good
    for raw_line in lines[1:]:
        at += len(raw_line) + 1
        if not raw_line.strip():
            continue
        try:
            x = json.loads(raw_line)
        except ValueError:
            break  # a torn line: the batch it belongs to is decoded again
        if x.get("kind") == "prompt":
            pending.append(x)
        elif x.get("kind") == "batch":
            if sorted(int(p["index"]) for p in pending) != sorted(x["prompts"]):
                break
            for p in pending:
                res.prompts[int(p["index"])] = p
            res.batches.append(Batch.from_record(x))
            pending = []
            good = min(at, len(raw))
    if good < len(raw):
        try:
            with open(path, "r+b") as fh:  # the torn batch goes; its prompts are decoded again
                fh.truncate(good)
        except OSError as exc:
            raise write_failed(path, exc, "its whole batches are kept") from exc
    return res


def write_json(path: Path, obj, kept: str = "") -> None:
    """``obj`` as JSON at ``path``, replaced whole (never half-written); ``kept``: what a failed
    write leaves, for its line."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(strict_json.dumps(obj, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise write_failed(path, exc, kept or "it was left as it was") from exc
    finally:
        tmp.unlink(missing_ok=True)


# results.json says who wrote it: a file of that name the user wrote is never replaced
WRITTEN_BY = "dflash-tui eval"


def is_ours(path: Path) -> bool:
    """Whether the results.json at ``path`` is one an evaluation wrote (marked ``written_by``;
    one written before the mark, by its four sections)."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and (d.get("written_by") == WRITTEN_BY
                                    or set(d) == {"settings", "target", "drafters", "sets"})


def check_out(out: Path, summary: str, files: list[Path]) -> None:
    """Refuse (EvalInputError) an --out folder the results cannot go to, before anything is
    written: below a file, a file itself, a ``summary`` (results.json) or set folder or results
    file that is something else, or no right to write there."""
    hint = "pass --out a new folder, or one an earlier dflash-tui eval wrote"
    for p in [out, *out.parents][::-1]:
        if p.exists() and not p.is_dir():
            raise EvalInputError(f"--out {out}: {p} is a file, not a folder", hint=hint)
    res = out / summary
    if res.is_dir() or (res.exists() and not res.is_file()):
        raise EvalInputError(f"--out {out}: {res} is not a file: the summary goes there",
                             hint=hint)
    if res.is_file() and not is_ours(res):
        raise EvalInputError(f"--out {out} holds a {summary} that dflash-tui eval did not write: "
                             "it would be replaced", hint="pass another --out, or move that "
                                                          "file away")
    for f in files:
        if f.parent.exists() and not f.parent.is_dir():
            raise EvalInputError(f"--out {out}: {f.parent} is a file, not a folder: a prompt "
                                 "set's results go there", hint=hint)
        if f.exists() and not f.is_file():
            raise EvalInputError(f"--out {out}: {f} is not a file: results go there", hint=hint)
    near = next(p for p in [out, *out.parents] if p.exists())
    if not os.access(near, os.W_OK | os.X_OK):
        raise EvalInputError(f"--out {out}: cannot write in {near} (permission denied)",
                             hint="pass --out a folder you can write in")
