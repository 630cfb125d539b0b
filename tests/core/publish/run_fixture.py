"""A tiny run folder as a run leaves it, for publish: config.yaml, checkpoints written by the
checkpoint package (DFlash or DSpark, format 4), events.jsonl with evaluations, checkpoints/best."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from torch import nn
from transformers import Qwen3Config

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.folders import mark_best
from dflash_core.models.dspark import format as dspark_format
from dflash_core.models.dspark.drafter import DSparkSettings
from dflash_core.models.registry import new_drafter
from dflash_core.observe.events import EvalResult

VOCAB, HIDDEN = 96, 32
TARGET = "Qwen/Qwen3-8B"
DFLASH_B, DSPARK_B = 4, 5  # DFlash drafts B-1 = 3, DSpark B = 5 per round
LAYERS = [1, 2]
HOURS = {"gpu_target": 0.5, "gpu_drafter": 1.25, "host_target": 0.0, "host_drafter": 0.0,
         "since_step": 0, "price": 2.0, "currency": "USD"}
DATA = {"id": "8ffe6d6c0ecc", "manifest": None, "files": [["data-00000-of-00002.arrow", 10],
                                                          ["data-00001-of-00002.arrow", 10]],
        "path": "/data/chat", "samples": 64}


def drafter(objective: str):
    torch.manual_seed(0)
    target = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, tie_word_embeddings=False)
    d = new_drafter(objective, target, num_layers=1, target_layer_ids=LAYERS,
                    block_size=DSPARK_B if objective == "dspark" else DFLASH_B,
                    mask_token_id=VOCAB - 1,
                    settings=DSparkSettings(block_size=DSPARK_B, markov_rank=8)
                    if objective == "dspark" else None)
    if objective == "dspark":
        d.attach_target_head(nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False))
    return d


def save(run_dir: Path, d, objective: str, step: int) -> Path:
    dspark = objective == "dspark"
    opt = torch.optim.AdamW(d.parameters(), lr=1e-3)
    return ckpt.save_checkpoint(
        run_dir, step, keep=0, drafter_state={k: v.detach() for k, v in d.state_dict().items()},
        drafter_config=dspark_format.serve_config(d) if dspark else d.interchange_config(),
        optimizer_state=opt.state_dict(), scheduler_state={"last_epoch": step},
        trainer_state={"total_steps": 10, "data": DATA, "device_hours": HOURS},
        served_dtype=torch.bfloat16,
        served_extra=dspark_format.frozen_tensors(d) if dspark else None)


def make_run(root: Path, objective: str = "dflash", steps=(3, 6), best: int | None = 3
             ) -> Path:
    """runs/t with checkpoints at ``steps`` and evaluations at each; ``best`` the step
    checkpoints/best names (None: no marker)."""
    run_dir = root / "runs" / "t"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({
        "run": {"name": "t"}, "target": {"path": TARGET},
        "drafter": {"objective": objective}, "data": {"path": "/data/chat"}}))
    d = drafter(objective)
    events = []
    for step in steps:
        save(run_dir, d, objective, step)
        events += [EvalResult(step=step, tau=2.0 + step / 10, acceptance=[], prompts=8),
                   EvalResult(step=step, tau=1.5 + step / 10, acceptance=[], prompts=5,
                              prompt_set="gsm8k")]
    (run_dir / "events.jsonl").write_text("".join(e.to_json() + "\n" for e in events))
    if best is not None:
        mark_best(run_dir, run_dir / "checkpoints" / f"step-{best}", best, 2.0 + best / 10)
    return run_dir
