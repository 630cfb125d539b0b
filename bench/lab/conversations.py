"""The drafter's conversations: a file prefix of the corpus's ``chat`` split (files the target never
trained on) as the user turn, the target's own greedy continuation as the answer.

Generated in batches with the target itself (on the GPU in bfloat16, as a server would serve it;
on the CPU in float32): prompts sorted by length, left-padded, decoded greedily by transformers'
``generate`` up to ``answer_tokens`` or the target's ``<|endoftext|>``. Each answer keeps the ids
the target wrote (``token_ids``, as ``dflash-tui data regenerate`` keeps a vLLM server's), so
``data prepare`` trains on exactly those tokens, not on a re-tokenization of their text.

The other way to the same file: serve ``<dir>/target`` with an OpenAI-compatible server and run
``dflash-tui data regenerate <dir>/data/prompts.jsonl --endpoint URL --api completions
--tokenizer <dir>/target --max-tokens N --out ...`` (prompts.jsonl holds the same user turns with
the corpus's own continuation as a placeholder answer).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.lab.prefixes import Tokenized, draw_prefixes


def draw_prompts(tk, docs: list[Tokenized], scale, seed: int) -> list[tuple[Tokenized, str]]:
    rng = np.random.default_rng([seed, 50])
    return draw_prefixes(tk, docs, scale.conversations, scale.prompt_min_tokens,
                         scale.prompt_max_tokens + 1, 8, rng)


@torch.no_grad()
def greedy_batch(model, prompts: list[list[int]], new_tokens: int, eos_id: int,
                 device: str) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (left-padded into one batch), each cut before its
    first ``eos_id``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), eos_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                         max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False,
                         eos_token_id=eos_id, pad_token_id=eos_id)
    answers = []
    for row in out[:, width:].tolist():
        answers.append(row[:row.index(eos_id)] if eos_id in row else row)
    return answers


def generate_conversations(model, tok, pairs: list[tuple[Tokenized, str]], scale, device: str,
                           out_path: Path, log=print) -> dict:
    """Write one conversation a line to ``out_path``; returns the counts."""
    eos_id = tok.eos_token_id
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for _, p in pairs]
    order = sorted(range(len(pairs)), key=lambda i: (len(prompts[i]), i))
    answers: dict[int, list[int]] = {}
    t0 = time.monotonic()
    for at in range(0, len(order), scale.gen_batch):
        rows = order[at:at + scale.gen_batch]
        got = greedy_batch(model, [prompts[i] for i in rows], scale.answer_tokens, eos_id, device)
        answers.update(zip(rows, got))
        took = time.monotonic() - t0
        log(f"conversations: {len(answers)}/{len(pairs)} answered, {took:.0f} s")
    empty = 0
    with open(out_path, "w", encoding="utf-8") as fh:
        for k, (doc, prefix) in enumerate(pairs):
            ids = answers[k]
            if not ids:  # the target ended the file at once: nothing to train on
                empty += 1
                continue
            fh.write(json.dumps({"id": f"lab-{k}", "source": doc.path, "messages": [
                {"role": "user", "content": prefix},
                {"role": "assistant", "content": tok.decode(ids), "token_ids": ids}]}) + "\n")
    return {"conversations": len(pairs) - empty, "empty_answers": empty,
            "prompt_tokens_mean": round(float(np.mean([len(p) for p in prompts])), 1),
            "answer_tokens_mean": round(float(np.mean([len(a) for a in answers.values()])), 1),
            "generate_seconds": round(time.monotonic() - t0, 1)}


def write_regenerate_source(pairs: list[tuple[Tokenized, str]], path: Path) -> None:
    """The same user turns for ``data regenerate``, each with the corpus's own next lines as a
    placeholder answer (regenerate replaces every assistant turn)."""
    with open(path, "w", encoding="utf-8") as fh:
        for k, (doc, prefix) in enumerate(pairs):
            rest = doc.text[len(prefix):len(prefix) + 400]
            rest = rest if rest.strip() else "..."  # an empty answer is refused as a source row
            fh.write(json.dumps({"id": f"lab-{k}", "source": doc.path, "messages": [
                {"role": "user", "content": prefix},
                {"role": "assistant", "content": rest}]}) + "\n")
