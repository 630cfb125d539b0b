"""Named prompt sets: a JSONL file per benchmark (GSM8K, MT-Bench, ...) that a user brings.

One JSON object a line, blank lines skipped, in one of three shapes:

- ``{"messages": [{"role": "user", "content": "..."}, ...]}``: OpenAI chat messages. The first
  turn is evaluated: the messages up to and including the first user message (a system message
  before it is kept); later turns, and an assistant answer the file may carry, are not used.
- ``{"prompt": "..."}``: one user message.
- ``{"turns": ["...", ...]}``: user turns as the public DFlash benchmark caches them; the first.

An ``id`` field names the prompt in messages (else its line number). Rendering with the target's
chat template is rendering.py's.

A long set (``long``: eval.prompt_sets[].long, eval's --long-prompts) takes a "messages" row whole,
to decode deep into a long context: every message up to and including the LAST user message (a
long chat), and when an assistant answer follows it, the first half of that answer (cut back to
a space) continues the generation prompt, so the target goes on writing it (the first part of a
long answer as the prompt). "prompt" and "turns" rows read as in any set (a document is a long
"prompt").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dflash_core.eval.errors import EvalInputError

SHAPES = "a JSON object a line with \"messages\" (OpenAI chat), \"prompt\" (text) or \"turns\""


@dataclass(frozen=True)
class Prompt:
    index: int  # 0-based, among the file's prompts
    id: str  # the row's "id", else "line N"
    messages: tuple  # of {"role", "content"} dicts: the first turn (a long set: up to the last)
    # a long set: the first part of the answer after the last user message, which the rendered
    # prompt ends with ("" when the row has none)
    answer_start: str = ""


@dataclass(frozen=True)
class PromptSet:
    name: str
    path: Path
    sha256: str  # of the file's bytes: a results file is continued only on the same prompts
    prompts: tuple[Prompt, ...]
    long: bool = False  # read as a long set (the module says how)


def parse_spec(spec: str) -> tuple[str, Path]:
    """``NAME=FILE`` (or ``FILE``, named by its stem) -> (name, path)."""
    name, eq, file = spec.partition("=")
    if not eq:
        name, file = Path(spec).stem, spec
    name = name.strip()
    if not name or not file.strip():
        raise EvalInputError(f"--prompts {spec!r}: expected NAME=FILE.jsonl",
                             hint="e.g. --prompts gsm8k=gsm8k.jsonl")
    if any(c in name for c in "/\\") or name.startswith("."):
        raise EvalInputError(f"--prompts {spec!r}: the set name {name!r} names a folder of "
                             "the results: use letters, digits, '-', '_'",
                             hint="e.g. --prompts gsm8k=data/gsm8k.jsonl")
    return name, Path(file).expanduser()


def _first_turn(messages, where: str) -> tuple:
    if not isinstance(messages, list) or not messages:
        raise EvalInputError(f"{where}: \"messages\" must be a non-empty list", hint=SHAPES)
    out = []
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise EvalInputError(f"{where}: a message without a string role and content "
                                 f"({str(m)[:60]})", hint=SHAPES)
        out.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            return tuple(out)
    raise EvalInputError(f"{where}: the messages hold no user turn to answer",
                         hint="each prompt needs a {\"role\": \"user\"} message")


# A long set's answer: this share of its characters starts the prompt, the rest is left to decode.
ANSWER_SHARE = 0.5


def answer_start(text: str) -> str:
    """The first ANSWER_SHARE of an answer, cut back to its last whitespace there (a word cut in
    two tokenizes otherwise than the target writes it); the cut whitespace stays off."""
    half = text[: int(len(text) * ANSWER_SHARE)]
    space = max(half.rfind(" "), half.rfind("\n"))
    return half[:space] if space > 0 else half


def _whole_conversation(messages, where: str) -> tuple[tuple, str]:
    """A long set's row: (every message up to the last user message, the start of the answer
    after it)."""
    _first_turn(messages, where)  # the same checks: a list of role/content messages, a user
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    after = msgs[last + 1] if last + 1 < len(msgs) else None
    start = (answer_start(after["content"]) if after is not None
             and after["role"] == "assistant" else "")
    return tuple(msgs[: last + 1]), start


def _lone_surrogate(value) -> str | None:
    """The first string in ``value`` (nested) that holds a lone surrogate (a "\\ud800" escape
    with no partner: JSON allows it, but it is no character and no tokenizer or file takes it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"\\u{ord(value[exc.start]):04x}"
        return None
    items = (value.values() if isinstance(value, dict)
             else value if isinstance(value, (list, tuple)) else ())
    for v in items:
        bad = _lone_surrogate(v)
        if bad:
            return bad
    return None


def _row_messages(row: dict, where: str, long: bool = False) -> tuple[tuple, str]:
    """(the messages rendered, the answer's start the prompt ends with)."""
    if "messages" in row:
        if long:
            return _whole_conversation(row["messages"], where)
        return _first_turn(row["messages"], where), ""
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise EvalInputError(f"{where}: \"prompt\" must be a non-empty string", hint=SHAPES)
        return ({"role": "user", "content": row["prompt"]},), ""
    if "turns" in row:
        turns = row["turns"]
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str)):
            raise EvalInputError(f"{where}: \"turns\" must be a list of strings", hint=SHAPES)
        return ({"role": "user", "content": turns[0]},), ""
    raise EvalInputError(f"{where}: no \"messages\", \"prompt\" or \"turns\" (keys: "
                         f"{', '.join(sorted(row)) or 'none'})", hint=SHAPES)


def load_prompt_set(name: str, path: str | Path, limit: int = 0, long: bool = False) -> PromptSet:
    """The set's prompts (the first ``limit`` when above 0; ``long``: read as a long set). Raises
    EvalInputError naming the file and line for a file that cannot be read, a line that is not a
    prompt, or no prompts."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise EvalInputError(f"prompt set {name}: cannot read {path} ({exc.strerror or exc})",
                             hint="--prompts NAME=FILE.jsonl with an existing file") from exc
    try:
        text = raw.decode("utf-8-sig")  # a byte order mark before the first line is no text
    except UnicodeDecodeError as exc:
        raise EvalInputError(f"prompt set {name}: {path} is not UTF-8 text", hint=SHAPES) from exc
    prompts: list[Prompt] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise EvalInputError(f"{where}: not JSON ({exc})", hint=SHAPES) from exc
        if not isinstance(row, dict):
            raise EvalInputError(f"{where}: not a JSON object", hint=SHAPES)
        msgs, start = _row_messages(row, where, long)
        pid = row.get("id")
        bad = _lone_surrogate([msgs, start, pid])
        if bad:
            raise EvalInputError(f"{where}: the text holds a lone surrogate ({bad}), half of a "
                                 "UTF-16 pair: not a character, so no tokenizer reads it",
                                 hint="write the character itself, or both halves of its "
                                      "pair (e.g. \\ud83d\\ude00)")
        prompts.append(Prompt(len(prompts), str(pid) if pid is not None else f"line {lineno}",
                              msgs, start))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise EvalInputError(f"prompt set {name}: {path} holds no prompts",
                             hint=f"write {SHAPES}")
    return PromptSet(name, path, hashlib.sha256(raw).hexdigest()[:16], tuple(prompts), long)


def load_sets(prompts: list[str], long_prompts: list[str], limit: int = 0,
              reserved: str = "") -> list[PromptSet]:
    """The sets of --prompts and --long-prompts (NAME=FILE each), loaded. Each name gets a
    folder of its own: two names equal but for case are refused (a case-blind disk would merge
    them), and so is ``reserved`` (a file the results folder already holds)."""
    sets, seen = [], set()
    specs = [(spec, False) for spec in prompts] + [(spec, True) for spec in long_prompts]
    for spec, long in specs:
        name, path = parse_spec(spec)
        if name.casefold() in seen:
            raise EvalInputError(f"--prompts: two sets named {name}" + (
                "" if name in {n for n, _, _ in sets} else " (told apart only by case)"),
                                 hint="give each set its own NAME=FILE")
        if reserved and name.casefold() == reserved:
            raise EvalInputError(f"--prompts {spec!r}: the set name {name} is the summary's "
                                 "file name", hint="name the set otherwise (NAME=FILE)")
        seen.add(name.casefold())
        sets.append((name, path, long))
    return [load_prompt_set(name, path, limit, long) for name, path, long in sets]
