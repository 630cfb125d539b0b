"""Conversations -> token ids and a loss mask, with the target's own tokenizer and chat template.

The trained positions are found from the rendering, never by searching for the answer's text: for
each assistant turn the conversation is rendered up to that turn with the generation prompt (``P``)
and up to and including it (``F``); the turn's tokens are ``F[len(P):]`` when ``P`` is a token
prefix of ``F`` and ``F`` one of the whole conversation's tokens. Those spans (the answer and the
template's end-of-turn tokens, which the target also writes) get loss_mask 1, everything else 0.

A tokenizer may merge characters across the boundary (a GPT-2-style byte-level BPE joins the
generation prompt's last newline with an answer's leading spaces): then ``P`` is a prefix of ``F``
as text but not as tokens. The rendering is then cut at the turn boundaries as text, each piece
tokenized apart and the ids joined: the prompt's ids as a server tokenizes it, then the answer's,
as the target writes them after it. Such rows are counted (``joined_rows``).

Some templates render history differently from the turn being written (Qwen3 drops the reasoning
of earlier turns): then ``F`` is not a prefix of the whole, even as text, and the conversation is
split into one sample per assistant turn, each being exactly what the target saw when it wrote
that turn. The split is counted, not hidden; a turn whose prompt is not a prefix of its own
rendering even as text is ``prefix_mismatch``.

Reasoning (``reasoning_content``) follows the ``thinking`` policy: ``keep`` (every turn keeps it),
``last`` (only the last assistant turn keeps it, as a thinking model sees history at inference),
``drop`` (removed everywhere). A template that does not read ``reasoning_content`` gets the
reasoning inline as ``<think>\\n...\\n</think>\\n\\n`` before the answer.

A turn that carries the server's ``token_ids`` (written by ``regenerate``) has its answer tokens
replaced by them when re-tokenizing the text gives other ids: the drafter learns the target's own
tokens. Re-tokenized turns that differ are counted.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_core.data.conversations import Conversation, RowError
from dflash_core.data.shards import DataError

THINKING = ("keep", "last", "drop")
PROBE = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}]


class TemplateError(DataError):
    """The tokenizer has no chat template, or it cannot render even a two-turn conversation."""


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class RenderStats:
    split_rows: int = 0  # conversations split into one sample per assistant turn
    tool_call_turns: int = 0  # assistant turns with tool_calls (rendered and trained)
    tool_turns: int = 0  # tool results (rendered as context, not trained)
    server_ids_turns: int = 0  # turns whose answer came with the server's token ids
    server_ids_differ: int = 0  # ... of which re-tokenizing the text gave other ids
    # conversations whose prompt and answer were tokenized apart and the ids joined: the
    # tokenizer merges characters across the turn boundary
    joined_rows: int = 0
    # samples of split rows left out (too long, nothing trained) while the row's others are kept
    split_samples_dropped: dict = field(default_factory=dict)

    def add(self, other: "RenderStats") -> None:
        self.split_rows += other.split_rows
        self.tool_call_turns += other.tool_call_turns
        self.tool_turns += other.tool_turns
        self.joined_rows += other.joined_rows
        for k, v in other.split_samples_dropped.items():
            self.split_samples_dropped[k] = self.split_samples_dropped.get(k, 0) + v
        self.server_ids_turns += other.server_ids_turns
        self.server_ids_differ += other.server_ids_differ


# Fields of a turn the template reads besides role and content: an assistant's tool calls, and
# the call a tool result answers.
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")


# ------------------------------------------------------------------------------------------------
# Tokenizers and fingerprints
# ------------------------------------------------------------------------------------------------

def load_tokenizer(spec: str | Path, chat_template: str | Path | None = None,
                   trust_remote_code: bool = False):
    """A tokenizer from a model folder (or ``builtin:tiny``, the demo's), with ``chat_template``
    (a jinja file) replacing its own when given. Refuses one without any chat template. A
    tokenizer that exists only as the folder's own Python files (tokenizer_config.json's
    auto_map, as Kimi-K2's) loads only with ``trust_remote_code`` (``--trust-remote-code``)."""
    if str(spec) == "builtin:tiny":
        from dflash_core.data.byte_vocab import byte_tokenizer
        tok = byte_tokenizer()
    else:
        path = Path(spec).expanduser()
        _check_tokenizer_files(path, trust_remote_code)
        try:
            from transformers import AutoTokenizer
            # Never transformers' terminal prompt: trust_remote_code is always said.
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                                trust_remote_code=trust_remote_code)
        except Exception as exc:  # a damaged tokenizer.json raises KeyError, the Rust side its own
            code = None if trust_remote_code else tokenizer_code(path)
            if code is not None:
                raise DataError(f"the tokenizer needs its own code ({code}, in the folder's "
                                "Python files), which runs only when trusted", file=path,
                                hint="pass --trust-remote-code if you trust the files in this "
                                     "folder (they run as Python on this machine)") from exc
            first = (str(exc).splitlines() or [""])[0]
            raise DataError(f"cannot load a tokenizer ({type(exc).__name__}: {first})", file=path,
                            hint="pass --tokenizer a model folder holding tokenizer.json / "
                                 "tokenizer_config.json (the target's own folder), or "
                                 "builtin:tiny") from exc
    if chat_template is not None:
        p = Path(chat_template).expanduser()
        try:
            tok.chat_template = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"cannot read the chat template ({exc})", file=p,
                            hint="pass --chat-template a jinja text file") from exc
    check_template(tok, spec)
    return tok


# A tokenizer's vocabulary lives in one of these; a folder with none of them (a config.json and
# nothing else) loads in transformers as an EMPTY vocabulary that tokenizes every text to nothing.
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
               "sentencepiece.bpe.model", "tiktoken.model", "qwen.tiktoken")


def _check_tokenizer_files(path: Path, trust_remote_code: bool) -> None:
    if not path.is_dir() or (trust_remote_code and tokenizer_code(path) is not None):
        return  # not a folder: transformers' own error says so; remote code keeps its own files
    if any((path / name).is_file() for name in VOCAB_FILES) or any(path.glob("*.tiktoken")):
        return
    raise DataError("the folder holds no tokenizer files (none of " + ", ".join(VOCAB_FILES[:4])
                    + ", ...): transformers would build an empty vocabulary from config.json "
                    "and every sample would tokenize to nothing", file=path,
                    hint="pass --tokenizer the target's own model folder (the one with "
                         "tokenizer.json), or builtin:tiny")


def tokenizer_code(folder: Path) -> str | None:
    """The class a tokenizer folder's auto_map names for AutoTokenizer (its own Python code), or
    None when it names none."""
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        names = cfg["auto_map"]["AutoTokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    names = [n for n in (names if isinstance(names, list) else [names]) if n]
    return ", ".join(map(str, names)) or None


def check_template(tok, name: Any = "") -> None:
    if not getattr(tok, "chat_template", None):
        raise TemplateError(f"the tokenizer {name} has no chat template",
                            hint="pass --chat-template FILE (a jinja chat template, e.g. the one "
                                 "the target is served with)")
    try:
        tok.apply_chat_template(PROBE, tokenize=False)
    except Exception as exc:  # jinja raises many kinds; any of them means the template is unusable
        raise TemplateError(f"the chat template fails to render a two-turn conversation "
                            f"({type(exc).__name__}: {exc})",
                            hint="fix the template, or pass --chat-template FILE") from exc


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def tokenizer_fingerprint(tok) -> str:
    """Hash of what maps text to ids (vocabulary, merges, normalisation, special tokens), not of
    padding or truncation settings, which change no id."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
        return _sha(json.dumps(spec, sort_keys=True))
    return _sha(json.dumps(sorted(tok.get_vocab().items())))


def template_fingerprint(tok) -> str:
    return _sha(tok.chat_template or "")


def fingerprints(tok) -> dict:
    return {"tokenizer": tokenizer_fingerprint(tok), "chat_template": template_fingerprint(tok)}


# ------------------------------------------------------------------------------------------------
# Rendering
# ------------------------------------------------------------------------------------------------

def _is_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) <= len(b) and b[:len(a)] == a


@dataclass
class _Span:
    """An assistant turn of a rendering: from ``start`` (its prompt's end) to ``end``, in tokens
    or in characters; ``hist`` and ``shown``: the turns before it and it, as the template got
    them."""
    i: int
    hist: list[dict]
    shown: dict
    start: int
    end: int


class ChatRenderer:
    """Renders conversations with one tokenizer, template and thinking policy."""

    def __init__(self, tokenizer, thinking: str = "keep"):
        if thinking not in THINKING:
            raise ValueError(f"thinking must be one of {THINKING}, got {thinking!r}")
        self.tok = tokenizer
        self.thinking = thinking
        self.template_reads_reasoning = "reasoning_content" in (tokenizer.chat_template or "")

    # -- text -> ids ------------------------------------------------------------------------
    def text(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except Exception as exc:  # a template's raise_exception, an undefined variable, ...
            raise RowError("template_error", f"{type(exc).__name__}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        # The template writes the special tokens (BOS included) itself.
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def ids(self, messages: list[dict], generation_prompt: bool = False) -> list[int]:
        return self.encode(self.text(messages, generation_prompt))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The ids the target continues to write the next assistant turn."""
        return self.ids(self.template_messages(messages, last_keeps=True), True)

    def closing_ids(self, history: list[dict]) -> list[int]:
        """The template's own end-of-turn tokens after an assistant turn that follows
        ``history`` (as the template gets it): what an empty answer adds after the generation
        prompt, tokenized apart."""
        prompt = self.text(history, True)
        empty = self.text(history + [{"role": "assistant", "content": ""}], False)
        return self.encode(empty[len(prompt):]) if empty.startswith(prompt) else []

    # -- the thinking policy ------------------------------------------------------------------
    def template_messages(self, messages: list[dict], last_keeps: bool = False) -> list[dict]:
        """Messages as the template gets them: reasoning kept or dropped by the policy, inlined
        for a template that does not read it; fields of our own (token_ids) removed."""
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        out = []
        for i, m in enumerate(messages):
            msg = {"role": m["role"], "content": m["content"]}
            msg.update({k: m[k] for k in TOOL_FIELDS if k in m})
            reasoning = m.get("reasoning_content")
            keep = self.thinking == "keep" or (self.thinking == "last" and (i == last
                                                                              or last_keeps))
            if reasoning and keep and m["role"] == "assistant":
                if self.template_reads_reasoning:
                    msg["reasoning_content"] = reasoning
                else:
                    msg["content"] = f"<think>\n{reasoning}\n</think>\n\n{m['content']}"
            out.append(msg)
        return out

    # -- a conversation -> samples -------------------------------------------------------------
    def render(self, conv: Conversation, stats: RenderStats | None = None) -> list[Rendered]:
        """The conversation's samples. ``stats`` gets this row's counts only when it renders:
        a row that raises is counted once, under its reason, by the caller."""
        mine = RenderStats()
        out = self._render(conv, mine)
        mine.tool_call_turns = sum(bool(m.get("tool_calls")) for m in conv.messages)
        mine.tool_turns = sum(m["role"] == "tool" for m in conv.messages)
        if stats is not None:
            stats.add(mine)
        return out

    def _render(self, conv: Conversation, stats: RenderStats) -> list[Rendered]:
        msgs = self.template_messages(conv.messages)
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not turns:
            raise RowError("no_assistant")
        full_text = self.text(msgs, False)
        full = self.encode(full_text)
        by_ids, by_text = [], []
        for i in turns:
            pt, ft = self.text(msgs[:i], True), self.text(msgs[:i + 1], False)
            p, f = self.encode(pt), self.encode(ft)
            by_ids.append(_Span(i, msgs[:i], msgs[i], len(p), len(f))
                          if _is_prefix(p, f) and _is_prefix(f, full) else None)
            by_text.append(_Span(i, msgs[:i], msgs[i], len(pt), len(ft))
                           if ft.startswith(pt) and full_text.startswith(ft) else None)
        if all(by_ids):
            return [self._sample(full.__getitem__, len(full), by_ids, conv, stats)]
        if all(by_text):
            # The text of each turn follows its prompt's, but the tokenizer merges across the
            # boundary (a byte-level BPE joins the prompt's last newline with an answer's
            # leading spaces): each piece tokenized apart and the ids joined, as a server
            # tokenizes the prompt and the target writes the answer after it.
            stats.joined_rows += 1
            return [self._sample(self._piece(full_text), len(full_text), by_text, conv, stats)]
        # The template renders history otherwise than the turn being written: one sample per
        # turn, each rendered as the target saw it (the policy applied as if it were the last).
        stats.split_rows += 1
        out = []
        for i in turns:
            sub = self.template_messages(conv.messages[:i + 1])
            pt, ft = self.text(sub[:i], True), self.text(sub, False)
            p, f = self.encode(pt), self.encode(ft)
            if _is_prefix(p, f):
                out.append(self._sample(f.__getitem__, len(f),
                                        [_Span(i, sub[:i], sub[i], len(p), len(f))],
                                        conv, stats))
            elif ft.startswith(pt):
                stats.joined_rows += stats.joined_rows == 0  # the row, once
                out.append(self._sample(self._piece(ft), len(ft),
                                        [_Span(i, sub[:i], sub[i], len(pt), len(ft))],
                                        conv, stats))
            else:
                raise RowError("prefix_mismatch", f"turn {i} (its prompt's text is not the "
                               "start of the turn's text)")
        return out

    def _piece(self, text: str):
        """Ids of ``text[a:b]``, tokenized apart from its neighbours."""
        return lambda cut: self.encode(text[cut]) if cut.start != cut.stop else []

    def _sample(self, piece, length: int, spans: list, conv: Conversation,
                stats: RenderStats) -> Rendered:
        """The sample from its pieces: ``piece(slice)`` gives the ids of a stretch of the
        rendering (in tokens, or in characters tokenized apart); ``spans`` are the turns."""
        ids: list[int] = []
        mask: list[int] = []
        at = 0
        for s in spans:
            head = list(piece(slice(at, s.start)))
            ids += head
            mask += [0] * len(head)
            msg = conv.messages[s.i]
            span = list(piece(slice(s.start, s.end)))
            # The server's ids hold the reasoning it wrote: usable only where the policy kept it.
            dropped = msg.get("reasoning_content") and not (
                "reasoning_content" in s.shown or s.shown["content"] != msg["content"])
            if not dropped:
                span = self._server_span(msg, span, s.hist, stats)
            ids += span
            mask += [1] * len(span)
            at = s.end
        tail = list(piece(slice(at, length)))
        ids += tail
        mask += [0] * len(tail)
        return Rendered(ids, mask)

    def _server_span(self, msg: dict, span: list[int], history: list[dict],
                     stats: RenderStats) -> list[int]:
        """The turn's tokens: as rendered, or with the answer the server gave as ids.
        ``history``: the turns before it, as the template got them."""
        server = msg.get("token_ids")
        if not server:
            return span
        stats.server_ids_turns += 1
        # The template's own end-of-turn tokens: what the turn shares at its end with the same
        # turn rendered with an empty answer (tokenized apart from the prompt, as the span is).
        tail = self.closing_ids(history)
        n = 0
        while n < min(len(tail), len(span)) and tail[-1 - n] == span[-1 - n]:
            n += 1
        closing = span[len(span) - n:]
        server = list(server)
        while closing and server and server[-1] == closing[0]:
            server.pop()  # the stop token the server returns is the template's end of turn
        new = server + closing
        if new != span:
            stats.server_ids_differ += 1
        return new
