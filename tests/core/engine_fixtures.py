"""Tiny targets, data and configs for engine tests (random weights: speed, not learning)."""

from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_core.config import config_from_dict
from dflash_core.data import write_shards

VOCAB = 128


def make_target(folder: Path, seed: int = 0) -> Path:
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=512)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).save_pretrained(folder)
    return folder


def make_data(folder: Path, n: int = 64, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        L = int(rng.integers(24, 64))
        p = int(rng.integers(4, 12))
        ids = rng.integers(0, VOCAB - 1, L).tolist()
        samples.append({"input_ids": ids, "loss_mask": [0] * p + [1] * (L - p)})
    write_shards(samples, folder, samples_per_shard=32)
    return folder


def make_config(tmp: Path, target: Path, data: Path, **over):
    d = {
        "run": {"name": "t", "output_dir": str(tmp / "runs"), "max_steps": 6, "seed": 1},
        "target": {"path": str(target), "dtype": "float32", "num_features": 2},
        "drafter": {"num_layers": 1, "block_size": 4, "num_anchors": 8, "loss_chunk": 64},
        "data": {"path": str(data), "token_budget": 256, "max_seqs_per_batch": 4,
                 "max_length": 64, "prefetch_batches": 2, "eval_prompts": 2},
        "layout": {"device": "cpu", "targets": [0], "drafters": [0], "hs_queue": 2},
        "optim": {"lr": 1e-3, "epochs": 1},
        "checkpoint": {"every": 3, "keep": 2},
        "eval": {"max_new_tokens": 8},
        "telemetry": {"interval_s": 0.2},
    }
    for key, value in over.items():
        section, name = key.split("__")
        d.setdefault(section, {})[name] = value
    return config_from_dict(d)
