"""Conversations -> token ids and a loss mask, with the target's own tokenizer and chat template.

The trained positions are found from token ids, never from the text: for each assistant turn the
conversation is rendered up to that turn with the generation prompt (``P``) and up to and including
it (``F``); the turn's tokens are ``F[len(P):]`` when ``P`` is a token prefix of ``F`` and ``F`` one
of the whole conversation's tokens. Those spans (the answer and the template's end-of-turn tokens,
which the target also writes) get loss_mask 1, everything else 0.

Some templates render history differently from the turn being written (Qwen3 drops the reasoning
of earlier turns): then ``F`` is not a prefix of the whole, and the conversation is split into one
sample per assistant turn, each being exactly what the target saw when it wrote that turn. The
split is counted, not hidden.

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
    server_ids_turns: int = 0  # turns whose answer came with the server's token ids
    server_ids_differ: int = 0  # ... of which re-tokenizing the text gave other ids
    counts: dict = field(default_factory=dict)

    def add(self, other: "RenderStats") -> None:
        self.split_rows += other.split_rows
        self.server_ids_turns += other.server_ids_turns
        self.server_ids_differ += other.server_ids_differ


# ------------------------------------------------------------------------------------------------
# Tokenizers and fingerprints
# ------------------------------------------------------------------------------------------------

def load_tokenizer(spec: str | Path, chat_template: str | Path | None = None):
    """A tokenizer from a model folder (or ``builtin:tiny``, the demo's), with ``chat_template``
    (a jinja file) replacing its own when given. Refuses one without any chat template."""
    if str(spec) == "builtin:tiny":
        from dflash_core.data.byte_vocab import byte_tokenizer
        tok = byte_tokenizer()
    else:
        path = Path(spec).expanduser()
        try:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # a damaged tokenizer.json raises KeyError, the Rust side its own
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

    # -- the thinking policy ------------------------------------------------------------------
    def template_messages(self, messages: list[dict], last_keeps: bool = False) -> list[dict]:
        """Messages as the template gets them: reasoning kept or dropped by the policy, inlined
        for a template that does not read it; fields of our own (token_ids) removed."""
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        out = []
        for i, m in enumerate(messages):
            msg = {"role": m["role"], "content": m["content"]}
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
        stats = stats if stats is not None else RenderStats()
        msgs = self.template_messages(conv.messages)
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not turns:
            raise RowError("no_assistant")
        full = self.ids(msgs)
        spans = []
        for i in turns:
            p, f = self.ids(msgs[:i], True), self.ids(msgs[:i + 1])
            if not _is_prefix(p, f) or not _is_prefix(f, full):
                break
            spans.append((i, p, f, msgs[:i], msgs[i]))
        if len(spans) == len(turns):
            return [self._sample(full, spans, conv, stats)]
        # The template renders history otherwise than the turn being written: one sample per
        # turn, each rendered as the target saw it (the policy applied as if it were the last).
        stats.split_rows += 1
        out = []
        for i in turns:
            sub = self.template_messages(conv.messages[:i + 1])
            p, f = self.ids(sub[:i], True), self.ids(sub)
            if not _is_prefix(p, f):
                raise RowError("prefix_mismatch", f"turn {i}: the generation prompt's tokens are "
                               "not a prefix of the rendered turn's")
            out.append(self._sample(f, [(i, p, f, sub[:i], sub[i])], conv, stats))
        return out

    def _sample(self, full: list[int], spans: list, conv: Conversation,
                stats: RenderStats) -> Rendered:
        ids: list[int] = []
        mask: list[int] = []
        at = 0
        for i, p, f, hist, shown in spans:
            ids += full[at:len(p)]
            mask += [0] * (len(p) - at)
            msg = conv.messages[i]
            # The server's ids hold the reasoning it wrote: usable only where the policy kept it.
            dropped = msg.get("reasoning_content") and not (
                "reasoning_content" in shown or shown["content"] != msg["content"])
            span = (f[len(p):] if dropped
                    else self._server_span(msg, p, f[len(p):], hist, stats))
            ids += span
            mask += [1] * len(span)
            at = len(f)
        ids += full[at:]
        mask += [0] * (len(full) - at)
        return Rendered(ids, mask)

    def _server_span(self, msg: dict, p: list[int], span: list[int], history: list[dict],
                     stats: RenderStats) -> list[int]:
        """The turn's tokens: as rendered, or with the answer the server gave as ids.
        ``history``: the turns before it, as the template got them."""
        server = msg.get("token_ids")
        if not server:
            return span
        stats.server_ids_turns += 1
        # The template's own end-of-turn tokens: what the turn shares at its end with the same
        # turn rendered with an empty answer.
        empty = self.ids(history + [{"role": "assistant", "content": ""}])
        tail = empty[len(p):] if _is_prefix(p, empty) else []
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
