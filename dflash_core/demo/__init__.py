"""The embedded demo: a tiny target LM trained on the spot, and training data it generates.

``builtin:tiny`` is a byte-level Qwen3 trained for about two minutes on one CPU core on the text of
Python's own help topics (``pydoc_data.topics``, shipped with every Python). A target with random
weights would not do: its greedy output is noise that no drafter can learn (tau stays ~1.1). This
one writes repetitive English-like text ("the sequence types and the contained to the ..."), which
a 2-layer drafter learns in a few hundred steps.

Its vocabulary is the built-in byte vocabulary (``dflash_core.data.byte_vocab``): the bytes of
UTF-8 text, ``<|endoftext|>`` (``EOS_ID``, separates help topics in the training text) and
``<|MASK|>`` (``MASK_ID``, the drafter's mask token).

``builtin:demo`` is data made by that target: prompts are random slices of a held-out part of the
text (the last ``HELDOUT_FRACTION`` of it, never seen in the target's training), responses are the
target's own greedy continuation (DFlash trains on target-generated responses), with a loss mask on
the response only.

Both are built once into the build cache (build_cache.py) under a key that names the recipe
version, the corpus and the parameters, so a changed recipe builds anew; ``dflash_demo.json`` is
written last and marks a finished build.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from dflash_core.data.byte_vocab import EOS_ID, MASK_ID, VOCAB_SIZE, encode
from dflash_core.persist.build_cache import Progress, cache_root, cached_build, is_built, report
from dflash_core.config import Config, ConfigError, config_from_dict

# Bump when anything in the recipe below changes: the cache key changes and everything rebuilds.
DEMO_VERSION = "tiny-v1"

# The target: 4 layers trained for 600 steps beat 6 layers at the same wall-clock time on 2 cores
# (measured: train loss ~1.3 vs ~1.6, readable words vs "the the the").
TINY_ARCH = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
    tie_word_embeddings=True,  # 258 x 128: the byte embedding doubles as the output layer
)
TRAIN_STEPS = 600
TRAIN_BATCH = 16  # windows per step
TRAIN_SEQ = 128  # bytes per window (the demo's prompt + response fit in it)
TRAIN_LR = 5e-3
TRAIN_WARMUP = 30
# One intra-op thread, fixed: CPU results depend on the thread count (a fixed count keeps the build
# reproducible), and for matrices this small a second OpenMP thread gains little on an idle machine
# but makes every op 3-10x slower on a busy one (its threads spin at barriers; measured here).
BUILD_THREADS = 1
HELDOUT_FRACTION = 0.08

# The demo data set.
DATA_SAMPLES = 1024
DATA_PROMPT_LEN = 64
DATA_RESPONSE_LEN = 64
GEN_BATCH = 64

META_NAME = "dflash_demo.json"
PROBE_TEXT = "The value of "


# --------------------------------------------------------------------------------------------
# Text and bytes
# --------------------------------------------------------------------------------------------

def corpus_ids() -> np.ndarray:
    """The corpus as token ids (int64): bytes, and EOS_ID between topics."""
    from pydoc_data.topics import topics

    out: list[np.ndarray] = []
    for k in sorted(topics):
        out.append(np.frombuffer(topics[k].encode("utf-8"), dtype=np.uint8).astype(np.int64))
        out.append(np.array([EOS_ID], dtype=np.int64))
    return np.concatenate(out)


def corpus_digest() -> str:
    """Fingerprint of the corpus: another Python version ships other help text."""
    return hashlib.sha256(corpus_ids().tobytes()).hexdigest()[:12]


def split_corpus(ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout): the last HELDOUT_FRACTION of the corpus is never trained on."""
    ids = corpus_ids() if ids is None else ids
    cut = int(len(ids) * (1 - HELDOUT_FRACTION))
    return ids[:cut], ids[cut:]


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_hf() -> Iterator[None]:
    """No transformers progress bars while saving / loading: they would write behind the
    dashboard's back."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads, restoring the previous count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _tiny_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID, pad_token_id=EOS_ID,
                       bos_token_id=None, attn_implementation="sdpa", **TINY_ARCH)


# --------------------------------------------------------------------------------------------
# The target
# --------------------------------------------------------------------------------------------

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
    with _quiet_hf():
        model.save_pretrained(folder)
    meta = {
        "version": DEMO_VERSION,
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


# --------------------------------------------------------------------------------------------
# The cached target
# --------------------------------------------------------------------------------------------

def tiny_target_key(seed: int = 0, steps: int = TRAIN_STEPS) -> str:
    return f"{DEMO_VERSION}-{corpus_digest()}-s{seed}-n{steps}-t{BUILD_THREADS}"


def ensure_tiny_target(cache_dir: str | Path | None = None, progress: Progress | None = None,
                       *, seed: int = 0, steps: int = TRAIN_STEPS) -> Path:
    """The cached demo target folder, built on first use."""
    final = cache_root(cache_dir) / "targets" / tiny_target_key(seed, steps)
    if is_built(final, META_NAME):
        report(progress, 1.0, f"demo target cached at {final}")
        return final
    return cached_build(final, lambda tmp: build_tiny_target(tmp, progress, seed, steps), progress,
                        marker=META_NAME)


def install_target(run_dir: str | Path, cache_dir: str | Path | None = None,
                   progress: Progress | None = None) -> Path:
    """Copy the cached demo target into ``<run_dir>/target/`` (the run folder layout other tools
    rely on) and return that path. An up-to-date copy is kept as it is.

    Several nodes sharing one run folder install it at the same moment, with no lock that
    reaches across machines: each copies into its own temporary folder, and when the rename
    finds the winner's copy in place the loser keeps that one (complete, and of the same
    target). An out-of-date copy is renamed aside and then deleted, never deleted in place."""
    src = ensure_tiny_target(cache_dir, progress)
    dst = Path(run_dir) / "target"

    def current() -> bool:
        return is_built(dst, META_NAME) and read_meta(dst) == read_meta(src)

    if current():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp, old = dst.parent / f".tmp-target-{tag}", dst.parent / f".old-target-{tag}"
    try:
        shutil.copytree(src, tmp)
        if dst.exists() and not current():
            with contextlib.suppress(FileNotFoundError):  # another node moved it first
                os.rename(dst, old)
        try:
            os.rename(tmp, dst)
        except OSError:
            if not current():  # what is there must be the winner's complete copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return dst


# --------------------------------------------------------------------------------------------
# The data
# --------------------------------------------------------------------------------------------

def load_lm(target_folder: Path):
    """An HF causal LM from a model folder: float32 on the CPU, eval mode, no progress bars (the
    demo target for its server and data; any folder for ``data inspect``'s agreement)."""
    from transformers import AutoModelForCausalLM

    from dflash_core.models.target import HF_BUILD_LOCK

    with _quiet_hf(), HF_BUILD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32,
                                                     local_files_only=True, use_safetensors=True)
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
    meta = {"version": DEMO_VERSION, "target": read_meta(target_folder).get("version"),
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
    key = (f"{DEMO_VERSION}-{_weights_digest(target_folder)}-n{n_samples}-p{prompt_len}"
           f"-r{response_len}-s{seed}")
    final = cache_root(cache_dir) / "data" / key
    if is_built(final, META_NAME):
        report(progress, 1.0, f"demo data cached at {final}")
        return final
    return cached_build(final, lambda tmp: make_demo_data(
        target_folder, tmp, n_samples, prompt_len, response_len, seed, progress), progress,
        marker=META_NAME)


# --------------------------------------------------------------------------------------------
# The demo run
# --------------------------------------------------------------------------------------------

# Features of every layer but the first: the last one carries the most about the next tokens.
DEMO_LAYER_IDS = [1, 2, 3]


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
        "drafter": {"num_layers": 2, "block_size": 8, "mask_token_id": MASK_ID, "num_anchors": 32,
                    "loss_chunk": 4096, "dtype": "float32"},
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

