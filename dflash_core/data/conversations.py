"""Reading conversations: JSONL, a ``datasets`` save_to_disk folder, or Parquet -> normalised rows.

A row holds its turns in ``messages`` (OpenAI style: ``{"role", "content"}``) or ``conversations``
(ShareGPT style: ``{"from", "value"}``), and optionally an ``id``. Roles are normalised to
``system``, ``user``, ``assistant`` and ``tool`` (``human`` -> user, ``gpt`` / ``model`` / ``bot``
-> assistant, ...). Reasoning written inline as ``<think>...</think>`` at the start of an assistant
turn, or given as ``reasoning_content`` / ``reasoning``, ends up in the turn's
``reasoning_content``; what the trained sample keeps of it is the chat renderer's policy.

A row that cannot be a conversation is not an exception for the whole file: ``read_rows`` yields it
as a ``Malformed`` with a reason code (``REASONS``), so the caller counts it by reason. Sample ids
are the row's ``id`` when it has one, else its position in the source (``row-<n>``): stable as long
as the source does not change, which is what resuming by id needs.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_core.data.shards import DataError


ROLE_ALIASES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "bot": "assistant",
    "chatgpt": "assistant",
    "tool": "tool", "function": "tool", "ipython": "tool", "observation": "tool",
}

# Why a row is not used; every skipped row is counted under one of these.
REASONS = {
    "not_json": "the line is not a JSON object",
    "no_turns": "no 'messages' or 'conversations' list",
    "bad_turn": "a turn is not an object with a role and text content",
    "missing_role": "a turn has no role",
    "unknown_role": "a turn's role is none of system/user/assistant/tool (or their aliases)",
    "empty_assistant": "an assistant turn has no text",
    "no_assistant": "no assistant turn: nothing to train",
    "template_error": "the chat template failed to render the conversation",
    "prefix_mismatch": "the rendered turns are not token prefixes of one another",
    "too_long": "longer than --max-length tokens",
    "duplicate_id": "the same id as an earlier row",
}

_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


class RowError(ValueError):
    """A row that is not a usable conversation; ``reason`` is a key of REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{REASONS.get(reason, reason)}{': ' + detail if detail else ''}")


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # {"role", "content", optional "reasoning_content"}
    extra: dict = field(default_factory=dict)  # other fields of the row, passed through


@dataclass
class Malformed:
    id: str
    reason: str
    detail: str = ""


def split_thinking(text: str) -> tuple[str, str | None]:
    """(answer, reasoning) of an assistant text that may open with ``<think>...</think>``."""
    m = _THINK.match(text)
    if not m:
        return text, None
    return text[m.end():], m.group(1).strip("\n")


def normalise(row: Any, index: int) -> Conversation:
    """One source row -> Conversation, or RowError naming what is wrong."""
    if not isinstance(row, dict):
        raise RowError("not_json")
    turns = row.get("messages")
    if turns is None:
        turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise RowError("no_turns")
    messages = []
    for k, t in enumerate(turns):
        if not isinstance(t, dict):
            raise RowError("bad_turn", f"turn {k}")
        raw_role = t.get("role", t.get("from"))
        if raw_role is None or raw_role == "":
            raise RowError("missing_role", f"turn {k}")
        role = ROLE_ALIASES.get(str(raw_role).strip().lower())
        if role is None:
            raise RowError("unknown_role", f"turn {k} has role {raw_role!r}")
        content = t.get("content", t.get("value"))
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RowError("bad_turn", f"turn {k}: content is a {type(content).__name__}, "
                           "expected text")
        msg: dict = {"role": role, "content": content}
        if role == "assistant":
            reasoning = t.get("reasoning_content", t.get("reasoning"))
            answer, inline = split_thinking(content)
            if inline is not None:
                msg["content"], reasoning = answer, inline if reasoning is None else reasoning
            if reasoning:
                msg["reasoning_content"] = str(reasoning)
            ids = t.get("token_ids")  # the server's own ids for this answer (regenerate)
            if isinstance(ids, list) and ids and all(isinstance(x, int) for x in ids):
                msg["token_ids"] = ids
            if not msg["content"].strip() and not msg.get("reasoning_content"):
                raise RowError("empty_assistant", f"turn {k}")
        messages.append(msg)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("no_assistant")
    rid = row.get("id")
    extra = {k: v for k, v in row.items() if k not in ("messages", "conversations", "id")}
    return Conversation(str(rid) if rid not in (None, "") else f"row-{index}", messages, extra)


# ------------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------------

def source_files(path: str | Path) -> tuple[str, list[Path]]:
    """(format, files) of a conversations source: ``jsonl``, ``arrow`` or ``parquet``."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError("conversations source does not exist", file=path,
                        hint="pass a .jsonl file, a .parquet file or folder, or a datasets "
                             "save_to_disk folder")
    if path.is_file():
        if path.suffix in (".jsonl", ".json"):
            return "jsonl", [path]
        if path.suffix == ".parquet":
            return "parquet", [path]
        if path.suffix == ".arrow":
            return "arrow", [path]
        raise DataError(f"unknown file type {path.suffix!r}", file=path,
                        hint="conversations come as .jsonl, .parquet or .arrow")
    state = path / "state.json"
    dd = path / "dataset_dict.json"
    if dd.exists():
        splits = json.loads(dd.read_text(encoding="utf-8")).get("splits", [])
        if "train" not in splits and len(splits) != 1:
            raise DataError(f"holds several splits {splits} and none is 'train'", file=path,
                            hint="pass one split folder")
        return source_files(path / ("train" if "train" in splits else splits[0]))
    if state.exists():
        try:
            names = [d["filename"] for d in json.loads(state.read_text("utf-8"))["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"unreadable state.json ({exc})", file=state) from exc
        return "arrow", [path / n for n in names]
    for fmt, ext in (("jsonl", ".jsonl"), ("parquet", ".parquet"), ("arrow", ".arrow")):
        files = sorted(p for p in path.iterdir() if p.suffix == ext and not p.name.startswith("."))
        if files:
            return fmt, files
    raise DataError("no .jsonl, .parquet or .arrow files in this folder", file=path,
                    hint="point at the conversations file or folder")


def source_fingerprint(files: list[Path]) -> str:
    """sha256 of the source's bytes (names them in the manifest and keys resumption)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def _arrow_batches(path: Path) -> Iterator[pa.RecordBatch]:
    try:
        source = pa.memory_map(str(path), "r")
        if source.read(6) == b"ARROW1":
            source.seek(0)
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
        else:
            source.seek(0)
            yield from pa.ipc.open_stream(source)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"not a readable Arrow file ({exc})", file=path) from exc


def _raw_rows(fmt: str, files: list[Path]) -> Iterator[Any]:
    for f in files:
        if fmt == "jsonl":
            with open(f, encoding="utf-8") as fh:
                for line in fh:
                    if not line.strip():
                        continue
                    try:
                        yield json.loads(line)
                    except ValueError:
                        yield None
        elif fmt == "parquet":
            try:
                pf = pq.ParquetFile(str(f))
                for b in pf.iter_batches(batch_size=1024):
                    yield from b.to_pylist()
            except (pa.ArrowException, OSError) as exc:
                raise DataError(f"not a readable Parquet file ({exc})", file=f) from exc
        else:
            for b in _arrow_batches(f):
                yield from b.to_pylist()


def read_rows(path: str | Path) -> Iterator[Conversation | Malformed]:
    """Every row of a source, in order: a Conversation, or a Malformed with its reason."""
    fmt, files = source_files(path)
    seen: set[str] = set()
    for i, raw in enumerate(_raw_rows(fmt, files)):
        try:
            conv = normalise(raw, i)
        except RowError as exc:
            rid = raw.get("id") if isinstance(raw, dict) and raw.get("id") else f"row-{i}"
            yield Malformed(str(rid), exc.reason, str(exc))
            continue
        if conv.id in seen:
            yield Malformed(conv.id, "duplicate_id", f"id {conv.id!r}")
            continue
        seen.add(conv.id)
        yield conv
