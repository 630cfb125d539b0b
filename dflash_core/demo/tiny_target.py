"""``builtin:tiny``: the byte-level Qwen3 trained on the spot (about 2 minutes on one core), saved
as an ordinary HF folder that a server loads as it is (config.json naming its architecture, the
byte tokenizer with its chat template: models/target/servable.py) with ``dflash_demo.json``."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dflash_core.data.byte_vocab import EOS_ID, MASK_ID, VOCAB_SIZE, encode, save_byte_tokenizer
import dflash_core.demo.recipe as recipe
from dflash_core.demo.corpus import corpus_digest, split_corpus
from dflash_core.demo.recipe import (
    BUILD_THREADS, META_NAME, PROBE_TEXT, TINY_ARCH, TRAIN_BATCH, TRAIN_LR, TRAIN_SEQ, TRAIN_STEPS,
    TRAIN_WARMUP,
)
from dflash_core.demo.torch_env import quiet_hf, torch_threads
from dflash_core.models.target.servable import name_architecture
from dflash_core.persist.build_cache import Progress, report


def _tiny_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
                       bos_token_id=None, attn_implementation="sdpa", **TINY_ARCH)


def build_tiny_target(folder: str | Path, progress: Progress | None = None, seed: int = 0,
                      steps: int = TRAIN_STEPS, threads: int = BUILD_THREADS) -> Path:
    """Train the tiny byte-level target and save it as an ordinary HF folder (safetensors), plus
    ``dflash_demo.json`` (ids, recipe, final loss). Deterministic for a seed and thread count; the
    global RNG state of the caller is left untouched. About 2 minutes on one core."""
    from transformers import Qwen3ForCausalLM

    folder = Path(folder)
    t0 = time.monotonic()
    train, heldout = split_corpus()
    data = torch.from_numpy(train)
    report(progress, 0.0, f"training the demo target ({steps} steps)")
    losses: list[float] = []
    with torch.random.fork_rng(devices=[]), torch_threads(threads):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(_tiny_config())
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR, betas=(0.9, 0.95),
                                weight_decay=0.0)
        gen = torch.Generator().manual_seed(seed)
        offsets = torch.arange(TRAIN_SEQ + 1)
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = _lr(step, steps)
            starts = torch.randint(0, len(data) - TRAIN_SEQ - 1, (TRAIN_BATCH, 1), generator=gen)
            window = data[starts + offsets]
            logits = model(input_ids=window[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), window[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            if step % 10 == 9 or step == steps - 1:
                report(progress, 0.95 * (step + 1) / steps,
                        f"demo target step {step + 1}/{steps}, loss {losses[-1]:.2f}")
        model.eval()
        heldout_loss = _heldout_loss(model, heldout, seed)
        with torch.no_grad():  # recorded so a reload can be checked against the model as trained
            probe = model(input_ids=torch.tensor([encode(PROBE_TEXT)])).logits[0, -1, :16]

    folder.mkdir(parents=True, exist_ok=True)
    # Not model.save_pretrained: once torch.distributed is set up (several nodes) it writes
    # nothing on a rank other than 0, and the node that holds the build lock may be any rank.
    name_architecture(model.config, model)  # a server's model class (servable.py)
    with quiet_hf():
        model.config.save_pretrained(folder)
        save_byte_tokenizer(folder)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # the embedding's own tensor; loading ties it back
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    meta = {
        "version": recipe.DEMO_VERSION,
        "corpus": "pydoc_data.topics",
        "corpus_sha256": corpus_digest(),
        "vocab_size": VOCAB_SIZE,
        "byte_ids": [0, 255],
        "eos_token_id": EOS_ID,
        "mask_token_id": MASK_ID,
        "seed": seed,
        "steps": steps,
        "batch": TRAIN_BATCH,
        "seq_len": TRAIN_SEQ,
        "lr": TRAIN_LR,
        "threads": threads,
        # mean of the last 20 steps: one batch of 16 windows is a noisy estimate
        "final_train_loss": round(float(np.mean(losses[-20:])), 4) if losses else None,
        "heldout_loss": round(heldout_loss, 4),
        "build_seconds": round(time.monotonic() - t0, 1),
        "probe_text": PROBE_TEXT,
        "probe_logits": [float(x) for x in probe],  # first 16 logits at the probe's last position
    }
    (folder / META_NAME).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    report(progress, 1.0, f"demo target ready (loss {meta['final_train_loss']:.2f})")
    return folder


def _lr(step: int, steps: int) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    if step < TRAIN_WARMUP:
        return TRAIN_LR * (step + 1) / TRAIN_WARMUP
    p = (step - TRAIN_WARMUP) / max(1, steps - TRAIN_WARMUP)
    return TRAIN_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


@torch.no_grad()
def _heldout_loss(model, heldout: np.ndarray, seed: int, windows: int = 16) -> float:
    rng = np.random.default_rng([seed, 1])
    starts = rng.integers(0, len(heldout) - TRAIN_SEQ - 1, windows)
    x = torch.from_numpy(np.stack([heldout[s : s + TRAIN_SEQ + 1] for s in starts]))
    logits = model(input_ids=x[:, :-1]).logits
    return float(F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), x[:, 1:].reshape(-1)))


def read_meta(target_folder: str | Path) -> dict:
    """The demo target's ``dflash_demo.json``."""
    return json.loads((Path(target_folder) / META_NAME).read_text(encoding="utf-8"))
