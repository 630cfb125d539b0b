"""The lab target: a Qwen3-shaped causal LM trained on the corpus's training files with its own BPE
tokenizer, saved as an ordinary transformers folder (config.json, model.safetensors, the
tokenizer and its chat template) plus ``lab_target.json``, written last: the build's record (the
corpus, the recipe, held-out loss, seconds) and the mark of a finished build.

The tokenizer and the tokenized training and held-out text are kept apart in ``<dir>/tokens``
(``lab_tokens.json`` last), so a build stopped by ``train_minutes_cap`` starts again at the
training.

Deterministic for a seed: the tokenizer, the initial weights and the order of the training
windows follow from the corpus and the seed. On the CPU (one intra-op thread, fixed, as the demo
target) the weights are bitwise the same build to build (tests); on a GPU the kernels' reduction
order may move the last bits. The folder is built once (``<dir>/target``) and every later stage
and call reads that one.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dflash_core.models.target.servable import add_architecture, name_architecture
from bench.lab.corpus import Corpus
from bench.lab.errors import LabError
from bench.lab.scales import TARGET_FIELDS, TOKEN_FIELDS, Scale
from bench.lab.tokenizer import (
    EOS, MASK, encode_documents, fast_tokenizer, save_tokenizer, train_tokenizer,
)

META_NAME = "lab_target.json"
TOKENS_NAME = "lab_tokens.json"
PROBE_TEXT = "def __init__(self"
CPU_THREADS = 1  # CPU results depend on the thread count: a fixed one keeps the build reproducible


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LabError(f"--device {device}: no CUDA GPU is visible", hint="use --device cpu")
    return device


def target_key(scale: Scale, corpus_digest: str, seed: int) -> str:
    return f"{scale.name}-{scale.key_of(*TARGET_FIELDS)}-c{corpus_digest}-s{seed}"


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth (the demo target's schedule)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def qwen3_config(scale: Scale, vocab: int, eos_id: int):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab, eos_token_id=eos_id, pad_token_id=eos_id,
                       bos_token_id=None, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       attn_implementation="sdpa", **scale.arch)


def _windows(stream: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    return stream[starts[:, None] + torch.arange(seq + 1)].long()


@torch.no_grad()
def heldout_loss(model, stream: np.ndarray, seq: int, windows: int, seed: int,
                 device: str) -> float | None:
    """Mean cross-entropy (nats per token) on ``windows`` seeded windows of the held-out files."""
    if len(stream) < 3:
        return None
    seq = min(seq, len(stream) - 2)
    rng = np.random.default_rng([seed, 1])
    starts = torch.from_numpy(rng.integers(0, len(stream) - seq - 1, windows))
    x = _windows(torch.from_numpy(stream), starts, seq)
    total, count = 0.0, 0
    for at in range(0, windows, 16):
        part = x[at:at + 16].to(device)
        with _autocast(device):
            logits = model(input_ids=part[:, :-1]).logits
        total += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       part[:, 1:].reshape(-1), reduction="sum"))
        count += part[:, 1:].numel()
    return total / count


def _autocast(device: str):
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train_lm(model, stream: np.ndarray, scale: Scale, seed: int, device: str,
             log=print) -> list[float]:
    """Train ``model`` in place on random windows of ``stream``; returns the step losses."""
    data = torch.from_numpy(stream)
    steps, batch, seq = scale.train_steps, scale.train_batch, scale.train_seq
    if len(data) < seq + 2:
        raise LabError(f"the training text has {len(data)} tokens, fewer than one window of "
                       f"{seq}", hint="select more packages (scales.py) or a shorter train_seq")
    fused = {"fused": True} if device.startswith("cuda") else {}
    opt = torch.optim.AdamW(model.parameters(), lr=scale.train_lr, betas=(0.9, 0.95),
                            weight_decay=0.1, **fused)
    gen = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    model.train()
    t0 = time.monotonic()
    every = max(1, steps // 20)
    # the cap is checked once the first steps (CUDA's start, the allocator's growth) are past
    warm, check = min(3, steps - 1), min(steps - 1, max(13, steps // 50))
    t_warm = t0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, scale.train_lr, scale.train_warmup)
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        window = _windows(data, starts, seq).to(device, non_blocking=True)
        with _autocast(device):
            logits = model(input_ids=window[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step in (warm, check) and scale.train_minutes_cap > 0:
            float(loss.detach())  # wait for the device: the clock measures the steps
            if step == warm:
                t_warm = time.monotonic()
            else:
                _check_cap(scale, (time.monotonic() - t_warm) / (check - warm), log)
        if step % every == every - 1 or step == steps - 1:
            losses_now = float(loss.detach())  # a host sync: only on the lines printed
            losses.append(losses_now)
            took = time.monotonic() - t0
            rate = (step + 1) * batch * seq / took
            log(f"target step {step + 1}/{steps}: loss {losses_now:.3f}, {rate:,.0f} tokens/s, "
                f"{took:.0f} s, ~{took / (step + 1) * (steps - step - 1):.0f} s left")
    model.eval()
    return losses


def _check_cap(scale: Scale, s_per_step: float, log) -> None:
    projected = scale.train_steps * s_per_step
    log(f"target: {s_per_step:.3f} s/step measured, {scale.train_steps} steps "
        f"~{projected / 60:.1f} min (cap {scale.train_minutes_cap} min)")
    if projected > scale.train_minutes_cap * 60:
        # 5% under the cap: the same command measures its steps again, a little differently
        fit = int(0.95 * scale.train_minutes_cap * 60 / s_per_step)
        raise LabError(f"the target's {scale.train_steps} steps would train for ~"
                       f"{projected / 60:.1f} min at the {s_per_step:.3f} s/step measured, past "
                       f"train_minutes_cap {scale.train_minutes_cap} min",
                       hint=f"--set train_steps={fit} fits the cap (the tokenizer is kept); "
                            "--set train_minutes_cap=0 trains without it")


def tokens_key(scale: Scale, corpus_digest: str) -> str:
    return f"{scale.name}-{scale.key_of(*TOKEN_FIELDS)}-c{corpus_digest}"


def ensure_tokens(root: Path, scale: Scale, corpus: Corpus, log=print):
    """(the BPE tokenizer, the training stream, the held-out stream), built once per corpus and
    tokenizer settings into ``<root>/tokens``."""
    from tokenizers import Tokenizer

    from dflash_core.persist.build_cache import cached_build

    folder = root / "tokens"
    key = tokens_key(scale, corpus.digest)
    marker = folder / TOKENS_NAME
    if marker.is_file() and json.loads(marker.read_text(encoding="utf-8")).get("key") != key:
        shutil.rmtree(folder)  # this stage's own intermediate files, of another corpus

    def build(tmp: Path) -> None:
        t0 = time.monotonic()
        tk = train_tokenizer(corpus.split("train"), scale.vocab_size, scale.tokenizer_train_bytes)
        eos_id = tk.token_to_id(EOS)
        tmp.mkdir(parents=True, exist_ok=True)
        tk.save(str(tmp / "tokenizer.json"))
        for split in ("train", "heldout"):
            np.save(tmp / f"{split}.npy", encode_documents(tk, corpus.split(split), eos_id))
        record = {"key": key, "seconds": round(time.monotonic() - t0, 1)}
        (tmp / TOKENS_NAME).write_text(json.dumps(record), encoding="utf-8")

    cached_build(folder, build, marker=TOKENS_NAME)
    record = json.loads(marker.read_text(encoding="utf-8"))
    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return (tk, np.load(folder / "train.npy"), np.load(folder / "heldout.npy"),
            record["seconds"])


def build_target(root: Path, folder: Path, scale: Scale, corpus: Corpus, seed: int, device: str,
                 log=print) -> dict:
    """Tokenizer, training and the saved folder; returns the record written as META_NAME."""
    from safetensors.torch import save_file
    from transformers import Qwen3ForCausalLM

    from dflash_core.demo.torch_env import quiet_hf, torch_threads

    t0 = time.monotonic()
    tk, train_stream, held_stream, t_tok = ensure_tokens(root, scale, corpus, log)
    eos_id, mask_id, vocab = tk.token_to_id(EOS), tk.token_to_id(MASK), tk.get_vocab_size()
    log(f"tokenizer: {vocab} ids (learned in {t_tok:.0f} s); {len(train_stream):,} training "
        f"tokens, {len(held_stream):,} held-out tokens")
    config = qwen3_config(scale, vocab, eos_id)
    threads = torch_threads(CPU_THREADS) if device == "cpu" else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), threads:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
        params = sum(p.numel() for p in model.parameters())
        log(f"target: Qwen3 {scale.num_hidden_layers} layers, hidden {scale.hidden_size}, "
            f"{params / 1e6:.1f}M parameters, {scale.train_steps} steps of {scale.train_batch} x "
            f"{scale.train_seq} tokens on {device}")
        if device.startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = True
        model.to(device)
        t_train = time.monotonic()
        losses = train_lm(model, train_stream, scale, seed, device, log)
        t_train = time.monotonic() - t_train
        held = heldout_loss(model, held_stream, scale.train_seq, scale.heldout_windows, seed,
                            device)
        model.float().cpu()
        with torch.no_grad():  # recorded so that a reload can be checked against it
            probe_ids = tk.encode(PROBE_TEXT).ids
            probe = model(input_ids=torch.tensor([probe_ids])).logits[0, -1, :16]
    folder.mkdir(parents=True, exist_ok=True)
    name_architecture(model.config, model)  # a server's model class (servable.py)
    with quiet_hf():  # not save_pretrained: it writes nothing off rank 0 under torch.distributed
        model.config.save_pretrained(folder)
        model.generation_config.save_pretrained(folder)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied to the embedding: loading ties it back
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(fast_tokenizer(tk), folder)
    return {
        "scale": scale.name, "seed": seed, "device": device,
        "corpus": corpus.summary(),
        "vocab_size": vocab, "eos_token_id": eos_id, "mask_token_id": mask_id,
        "parameters": params, "arch": scale.arch,
        "train_tokens_available": int(len(train_stream)),
        "heldout_tokens": int(len(held_stream)),
        "steps": scale.train_steps, "batch": scale.train_batch, "seq_len": scale.train_seq,
        "tokens_trained": scale.train_steps * scale.train_batch * scale.train_seq,
        "lr": scale.train_lr,
        "final_train_loss": round(float(np.mean(losses[-3:])), 4) if losses else None,
        "heldout_loss": round(held, 4) if held is not None else None,
        "tokenizer_seconds": round(t_tok, 1), "train_seconds": round(t_train, 1),
        "build_seconds": round(time.monotonic() - t0, 1),
        "probe_text": PROBE_TEXT, "probe_logits": [float(x) for x in probe],
    }


def read_record(folder: Path) -> dict:
    return json.loads((folder / META_NAME).read_text(encoding="utf-8"))


def ensure_target(root: Path, scale: Scale, corpus: Corpus, seed: int, device: str,
                  log=print) -> tuple[Path, dict]:
    """``<root>/target``, built on first use; one built under other settings is refused."""
    from dflash_core.persist.build_cache import cached_build

    folder = root / "target"
    key = target_key(scale, corpus.digest, seed)
    if (folder / META_NAME).is_file():
        record = read_record(folder)
        if record.get("key") != key:
            raise LabError(f"{folder} holds a target of other settings (key {record.get('key')}; "
                           f"this command's is {key}: another scale, seed, recipe or installed "
                           "package versions)",
                           hint=f"pass another --dir, or remove {folder} to build anew")
        if add_architecture(folder, "Qwen3ForCausalLM"):  # built before its config named it
            log(f"target: {folder / 'config.json'} names its architecture now (Qwen3ForCausalLM), "
                "so a server loads it as the causal LM")
        log(f"target: cached at {folder} (held-out loss {record.get('heldout_loss')})")
        return folder, record

    def build(tmp: Path) -> None:
        record = {"key": key, **build_target(root, tmp, scale, corpus, seed, device, log)}
        (tmp / META_NAME).write_text(json.dumps(record, indent=2), encoding="utf-8")

    cached_build(folder, build, marker=META_NAME)
    record = read_record(folder)
    log(f"target: built at {folder} in {record['build_seconds']} s, held-out loss "
        f"{record['heldout_loss']} (train {record['final_train_loss']})")
    return folder, record
