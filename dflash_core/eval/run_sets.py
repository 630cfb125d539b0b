"""The run's own evaluation on named prompt sets (eval.prompt_sets), so the tau curve a run shows is
the one ``dflash-tui eval`` measures.

At preflight, before any weight loads, each set is read and rendered with the eval verb's own
loaders (prompt_sets.py, rendering.py: the target's tokenizer and chat template, the thinking
switch, the first turn, the target's end-of-turn ids); each problem is a ConfigError naming the
item's key. At each evaluation the prompts are decoded by the eval verb's own code
(``spec_decode.decode_rows``: eval.set_batch prompts together, the evaluation's attention,
eval.cache), stopping at the target's end of turn, and one EvalResult per set is published.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from dflash_core.eval.errors import EvalInputError
from dflash_core.eval.prompt_sets import load_prompt_set
from dflash_core.eval.rendering import (
    generation_config, load_chat_tokenizer, longest_past, render_set, stop_ids, template_kwargs,
    tokenizer_spec,
)
from dflash_core.config import ConfigError, EvalConfig
from dflash_core.config.eval_sets import item_key
from dflash_core.context_buckets import Buckets, buckets_of, by_context
from dflash_core.observe.events import EvalResult


@dataclass(frozen=True)
class RunSet:
    """One set as the run decodes it."""

    name: str
    prompt_ids: tuple[tuple[int, ...], ...]  # each prompt rendered, the generation prompt added
    max_new_tokens: int
    stop_ids: frozenset[int]  # the target's end of sequence / end of turn


def prepare_sets(cfg: EvalConfig, target_path: Path, target_name: str,
                 trust_remote_code: bool = False) -> list[RunSet]:
    """Every set of ``cfg.prompt_sets`` read and rendered; ``target_name``: the target as the
    config names it (target.path), for messages."""
    if not cfg.prompt_sets:
        return []
    from dflash_core.models.target.shape import text_config
    from dflash_core.models.target.config import TargetLoadError, load_target_config

    try:
        tokenizer = load_chat_tokenizer(tokenizer_spec(Path(target_path), None),
                                        trust_remote_code=trust_remote_code)
    except EvalInputError as exc:
        raise ConfigError("eval.prompt_sets", str(exc), hint=(
            "a set is rendered with the target's own tokenizer and chat template: the target "
            "folder needs them (tokenizer.json, a chat template), or leave eval.prompt_sets "
            "empty")) from exc
    try:
        hf_config = load_target_config(Path(target_path), trust_remote_code)
    except TargetLoadError as exc:
        raise ConfigError("target.path", str(exc), hint=exc.hint) from exc
    positions = getattr(text_config(hf_config), "max_position_embeddings", None)
    stops = stop_ids(tokenizer, hf_config, generation_config(Path(target_path)))
    out = []
    for i, s in enumerate(cfg.prompt_sets):
        try:
            pset = load_prompt_set(s.name, s.path, s.prompts, long=s.long)
        except EvalInputError as exc:
            missing = not Path(s.path).is_file()
            raise ConfigError(item_key(i, "path"), str(exc), hint=(
                f"point {item_key(i, 'path')} at an existing JSONL file (a relative path is "
                "read from the folder the run starts in)" if missing else exc.hint)) from exc
        thinking = None if s.thinking == "template" else s.thinking
        try:
            kwargs = template_kwargs(tokenizer, thinking,
                                     f"the chat template of {target_name}", option="")
        except EvalInputError as exc:
            raise ConfigError(item_key(i, "thinking"), str(exc), hint=(
                f"set {item_key(i, 'thinking')}: template (the template renders as it always "
                "does), or give the target a chat template that reads enable_thinking")
            ) from exc
        try:
            rendered = render_set(tokenizer, pset, kwargs)
        except EvalInputError as exc:
            raise ConfigError(item_key(i, "path"), str(exc), hint=exc.hint) from exc
        new_tokens = s.max_new_tokens or cfg.max_new_tokens
        past = longest_past(pset, rendered, new_tokens, positions)
        if past:
            raise ConfigError(item_key(i, "max_new_tokens"), past, hint=(
                f"lower {item_key(i, 'max_new_tokens')} (0: eval.max_new_tokens), or leave the "
                "longest prompts out of the file"))
        out.append(RunSet(s.name, rendered.ids, new_tokens, stops))
    return out


def evaluate_set(s: RunSet, step: int, target, drafter, layer_ids: list[int], *,
                 batch: int, cache: bool = False, exact_head: bool = True,
                 buckets: Buckets | None = None) -> EvalResult:
    """Exact greedy tau of ``drafter`` on the set's prompts (the caller holds the evaluation's
    attention), decoded as ``dflash-tui eval`` decodes them (spec_decode.decode_rows): ``batch``
    prompts together, the target's cache with ``cache``, stopping at the target's end of turn.
    ``exact_head``: target_decoding.head_is_lm_head's answer for this target; ``buckets``: the
    context-length buckets acceptance is also counted in (None: the target's window's)."""
    from dflash_core.acceptance import histogram, pooled_tau, serving_fields
    from dflash_core.eval.drafting import drafts_per_round
    from dflash_core.eval.spec_decode import DecodeSettings, decode_rows
    from dflash_core.eval.target_decoding import rows_backend
    from dflash_core.models.dspark.calibration import calibrate

    t0 = time.monotonic()
    prompts = [list(p) for p in s.prompt_ids]
    settings = DecodeSettings(s.max_new_tokens, 0.0, s.stop_ids)
    rows = []
    for i in range(0, len(prompts), batch):
        backend = rows_backend(target, layer_ids, cache, exact_head)
        rows += decode_rows(backend, drafter, prompts[i:i + batch], settings)
    hist = [0] * (drafts_per_round(drafter, drafter.block_size) + 1)
    confidences, accepted = [], []
    for r in rows:
        for a in r.acceptance:
            hist[a] += 1
        if r.confidences:
            confidences += r.confidences
            accepted += r.acceptance
    cal = calibrate(confidences, accepted) if confidences else None
    proposed = histogram([p for r in rows for p in r.proposed], len(hist))
    buckets = buckets or buckets_of(target)
    return EvalResult(step=step, tau=pooled_tau(hist), acceptance=hist, prompts=len(prompts),
                      **serving_fields(hist, proposed),
                      seconds=time.monotonic() - t0,
                      calibration=cal.as_dict() if cal is not None else {}, prompt_set=s.name,
                      context=by_context(buckets, ((r.positions, r.acceptance) for r in rows)))
