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
import os
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
    "not_utf8": "the line is not UTF-8 text",
    "not_json": "the line is not a JSON object",
    "no_turns": "no 'messages' or 'conversations' list",
    "bad_turn": "a turn is not an object with a role and text content",
    "missing_role": "a turn has no role",
    "unknown_role": "a turn's role is none of system/user/assistant/tool (or their aliases)",
    "empty_assistant": "an assistant turn has no text",
    "no_assistant": "no assistant turn: nothing to train",
    "template_error": "the chat template failed to render the conversation",
    "prefix_mismatch": "the template writes the conversation before an assistant turn one way "
                       "with the generation prompt and another once the turn is written",
    "too_long": "longer than --max-length tokens, with no answer in the first --max-length",
    "too_long_chars": "more characters than --max-length tokens can hold (not tokenized)",
    "render_error": "the tokenizer failed on the row's text",
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


def _check_text(text: str, k: int) -> None:
    """JSON can spell a lone surrogate (``"\\ud800"``), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RowError("bad_turn", f"turn {k}: the text holds a lone surrogate "
                       f"({text[exc.start]!r} at character {exc.start})") from None


def text_chars(conv: Conversation) -> int:
    """Characters of a conversation's text (answers, reasoning, prompts): what bounds its
    tokens from below, before tokenizing it."""
    return sum(len(m["content"]) + len(m.get("reasoning_content") or "")
               for m in conv.messages)


def normalise(row: Any, index: int) -> Conversation:
    """One source row -> Conversation, or RowError naming what is wrong."""
    if isinstance(row, _Unreadable):
        raise RowError(row.reason, row.detail)
    if not isinstance(row, dict):
        raise RowError("not_json", f"a JSON {_json_kind(row)}, not an object")
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
        _check_text(content, k)
        msg: dict = {"role": role, "content": content}
        if role == "assistant":
            reasoning = t.get("reasoning_content", t.get("reasoning"))
            answer, inline = split_thinking(content)
            if inline is not None:
                msg["content"], reasoning = answer, inline if reasoning is None else reasoning
            if reasoning:
                msg["reasoning_content"] = str(reasoning)
                _check_text(msg["reasoning_content"], k)
            ids = t.get("token_ids")  # the server's own ids for this answer (regenerate)
            if isinstance(ids, list) and ids and all(isinstance(x, int) for x in ids):
                msg["token_ids"] = ids
            calls = t.get("tool_calls")
            if calls:  # the target wrote them: the template renders them into the answer
                if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                    raise RowError("bad_turn", f"turn {k}: tool_calls is not a list of objects")
                msg["tool_calls"] = calls
            if (not msg["content"].strip() and not msg.get("reasoning_content")
                    and not msg.get("tool_calls")):
                raise RowError("empty_assistant", f"turn {k}")
        elif role == "tool":
            # Which call a result answers: templates render it (Qwen3's, Llama's).
            for name in ("tool_call_id", "name"):
                if isinstance(t.get(name), str) and t[name]:
                    msg[name] = t[name]
        messages.append(msg)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("no_assistant")
    rid = row.get("id")
    extra = {k: v for k, v in row.items() if k not in ("messages", "conversations", "id")}
    return Conversation(str(rid) if rid not in (None, "") else f"row-{index}", messages, extra)


# ------------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------------

_SOURCE_HINT = "pass a .jsonl file, a .parquet file or folder, or a datasets save_to_disk folder"


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"unreadable {what} ({exc})", file=path,
                        hint="the datasets folder is damaged: save it again, or pass its "
                             ".arrow files") from exc


def source_files(path: str | Path) -> tuple[str, list[Path]]:
    """(format, files) of a conversations source: ``jsonl``, ``arrow`` or ``parquet``."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError("conversations source does not exist", file=path, hint=_SOURCE_HINT)
    if path.is_file():
        if path.suffix in (".jsonl", ".json"):
            return "jsonl", [path]
        if path.suffix == ".parquet":
            return "parquet", [path]
        if path.suffix == ".arrow":
            return "arrow", [path]
        raise DataError(f"unknown file type {path.suffix!r}", file=path,
                        hint="conversations come as .jsonl, .parquet or .arrow")
    if not os.access(path, os.R_OK | os.X_OK):
        raise DataError("cannot read this folder (permission denied)", file=path,
                        hint="pass a folder you can read")
    if (path / "dflash_data.json").exists():
        raise DataError("this is a prepared data folder (tokenized shards), not conversations",
                        file=path, hint="pass the conversations it was made from (the manifest's "
                                        "source), or train on this folder as it is")
    state = path / "state.json"
    dd = path / "dataset_dict.json"
    if dd.exists():
        splits = _read_json(dd, "dataset_dict.json")
        splits = splits.get("splits", []) if isinstance(splits, dict) else []
        if not splits or ("train" not in splits and len(splits) != 1):
            raise DataError(f"holds the splits {splits} and none is 'train'", file=path,
                            hint="pass one split's folder")
        return source_files(path / ("train" if "train" in splits else str(splits[0])))
    if state.exists():
        try:
            names = [str(d["filename"]) for d in _read_json(state, "state.json")["_data_files"]]
        except (KeyError, TypeError) as exc:
            raise DataError(f"state.json does not list its data files ({exc!r})", file=state,
                            hint="the datasets folder is damaged: save it again, or pass its "
                                 ".arrow files") from exc
        missing = [n for n in names if not (path / n).is_file()]
        if missing or not names:
            raise DataError(f"state.json lists data files that are not there ({missing[:3]})"
                            if names else "state.json lists no data files", file=path,
                            hint="the datasets folder is incomplete: copy it again")
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
        try:
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        except OSError as exc:
            raise DataError(f"cannot read the source ({exc.strerror})", file=f,
                            hint="pass a file you can read") from exc
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
        raise DataError(f"not a readable Arrow file ({exc})", file=path,
                        hint="the file is damaged or not Arrow: save the data set again") from exc


@dataclass
class _Unreadable:
    """A JSONL line that is not a row; ``normalise`` turns it into its RowError."""
    reason: str
    detail: str


def _json_kind(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def _json_lines(f: Path) -> Iterator[Any]:
    """Rows of a JSONL file, or a ``.json`` file holding one JSON array. Read as bytes, so a
    line that is not UTF-8 is one row counted (``not_utf8``), not the end of the file."""
    with open(f, "rb") as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        fh.seek(0)
        if f.suffix == ".json" and head.startswith(b"["):
            try:
                rows = json.loads(fh.read().decode("utf-8-sig"))
            except ValueError as exc:
                raise DataError(f"neither JSON lines nor one JSON array ({exc})", file=f,
                                hint="write one conversation per line (.jsonl)") from exc
            yield from rows
            return
        for n, line in enumerate(fh, 1):
            if n == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark (Windows tools)
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield _Unreadable("not_utf8", f"line {n}: byte {line[exc.start]:#04x} at "
                                              f"column {exc.start + 1}")
                continue
            try:
                yield json.loads(text)
            except ValueError as exc:
                yield _Unreadable("not_json", f"line {n}: {exc}")


def _raw_rows(fmt: str, files: list[Path]) -> Iterator[Any]:
    for f in files:
        try:
            if fmt == "jsonl":
                yield from _json_lines(f)
            elif fmt == "parquet":
                try:
                    pf = pq.ParquetFile(str(f))
                    for b in pf.iter_batches(batch_size=1024):
                        yield from b.to_pylist()
                except pa.ArrowException as exc:
                    raise DataError(f"not a readable Parquet file ({exc})", file=f,
                                    hint="the file is damaged or not Parquet: write it "
                                         "again") from exc
            else:
                for b in _arrow_batches(f):
                    yield from b.to_pylist()
        except OSError as exc:
            raise DataError(f"cannot read the source ({exc.strerror or exc})", file=f,
                            hint="pass a file you can read") from exc


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
