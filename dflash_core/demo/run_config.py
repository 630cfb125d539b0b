"""The demo run's config: a few minutes of drafter training on the built-in target and data."""

from __future__ import annotations

from dflash_core.config import Config, ConfigError, config_from_dict
from dflash_core.data.byte_vocab import MASK_ID
from dflash_core.demo.recipe import DATA_PROMPT_LEN, DATA_RESPONSE_LEN


# Features of every layer but the 4-layer target's last: transformers hands that one over after
# the final norm, vLLM and SGLang capture it before, so a drafter trained on it would be served
# other features (preflight warns). It costs nothing measurable: 200 steps of this recipe reach
# exact tau 3.28 with these and 3.33 with [1, 2, 3] (bench/BENCHMARKS.md, issue 46).
DEMO_LAYER_IDS = [0, 1, 2]


def demo_layout(device: str = "auto", gpus: int | None = None) -> dict:
    """Where the demo runs: on GPUs when there are any (target on GPU 0, drafter on GPU 1 when
    there are two, both on GPU 0 with one), so an operator's first look at a GPU node shows per-GPU
    memory, NVML and the compiled attention; ``device="cpu"`` keeps the CPU."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cpu" or (device == "auto" and gpus == 0):
        return {"device": "cpu", "targets": [0], "drafters": [0], "hs_queue": 4}
    if gpus == 0:
        raise ConfigError("layout.device", "--device cuda asked for, but no CUDA GPU is visible",
                          hint="use --device cpu (or auto)")
    return {"device": "cuda", "targets": [0], "drafters": [1 if gpus > 1 else 0], "hs_queue": 4}


def demo_config(output_dir: str = "runs", name: str = "demo", device: str = "cpu",
                gpus: int | None = None) -> Config:
    """A complete config for the demo: a few minutes of drafter training on builtin data (the
    tiny target's head_dim of 32 lets the GPU path run compiled FlexAttention)."""
    return config_from_dict({
        "run": {"name": name, "output_dir": output_dir, "seed": 0, "max_steps": 0,
                "log_every_s": 2.0},
        "target": {"path": "builtin:tiny", "dtype": "float32", "layer_ids": DEMO_LAYER_IDS,
                   "attn_implementation": "sdpa"},
        # DFlash, not the default DSpark: the two tie here (bench/BENCHMARKS.md, "DSpark
        # against DFlash on the demo"), and the demo's figures across the benchmarks are DFlash's.
        "drafter": {"objective": "dflash", "num_layers": 2, "block_size": 8,
                    "mask_token_id": MASK_ID, "num_anchors": 32, "loss_chunk": 4096,
                    "dtype": "float32"},
        "data": {"path": "builtin:demo", "token_budget": 2048, "max_seqs_per_batch": 16,
                 "max_length": DATA_PROMPT_LEN + DATA_RESPONSE_LEN, "prefetch_batches": 4,
                 "eval_prompts": 8},
        "layout": demo_layout(device, gpus),
        "optim": {"lr": 6e-3, "betas": [0.9, 0.95], "warmup_frac": 0.05, "min_lr_frac": 0.1,
                  "grad_clip": 1.0, "epochs": 8},
        "checkpoint": {"every": 200, "keep": 2, "on_abort": True},
        "eval": {"every": 100, "max_new_tokens": 64, "prompt_tokens": DATA_PROMPT_LEN},
        "telemetry": {"interval_s": 1.0},
    })
