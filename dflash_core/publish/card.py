"""The model card (README.md) of a published folder, in the model hub's conventions: YAML front
matter (library, pipeline tag, base_model, tags), then what a user of the drafter needs, each
number saying where it came from. Its last line marks the folder as publish's own (``MARK``)."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_core.observe.device_hours import figure_text
from dflash_core.publish.facts import Facts
from dflash_core.publish.serving import SGLANG_NO_DFLASH2, command_lines

CARD = "README.md"
# The card's last line begins so: a folder whose card has it was written by publish, and only
# such a folder is replaced (with --overwrite).
MARK = "<!-- written by dflash-tui publish"


def _yaml(value) -> str:
    return json.dumps(value)  # a JSON string or list is valid YAML, quoted where needed


def front_matter(f: Facts) -> str:
    tags = [f.objective, *(["dflash"] if f.objective != "dflash" else []),
            "speculative-decoding", "draft-model"]
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    if f.target and not f.target.startswith("/"):  # a hub id; a folder here names no model
        lines.append(f"base_model: {_yaml(f.target)}")
    lines.append("tags:")
    lines += [f"- {t}" for t in tags]
    return "\n".join(lines + ["---", ""])


def _row(what: str, value, source: str) -> str:
    return f"| {what} | {value} | {source} |"


def _data_text(d: dict) -> str:
    if not d:
        return "not recorded"
    parts = [f"`{d['path']}`" if "path" in d else ""]
    if "samples" in d:
        parts.append(f"{d['samples']} samples" + (f" in {d['shards']} shards" if "shards" in d
                                                  else ""))
    if "id" in d:
        parts.append(f"data id {d['id']}")
    if "source" in d:
        parts.append(f"prepared from {d['source']}")
    if "tokenizer" in d:
        parts.append(f"tokenizer {d['tokenizer']}")
    return ", ".join(p for p in parts if p)


def _hours_text(f: Facts) -> str:
    if f.hours is None:
        return "not recorded (a checkpoint written before device time was)"
    return figure_text(f.hours)


def _set_name(name: str) -> str:
    return name or "held-out prompts of the training data"


def _taus(f: Facts) -> list[str]:
    out = ["## Acceptance", ""]
    if f.taus:
        out += [f"Exact tau (tokens per round of exact speculative decoding: accepted drafts "
                f"plus the target's bonus token) of the run's evaluations at step {f.step}, from "
                "the run's `events.jsonl` (`EvalResult` events; the last one of each prompt set "
                "at that step):", "",
                "| prompt set | exact tau | prompts |", "|---|---|---|"]
        out += [f"| {_set_name(t.prompt_set)} | {t.tau:.4f} | {t.prompts} |" for t in f.taus]
        out.append("")
    else:
        out += [f"The run recorded no evaluation at step {f.step}. `dflash-tui eval --target "
                "TARGET --drafter THIS_FOLDER --prompts NAME=FILE.jsonl` measures exact tau per "
                "prompt set.", ""]
    if f.best is not None:
        out += [f"The run's `checkpoints/best` names this checkpoint: exact tau "
                f"{float(f.best.get('tau', -1)):.4f} on the "
                f"{_set_name(str(f.best.get('prompt_set', '')))}"
                + (f" (prompt set {f.best['prompt_set']})" if f.best.get("prompt_set") else "")
                + ", the highest of the run's evaluations on that set.", ""]
    out += ["Tau is measured with greedy decoding by this project's evaluation; a serving "
            "stack's own log counts acceptance its own way (its mean acceptance length or "
            "accept length, with or without the bonus token).", ""]
    return out


def _layout_rows(f: Facts) -> list[str]:
    """How a server must read the block: its attention, and DSpark's slots (engines read the
    anchor-first and the 1+N layouts differently, silently)."""
    rows = [_row("attention in a block", "causal (a position sees the block up to itself)"
                 if f.causal else "bidirectional", "config.json `is_causal`")]
    if f.objective == "dspark":
        rows.append(_row("slot layout", "anchor-first: B slots, slot j drafts the token at "
                         "anchor + j + 1", "config.json `sample_from_anchor: true` "
                         "(`dspark_bonus_anchor: false`)"))
    return rows


def _serving_notes(f: Facts) -> list[str]:
    """What a server needs that its defaults could get wrong."""
    if f.objective == "dflash2":  # what config.json cannot tell a server
        return [f"DFlash2: `num_speculative_tokens` must be {f.drafts_per_round} (B - 1): vLLM "
                "does not read the block size from `config.json`, and another count silently "
                "changes the convolution's window. vLLM serves DFlash2 from version 0.32 on a "
                "GPU: the `DFlash2DraftModel` architecture selects its convolutions and "
                "candidate selector, which run on vLLM's V2 GPU model runner only (its V1 "
                "runner and its CPU build refuse DFlash2 folders). The drafter needs the "
                "target's full vocabulary.", ""]
    if f.objective == "dspark":
        return ["DSpark's slots are anchor-first: the anchor slot predicts the first draft, B "
                "slots give B drafts. `config.json` says so in both keys servers read "
                "(`sample_from_anchor: true`, `dspark_bonus_anchor: false`). A server that "
                "reads a DSpark folder as the 1+N layout (the anchor an input only, slot j "
                "drafting anchor + j, as speculators writes them) drafts every slot one "
                "position off without an error: check that yours reads those keys.", ""]
    return []


def render(f: Facts, out: Path, checkpoint: Path, how: str, added: dict | None = None) -> str:
    """The card for facts ``f`` of ``checkpoint``, published to ``out`` (``how``: how the
    checkpoint was chosen, in words; ``added``: the serving keys publish stated in config.json
    that the checkpoint's left out, an older checkpoint's)."""
    target = f.target or "TARGET"
    src = f.sources
    layers = f"{f.layer_ids}" + (f" of the target's {f.num_target_layers} layers (0-based)"
                                 if f.num_target_layers else "")
    drafts = (f"{f.drafts_per_round} (B: the anchor slot predicts too)" if f.objective == "dspark"
              else f"{f.drafts_per_round} (B - 1)")
    key = "`{}`" if f.objective == "dspark" else "`dflash_config.{}`"
    lines = [front_matter(f),
             f"# {f.title} drafter for {target}", "",
             f"A {f.title} speculative-decoding drafter (`{f.architecture}`): a small model that "
             f"drafts {f.drafts_per_round} tokens per round from the outputs of the target's "
             f"layers {f.layer_ids}, which the target then verifies in one forward pass. It is "
             "served beside its target, never alone.", "",
             "## Model", "",
             "| | value | from |", "|---|---|---|",
             _row("target", f"`{target}`" if f.target else "not recorded",
                  src["target"] or "no run config.yaml beside the checkpoint"),
             _row("objective", f.title, "config.json `architectures`"),
             _row("block size B", f.block_size, "config.json " + key.format("block_size")),
             _row("drafts per round", drafts, f"the {f.title} family"),
             _row("target layer ids", layers, "config.json " + key.format("target_layer_ids")),
             _row("mask token id", f.mask_token_id, "config.json " + key.format("mask_token_id")),
             *_layout_rows(f),
             _row("drafter layers", f.drafter_layers, "config.json `num_hidden_layers`"),
             _row("steps trained", f.step if f.step is not None else "not recorded",
                  src["steps"]),
             _row("data", _data_text(f.data), src["data"] or "not recorded"),
             _row("device time", _hours_text(f), src["hours"] or "-"),
             "",
             *_taus(f),
             "## Serving", "",
             "`config.json` and `model.safetensors` are the whole drafter (its weights in the "
             "served dtype). Point the server's draft model at this folder (or at the hub repo "
             "it is uploaded to). The command lines below follow vLLM's and SGLang's public "
             "documentation of speculative decoding; the token counts are this family's "
             f"(B = {f.block_size}), other options vary between versions of those stacks, whose "
             "documentation is the reference.", ""]
    serve = command_lines(f.objective, target, str(out), f.block_size, f.drafts_per_round)
    lines += _serving_notes(f)
    lines += ["vLLM:", "", "```sh", serve.vllm, "```", ""]
    lines += (["SGLang:", "", "```sh", serve.sglang, "```", ""] if serve.sglang is not None
              else [SGLANG_NO_DFLASH2, ""])
    if added:
        copied = (f"`model.safetensors` is a byte-identical copy of that checkpoint's file, "
                  "checked against its `checksums.json` before and after the copy; "
                  "`config.json` is the checkpoint's with the keys a server reads that it left "
                  "unstated added, as this engine computes them ("
                  + ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in added.items()) + ").")
    else:
        copied = ("`config.json` and `model.safetensors` are byte-identical copies of that "
                  "checkpoint's files, checked against its `checksums.json` before and after the "
                  "copy.")
    lines += ["## Provenance", "",
              f"Published by `dflash-tui publish` from `{checkpoint}`, {how}. {copied}", "",
              f"{MARK}: this folder is replaced only by `dflash-tui publish --overwrite` -->", ""]
    return "\n".join(lines)


def written_by_publish(folder: Path) -> bool:
    """Whether ``folder`` holds a card publish wrote (its marking last line)."""
    try:
        text = (folder / CARD).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return text.startswith("---\n") and MARK in text
