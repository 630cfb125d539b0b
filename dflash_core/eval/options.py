"""What an evaluation is asked (``EvalOptions``: the eval verb's flags), the checks of their
values alone, and their first resolution, before anything loads: the device, the dtype, the
target's folder and its identity (runner.Evaluation checks the rest)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_core.eval.errors import EvalInputError


@dataclass
class EvalOptions:
    target: str
    drafters: list[str]
    prompts: list[str]  # NAME=FILE.jsonl
    tokenizer: str | None = None  # default: the target's folder
    chat_template: str | None = None  # a jinja file replacing the tokenizer's
    thinking: str | None = None  # "on" | "off" | None (the template's default)
    temperature: float = 0.0  # 0: greedy, with the lossless check
    seed: int = 0
    max_new_tokens: int = 256
    batch: int = 8  # prompts decoded together
    cache: bool = False  # the target's cache, one prompt at a time (eval.cache's path)
    limit: int = 0  # the first N prompts of each set (0: all)
    out: str = "eval-results"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    drafter_dtype: str | None = None  # None: each drafter's served dtype (drafter_dtype.py)
    # Prices every run checkpoint's GPU-hours (comparing drafters at one price, today's);
    # 0: each at the price its run recorded, else its run folder's cost.gpu_hour_price.
    gpu_hour_price: float = 0.0
    currency: str = ""  # with gpu_hour_price ("": the one the run recorded)
    trust_remote_code: bool = False  # a target or tokenizer of its folder's own code may run
    # NAME=FILE.jsonl of long-prompt sets (prompt_sets.py: whole conversations, an answer's start)
    long_prompts: list[str] = field(default_factory=list)
    # "ours" (this engine alone) or "vllm": vLLM's offline engine decodes the same prompts too,
    # the drafter as its speculative model (served.py); its figures beside ours
    engine: str = "ours"
    verbose: bool = False  # engine vllm: its log on the terminal (else in OUT/vllm/)
    # engine vllm: its memory, a share of the GPU ("0.8", its gpu_memory_utilization) or a KV
    # cache size ("4GiB"); None: what is free when it starts (at most 0.9), 1 GiB on the CPU
    vllm_memory: str | None = None
    # The target as a target group (grouped.py; a run's target.gpus_per_copy, target.parallel,
    # target.expert_parallel): 1 = whole on --device; K = its ranks on --target-gpus (default
    # GPUs 0..K-1; on the CPU K processes), the drafters on --device
    gpus_per_copy: int = 1
    target_gpus: str = ""  # "0,1,2,3"
    parallel: str = "sharded"
    expert_parallel: bool = True


def check_values(opts: EvalOptions) -> None:
    """Refuse a value no evaluation can run with, in the flag's words."""
    if opts.max_new_tokens < 1:
        raise EvalInputError(f"--max-new-tokens {opts.max_new_tokens}: must be >= 1")
    if opts.batch < 1:
        raise EvalInputError(f"--batch {opts.batch}: must be >= 1")
    if not opts.temperature >= 0:
        raise EvalInputError(f"--temperature {opts.temperature}: must be >= 0")
    if not opts.drafters:
        raise EvalInputError("no --drafter to evaluate", hint="pass --drafter CHECKPOINT "
                             "(twice to compare two)")
    if not opts.prompts and not opts.long_prompts:
        raise EvalInputError("no --prompts set", hint="pass --prompts NAME=FILE.jsonl (or "
                             "--long-prompts NAME=FILE.jsonl)")


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError as exc:
        raise EvalInputError(f"--device {spec!r}: not a device",
                             hint="use auto, cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EvalInputError(f"--device {spec}: no CUDA GPU is visible",
                             hint="use --device cpu (or auto)")
    if dev.type not in ("cpu", "cuda"):
        raise EvalInputError(f"--device {spec}: use auto, cpu, cuda or cuda:N")
    return dev


def resolve_dtype(spec: str, device: torch.device) -> str:
    if spec == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    if spec not in ("bfloat16", "float16", "float32"):
        raise EvalInputError(f"--dtype {spec!r}: use auto, bfloat16, float16 or float32")
    return spec


def target_folder(spec: str) -> Path:
    if spec == "builtin:tiny":
        from dflash_core.demo import ensure_tiny_target

        return ensure_tiny_target()
    folder = Path(spec).expanduser()
    if not (folder / "config.json").is_file():
        raise EvalInputError(f"--target {spec}: no config.json there",
                             hint="pass the target's model folder (or builtin:tiny)")
    return folder


def target_id(folder: Path) -> str:
    """The target by its config.json and its weight files' names and sizes."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]
