"""The ``eval`` section of the run configuration: the run's exact-tau evaluation, its alarms and
its named prompt sets (the rest of the sections: schema.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash_core.config.keys import key


@dataclass
class PromptSetConfig:
    """One named prompt set of the run's evaluation (an item of eval.prompt_sets): a JSONL file of
    prompts as `dflash-tui eval --prompts` reads it (docs/eval.md, "Prompt sets")."""
    name: str = key("", """The set's name: in the log, on the dashboard, in the report and in
        W&B (eval/<name>/tau); letters, digits, '.', '-', '_'.""")
    path: str = key("", """The JSONL file (one object a line: OpenAI "messages", "prompt" or
        "turns"; the first turn is evaluated), relative to the working directory.""")
    thinking: Literal["template", "on", "off"] = key("template", """The chat template's
        enable_thinking switch: "template" leaves it to the template's default; "on" / "off"
        set it (a template without the switch is refused at preflight), as eval's --thinking.""")
    prompts: int = key(16, """The file's first this many prompts are decoded (0 = all): the
        evaluation's cost grows with it.""", ge=0)
    max_new_tokens: int = key(0, """New tokens per prompt at most (a prompt also stops at the
        target's end of turn); 0 = eval.max_new_tokens.""", ge=0)
    long: bool = key(False, """A long-prompt set, to measure tau deep into the context (the
        rounds' tau by context length: docs/eval.md, "Tau by context length"): a "messages" row
        is taken whole, every message up to its last user message (a long chat), and when an
        assistant answer follows, the answer's first half (cut back to a space) starts the
        response, so decoding goes on from inside it (the first part of a long answer as the
        prompt); "prompt" and "turns" rows read as in any set (a document is a long "prompt").
        A prompt that with its new tokens passes the target's positions is refused at
        preflight. eval.best_set may name it, so checkpoints/best follows the long set.""")


@dataclass
class EvalConfig:
    """The exact-tau evaluation and its alarms (what each tau is and what each gap means:
    dflash_core/acceptance.py)."""
    every: int = key(0, "Steps between evaluations; 0 = only at the end.", ge=0)
    max_new_tokens: int = key(64, "Tokens decoded per held-out prompt.", gt=0)
    prompt_tokens: int = key(64, "Prompt length cut from each held-out sample.", gt=0)
    cache: bool = key(False, """true: exact tau's decoding keeps the target's cache between
        rounds, so a round runs only the block (attention's keys and values cut back after a
        rejection; recurrent layers, e.g. Gated DeltaNet, restored from a copy and fed the
        accepted tokens again). The tokens equal the full forwards' in float32 (tests); bf16 may
        part at a near tie, as any cached server does. false: a forward over the whole sequence
        each round. On one H200 a round with the cache costs about the same at any length (~75 ms
        at the 8B shape, ~340 ms at the 27B hybrid: bound by kernel launches, and the hybrid feeds
        its kept tokens twice), while a full forward grows with it (8B: 79 ms at 1K tokens, 183 at
        4K; 27B: 182 at 1K, 300 at 2K, 515 at 4K). The cache pays past ~1K tokens of prompt +
        output at 8B and ~3K at 27B; with the shipped 512-token prompts and 256 new tokens it
        would cost more (bench/BENCHMARKS.md, "Evaluation cost"), hence false.""")
    tau_gap_warn: float = key(0.15, """The mismatch alarm: warn when the teacher-forced tau on the
        target's own decoding of the held-out prompts, at the anchors decoding used, exceeds the
        exact tau of that decoding by more than this (a leak in training, a position or mask
        error). Both score the same blocks of the same text, so a healthy run's gap is float
        noise: measured on the demo (CPU, 3 seeds, step 50) +0.01 each, while a planted leak
        (blocks see 4 positions past their anchor) gave +0.17 at step 30 and +0.46 at step 60
        (bench/BENCHMARKS.md, "Acceptance gaps"); with the demo's layer ids of issue 46, +0.00
        to +0.02 healthy at step 30 and +0.33 for the leak at step 60. 0.15 is 7x the healthy
        gap; bf16 GPU numerics are yet to be measured.""", gt=0)
    data_gap_warn: float = key(0.5, """A suspicion that the data is not the target's own text,
        raised only when the agreement was not measured (eval.agreement_warn settles it when it
        was): the teacher-forced tau on held-out data and on the target's own text (every
        position) differ by more than this (demo: 0.00 on its own data, 0.21-0.24 with corpus
        text as responses: real data, with full prompts and sampled responses, differs more,
        hence 0.5).""", gt=0)
    agreement_warn: float = key(0.8, """Warn when fewer than this share of the trained labels are
        the target's greedy next token (measured once, at the first evaluation: the demo's own
        data 1.00, the demo's prompts with corpus text as responses 0.69; responses sampled from
        the target at a temperature agree less than 1, hence 0.8).""", ge=0, le=1)
    agreement_samples: int = key(8, "Training samples the agreement is measured on; 0 = no "
                                    "agreement measured.", ge=0)
    agreement_positions: int = key(512, "Labels sampled among them.", gt=0)
    overfit_gap: float = key(1.5, """Over-fitting (information): the training tau (mean of the
        last train_tau_steps steps) above the teacher-forced tau on held-out data by more than
        this, once the recent steps include a later epoch (a first-epoch step's tau is taken on
        samples new to the drafter: a held-out measure itself). Eight held-out samples are a
        noisy measure: on the healthy demo the difference ran -1.17 .. +1.71 (3 seeds).""", gt=0)
    train_tau_steps: int = key(50, "Steps averaged into the training tau of eval.overfit_gap.",
                               gt=0)
    prompt_sets: list[PromptSetConfig] = key([], """Named prompt sets decoded at each evaluation
        (and the final one) after the held-out measures, so the tau curve of the run is the one
        `dflash-tui eval` gives a user: each set's prompts rendered with the target's chat
        template and decoded by exact greedy speculative decoding with the eval verb's own code,
        eval.set_batch prompts at a time (eval.cache, the evaluation's attention), stopping at
        the target's end of turn; one
        exact tau and accepted@k per set (no teacher-forced measures, no findings). Each item:
        name, path, thinking (template | on | off), prompts (16; 0 = all), max_new_tokens (0 =
        eval.max_new_tokens), long (false), as eval.prompt_sets[].* below. A missing file, a
        file without prompts, a name given twice and thinking on/off with a template that has no
        switch are refused at preflight. Each set adds about its prompts x new tokens / tau target forwards
        to an evaluation (docs/eval.md, "The run's evaluation on prompt sets"). Example:
        [{name: gsm8k, path: sets/gsm8k.jsonl, thinking: off}].""")
    best_set: str = key("", """What checkpoints/best follows: "" = the exact tau on the held-out
        prompts; a name of eval.prompt_sets = that set's exact tau (a long set's too: the best
        is then the drafter that holds its tau deep in the context).""")
    drafter_dtype: Literal["served", "float32", "bfloat16", "float16"] = key("served", """The
        dtype the drafter decodes in at the run's evaluations (held-out prompts and prompt sets):
        "served" = drafter.dtype, the dtype of checkpoints' model.safetensors and so the one vLLM
        and SGLang run it in; the evaluation decodes a copy of the first replica's weights cast
        to it (made once per evaluation, freed after; its bytes on the drafter's device while it
        runs). "float32" = the training weights themselves (this engine's evaluation before
        2026-12). The teacher-forced measures use the same copy. The target stays in
        target.dtype.""")
    set_batch: int = key(8, """Prompts of a prompt set decoded together (one target forward
        per round for all of them, as `dflash-tui eval --batch`); with eval.cache the target
        runs them one after another, their drafts still in one drafter forward. On one H200 at
        the 8B shape, 8 prompts together decode 2.9x as many prompts per second as one at a
        time for 0.9 GiB more (bench/BENCHMARKS.md). The held-out prompts are decoded one at a
        time (their teacher-forced measures follow each prompt's rounds).""", ge=1)
