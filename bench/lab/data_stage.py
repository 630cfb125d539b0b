"""Stage ``data``: from the built target, ``<dir>/data/``:

    conversations.jsonl   user turn = a file prefix of the chat split, answer = the target's own
                          greedy continuation with its token ids
    prompts.jsonl         the same user turns with placeholder answers (for data regenerate)
    prepared/             dflash-tui data prepare of conversations.jsonl with the target's
                          tokenizer and chat template (the runs' data.path)
    sets/code.jsonl, sets/docstrings.jsonl   the evaluation's prompt sets (held-out files)
    lab_data.json         what was made, written last: the mark of a finished stage

A folder this stage began and did not finish (it holds ``.lab-partial``) is made again, keeping
its conversations when their generation (the stage's longest part) had ended under this
command's settings (``conversations.json``, written after them, holds their counts and key);
a folder it did not write is never touched.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from bench.lab.conversations import (
    draw_prompts, generate_conversations, write_regenerate_source,
)
from bench.lab.corpus import Corpus
from bench.lab.errors import LabError
from bench.lab.prefixes import tokenize_documents
from bench.lab.proc import dflash_tui, last_line
from bench.lab.prompt_sets import code_prompts, docstring_prompts, write_set
from bench.lab.scales import DATA_FIELDS, Scale

META_NAME = "lab_data.json"
GENERATED = "conversations.json"
PARTIAL = ".lab-partial"
SETS = ("code", "docstrings")


def data_key(scale: Scale, target_key: str, seed: int) -> str:
    return f"{target_key}-d{scale.key_of(*DATA_FIELDS)}-s{seed}"


def set_paths(root: Path) -> dict[str, Path]:
    return {name: root / "data" / "sets" / f"{name}.jsonl" for name in SETS}


def prepared_path(root: Path) -> Path:
    return root / "data" / "prepared"


def max_length(scale: Scale) -> int:
    """The prepared samples' limit: prompt + answer + the template's end of turn, with room for
    a token or two that tokenizing the turns apart adds at the cut."""
    return scale.prompt_max_tokens + scale.answer_tokens + 16


def _load_tokenizer(target: Path):
    from transformers import AutoTokenizer

    from dflash_core.demo.torch_env import quiet_hf

    with quiet_hf():
        return AutoTokenizer.from_pretrained(target, local_files_only=True)


def _load_model(target: Path, device: str):
    from transformers import AutoModelForCausalLM

    from dflash_core.demo.torch_env import quiet_hf

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with quiet_hf():
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, local_files_only=True,
                                                     use_safetensors=True)
    return model.to(device).eval()


def kept_conversations(folder: Path, key: str) -> dict | None:
    """The counts of an unfinished stage's conversations when their generation ended under
    ``key`` (GENERATED is written after conversations.jsonl is whole), else None."""
    try:
        got = json.loads((folder / GENERATED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if got.pop("key", None) != key or not (folder / "conversations.jsonl").is_file():
        return None
    return got


def prepare(conversations: Path, target: Path, out: Path, length: int, log=print) -> dict:
    """``dflash-tui data prepare`` as a user runs it; its manifest's counts."""
    log_file = out.parent / "prepare.log"
    rc = dflash_tui(["data", "prepare", str(conversations), "--tokenizer", str(target), "--out",
                     str(out), "--max-length", str(length), "--quiet"], log_file)
    if rc != 0:
        raise LabError(f"data prepare failed (exit {rc}): {last_line(log_file)}",
                       hint=f"see {log_file}")
    manifest = json.loads((out / "dflash_data.json").read_text(encoding="utf-8"))
    return {"counts": manifest.get("counts"), "tokens": manifest.get("tokens")}


def ensure_data(root: Path, scale: Scale, corpus: Corpus, target: Path, target_key: str,
                seed: int, device: str, log=print) -> dict:
    folder = root / "data"
    key = data_key(scale, target_key, seed)
    marker = folder / META_NAME
    if marker.is_file():
        record = json.loads(marker.read_text(encoding="utf-8"))
        if record.get("key") != key:
            raise LabError(f"{folder} holds data of other settings (key {record.get('key')}; "
                           f"this command's is {key})",
                           hint=f"pass another --dir, or remove {folder} to make it anew")
        log(f"data: cached at {folder} ({record['conversations']['conversations']} "
            f"conversations)")
        return record
    convs = None
    if folder.exists():
        if not (folder / PARTIAL).is_file():
            raise LabError(f"{folder} exists and was not written by this stage",
                           hint="pass another --dir")
        convs = kept_conversations(folder, key)
        if convs is None:
            shutil.rmtree(folder)  # this stage's own unfinished output
        else:
            log(f"data: keeping the {convs['conversations']} conversations generated before")
            shutil.rmtree(folder / "sets", ignore_errors=True)
            shutil.rmtree(prepared_path(root), ignore_errors=True)
    (folder / "sets").mkdir(parents=True)
    (folder / PARTIAL).write_text("", encoding="utf-8")
    t0 = time.monotonic()
    tok = _load_tokenizer(target)
    tk = tok.backend_tokenizer
    if convs is None:
        model = _load_model(target, device)
        chat = tokenize_documents(tk, corpus.split("chat"))
        pairs = draw_prompts(tk, chat, scale, seed)
        if not pairs:
            raise LabError("no file of the chat split is long enough for a prompt",
                           hint="select more packages, or lower prompt_min_tokens (scales.py)")
        write_regenerate_source(pairs, folder / "prompts.jsonl")
        convs = generate_conversations(model, tok, pairs, scale, device,
                                       folder / "conversations.jsonl", log)
        del model
        (folder / GENERATED).write_text(json.dumps({"key": key, **convs}), encoding="utf-8")
    held = tokenize_documents(tk, corpus.split("heldout"))
    sets = {"code": code_prompts(tk, held, scale.set_buckets, scale.set_prompts, seed),
            "docstrings": docstring_prompts(tk, held, scale.set_buckets, scale.set_prompts,
                                            seed)}
    for name, rows in sets.items():
        if not rows:
            raise LabError(f"the held-out files give no prompt for the {name} set",
                           hint="select more packages (scales.py)")
        write_set(rows, set_paths(root)[name])
    log("sets: " + ", ".join(f"{k} {len(v)} prompts" for k, v in sets.items()))
    prepared = prepare(folder / "conversations.jsonl", target, prepared_path(root),
                       max_length(scale), log)
    c = prepared["counts"] or {}
    log(f"prepared: {c.get('samples')} samples of {c.get('rows')} conversations "
        f"(left out: {c.get('dropped') or 'none'})")
    record = {"key": key, "conversations": convs, "prepared": prepared,
              "sets": {k: len(v) for k, v in sets.items()},
              "seconds": round(time.monotonic() - t0, 1)}
    marker.write_text(json.dumps(record, indent=2), encoding="utf-8")
    (folder / PARTIAL).unlink()
    log(f"data: made in {record['seconds']} s")
    return record
