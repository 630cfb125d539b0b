"""Prompts rendered as the target is served: its own chat template, the generation prompt, and
the template's thinking switch.

The switch is the template's ``enable_thinking`` variable (Qwen3's and its kin's): ``on`` and
``off`` pass it, leaving it out keeps the template's default. Acceptance depends on it as much as
on the drafter (a drafter measured with thinking left on can score less than half its tau with
it off), so a template that has no such switch is refused when one is asked for, rather than
rendered as if it had been switched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_core.eval.errors import EvalInputError
from dflash_core.eval.prompt_sets import PromptSet

SWITCH = "enable_thinking"
THINKING = ("on", "off")


def tokenizer_spec(target_folder: Path, tokenizer: str | None) -> str:
    """What to load the tokenizer from: ``tokenizer`` when given, the demo's built-in byte
    tokenizer for a demo target built before its folder held one (recipe tiny-v1), else the
    target's folder (the demo's now saves the same tokenizer there)."""
    if tokenizer:
        return tokenizer
    from dflash_core.demo import META_NAME

    if (target_folder / META_NAME).is_file() and not (target_folder / "tokenizer.json").is_file():
        return "builtin:tiny"
    return str(target_folder)


def load_chat_tokenizer(spec: str, chat_template: str | None = None,
                        trust_remote_code: bool = False):
    """The tokenizer with its chat template (data.chat_render's loader); its errors as one line."""
    from dflash_core.data.chat_render import load_tokenizer
    from dflash_core.data.shards import DataError

    try:
        return load_tokenizer(spec, chat_template, trust_remote_code)
    except DataError as exc:
        raise EvalInputError(str(exc), hint=getattr(exc, "hint", "") or
                             "pass --tokenizer the target's model folder") from exc


def has_switch(tokenizer) -> bool:
    return SWITCH in (getattr(tokenizer, "chat_template", None) or "")


def template_kwargs(tokenizer, thinking: str | None, where: str = "the chat template",
                    option: str = "--thinking") -> dict:
    """The template's variables for ``--thinking`` (``option``: what the message calls the
    switch asked for; "" for a run's prompt set, whose error names its config key); refuses a
    switch the template lacks."""
    if thinking is None:
        return {}
    asked = f"{option} {thinking}" if option else thinking
    if thinking not in THINKING:
        raise EvalInputError(f"{option} {thinking!r}: use on or off")
    if not has_switch(tokenizer):
        raise EvalInputError(
            f"{asked}: {where} has no thinking switch (no {SWITCH} variable)",
            hint="leave --thinking out (the template renders as it always does), or pass "
                 "--chat-template FILE with a template that reads enable_thinking")
    return {SWITCH: thinking == "on"}


@dataclass(frozen=True)
class RenderedSet:
    name: str
    ids: tuple[tuple[int, ...], ...]  # per prompt, the token ids the target continues


def render_set(tokenizer, pset: PromptSet, kwargs: dict) -> RenderedSet:
    """Each prompt's first turn (a long set's: up to the last user message, then the start of
    its answer) with the generation prompt, tokenized as a server does (the template writes the
    special tokens itself)."""
    out = []
    for p in pset.prompts:
        try:
            text = tokenizer.apply_chat_template(list(p.messages), tokenize=False,
                                                 add_generation_prompt=True, **kwargs)
            text += p.answer_start  # the target goes on writing that answer
        except Exception as exc:  # jinja's raise_exception and its kin: the template refuses
            raise EvalInputError(f"prompt set {pset.name}, prompt {p.id}: the chat template "
                                 f"fails to render it ({type(exc).__name__}: {exc})",
                                 hint="fix the prompt's messages, or pass --chat-template"
                                 ) from exc
        ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise EvalInputError(f"prompt set {pset.name}, prompt {p.id}: renders to no tokens",
                                 hint="give it some text")
        out.append(ids)
    return RenderedSet(pset.name, tuple(out))


def longest_past(pset: PromptSet, rendered: RenderedSet, new_tokens: int,
                 positions: int | None) -> str:
    """'' when every prompt of the set with ``new_tokens`` fits the target's ``positions``; else
    the line naming the longest prompt that does not."""
    ids = rendered.ids
    if not positions or not ids:
        return ""
    j = max(range(len(ids)), key=lambda i: len(ids[i]))
    if len(ids[j]) + new_tokens <= positions:
        return ""
    return (f"prompt set {pset.name}, prompt {pset.prompts[j].id}: {len(ids[j])} tokens and "
            f"{new_tokens} new ones pass the target's {positions} positions")


def generation_config(folder: Path):
    """The target folder's generation_config.json (its end-of-turn ids), None when it has none."""
    try:
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError):
        return None  # the folder has none: the tokenizer's and config's end ids stand


def stop_ids(tokenizer, hf_config, generation_config=None) -> frozenset[int]:
    """Where the target stops: the tokenizer's end of sequence and the model's own end ids
    (generation_config's, which names a chat model's end-of-turn token)."""
    found: set[int] = set()
    for source in (getattr(tokenizer, "eos_token_id", None),
                   getattr(generation_config, "eos_token_id", None),
                   getattr(hf_config, "eos_token_id", None)):
        if source is None:
            continue
        found.update(int(i) for i in (source if isinstance(source, (list, tuple)) else [source]))
    return frozenset(found)
