"""``builtin:demo``: prompts from the held-out text, responses the tiny target's own greedy
continuation (loss on the response only), built once into the build cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

import dflash_core.demo.recipe as recipe
from dflash_core.demo.corpus import split_corpus
from dflash_core.demo.recipe import (
    BUILD_THREADS, DATA_PROMPT_LEN, DATA_RESPONSE_LEN, DATA_SAMPLES, GEN_BATCH, META_NAME,
)
from dflash_core.demo.tiny_target import read_meta
from dflash_core.demo.torch_env import quiet_hf, torch_threads
from dflash_core.persist.build_cache import Progress, cache_root, cached_build, is_built, report


def load_lm(target_folder: Path, trust_remote_code: bool = False):
    """An HF causal LM from a model folder: float32 on the CPU, eval mode, no progress bars (the
    demo target for its server and data; any folder for ``data inspect``'s agreement; a model of
    the folder's own code only with ``trust_remote_code``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_core.models.target.config import check_code_files
    from dflash_core.models.target.fp8 import dequantize_as_loaded
    from dflash_core.models.target.load import HF_BUILD_LOCK

    if trust_remote_code:  # its own code missing: our line, not transformers' Hub advice
        try:
            raw = json.loads((Path(target_folder) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raw = None  # transformers says what is wrong with it
        if isinstance(raw, dict):
            check_code_files(raw, Path(target_folder))
    config = AutoConfig.from_pretrained(target_folder, local_files_only=True,
                                        trust_remote_code=trust_remote_code)
    dequantize_as_loaded(config)  # on the CPU, also where a GPU that keeps FP8 is beside it
    with quiet_hf(), HF_BUILD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(target_folder, config=config,
                                                     dtype=torch.float32,
                                                     local_files_only=True, use_safetensors=True,
                                                     trust_remote_code=trust_remote_code)
    return model.eval()


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts [b, P] -> [b, n], with a KV cache."""
    out = model(input_ids=prompts, use_cache=True)
    past = out.past_key_values
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    new = [tok]
    for _ in range(n - 1):
        out = model(input_ids=tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        new.append(tok)
    return torch.cat(new, dim=1)


def demo_prompts(n: int, prompt_len: int, seed: int) -> np.ndarray:
    """[n, prompt_len] seeded random slices of the held-out text."""
    _, heldout = split_corpus()
    rng = np.random.default_rng([seed, 2])
    starts = rng.integers(0, len(heldout) - prompt_len, n)
    return np.stack([heldout[s : s + prompt_len] for s in starts])


def make_demo_data(target_folder: str | Path, out_folder: str | Path, n_samples: int = DATA_SAMPLES,
                   prompt_len: int = DATA_PROMPT_LEN, response_len: int = DATA_RESPONSE_LEN,
                   seed: int = 0, progress: Progress | None = None,
                   threads: int = BUILD_THREADS) -> Path:
    """Prompts from the held-out text, responses = the target's greedy continuation; written as
    Arrow shards (datasets save_to_disk layout), loss_mask 0 on the prompt and 1 on the response."""
    from dflash_core.data import write_shards

    model = load_lm(Path(target_folder))
    prompts = demo_prompts(n_samples, prompt_len, seed)
    samples = []
    report(progress, 0.0, f"generating {n_samples} demo samples")
    with torch_threads(threads):
        for s in range(0, n_samples, GEN_BATCH):
            p = torch.from_numpy(prompts[s : s + GEN_BATCH])
            resp = greedy_continue(model, p, response_len).numpy()
            for row_p, row_r in zip(p.numpy(), resp):
                samples.append({"input_ids": row_p.tolist() + row_r.tolist(),
                                "loss_mask": [0] * prompt_len + [1] * response_len})
            report(progress, 0.95 * min(n_samples, s + GEN_BATCH) / n_samples,
                    f"demo data {min(n_samples, s + GEN_BATCH)}/{n_samples} samples")
    out = Path(out_folder)
    write_shards(samples, out, samples_per_shard=256, fmt="arrow")
    meta = {"version": recipe.DEMO_VERSION, "target": read_meta(target_folder).get("version"),
            "samples": n_samples, "prompt_len": prompt_len, "response_len": response_len,
            "seed": seed}
    (out / META_NAME).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    report(progress, 1.0, f"demo data ready ({n_samples} samples)")
    return out


def _weights_digest(target_folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(target_folder.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def ensure_demo_data(target_folder: str | Path, cache_dir: str | Path | None = None,
                     progress: Progress | None = None, *, n_samples: int = DATA_SAMPLES,
                     prompt_len: int = DATA_PROMPT_LEN, response_len: int = DATA_RESPONSE_LEN,
                     seed: int = 0) -> Path:
    """The cached demo data set of this target (keyed by its weights and the parameters)."""
    target_folder = Path(target_folder)
    key = (f"{recipe.DEMO_VERSION}-{_weights_digest(target_folder)}-n{n_samples}-p{prompt_len}"
           f"-r{response_len}-s{seed}")
    final = cache_root(cache_dir) / "data" / key
    if is_built(final, META_NAME):
        report(progress, 1.0, f"demo data cached at {final}")
        return final
    return cached_build(final, lambda tmp: make_demo_data(
        target_folder, tmp, n_samples, prompt_len, response_len, seed, progress), progress,
        marker=META_NAME)
