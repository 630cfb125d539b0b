"""A stand-in ``vllm`` package, written into a folder put on the path, for the failures of
``--engine vllm`` that the real one cannot be made to show on this machine (another version's
speculative config, a GPU without room, a CUDA out-of-memory error, the kernel's OOM killer).
It takes the arguments eval/vllm_child.py passes and decodes every prompt into ``max_tokens``
zeros; ``FAKE_VLLM_FAIL`` picks how its ``LLM`` fails instead (``orphan-*``: after starting an
engine process of its own, its pid in ``FAKE_VLLM_PIDFILE``) (the messages are vLLM 0.32's,
printed to the log as its engine process prints them), ``FAKE_VLLM_METHODS`` the speculative
methods its config allows (comma-separated; default vLLM's dflash and dspark among others).
The real vLLM's failures are tried in tests/serve (make test-serve)."""

from __future__ import annotations

from pathlib import Path

INIT = '''
import os, signal, sys

__version__ = "0.31.9-fake"

FREE = ("Free memory on device cuda:0 (11.2/95.0 GiB) on startup is less than desired GPU "
        "memory utilization (0.9, 85.5 GiB). Decrease GPU memory utilization or reduce GPU "
        "memory used by other processes.")
KV = ("To serve at least one request with the model's max seq len (262144), (16.0 GiB KV cache "
      "is needed, which is larger than the available KV cache memory (3.5 GiB). Based on the "
      "available memory, the estimated maximum model length is 57344. Try increasing "
      "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
            "total capacity of 94.97 GiB of which 1.02 GiB is free.")


class SamplingParams:
    def __init__(self, max_tokens=16, **kw):
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, n):
        self.token_ids = [0] * n
        self.spec_decode_metrics = None


class _Output:
    def __init__(self, n):
        self.outputs = [_Completion(n)]


class LLM:
    def __init__(self, **kwargs):
        fail = os.environ.get("FAKE_VLLM_FAIL", "")
        print("INFO fake vLLM engine starting", file=sys.stderr, flush=True)
        if fail == "free":
            print(f"(EngineCore pid=1) ERROR ValueError: {FREE}", file=sys.stderr, flush=True)
        elif fail == "kv":
            print(f"(EngineCore pid=1) ERROR ValueError: {KV}", file=sys.stderr, flush=True)
        elif fail == "cuda-oom":
            print(f"(EngineCore pid=1) ERROR {CUDA_OOM}", file=sys.stderr, flush=True)
        elif fail == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fail == "argument":
            raise TypeError("EngineArgs.__init__() got an unexpected keyword argument "
                            "'per_request_spec_decode_metrics'")
        elif fail == "other":
            raise RuntimeError("something else broke in the engine")
        elif fail.startswith("orphan"):  # an engine process of its own, as vLLM starts one
            import subprocess
            import time
            engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            with open(os.environ["FAKE_VLLM_PIDFILE"], "w") as f:
                f.write(str(engine.pid))
            if fail == "orphan-hang":
                time.sleep(120)
        if fail:
            raise RuntimeError("Engine core initialization failed. See root cause above. "
                               "Failed core proc(s): {'EngineCore': 1}")
        self.kwargs = kwargs

    def generate(self, prompts, params, use_tqdm=False):
        return [_Output(p.max_tokens) for p in params]

    def get_metrics(self):
        return []
'''

CONFIG_INIT = "from vllm.config.speculative import SpeculativeConfig\n"

SPECULATIVE = '''
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

_ALLOWED = tuple(os.environ.get("FAKE_VLLM_METHODS", "ngram,eagle,dflash,dspark").split(","))
SpeculativeMethod = Literal[_ALLOWED]


@dataclass
class SpeculativeConfig:
    method: SpeculativeMethod | None = None
    model: str | None = None
    num_speculative_tokens: int | None = None
'''

ARG_UTILS = '''
from dataclasses import dataclass


@dataclass
class EngineArgs:
    model: str = ""
    speculative_config: dict | None = None
    per_request_spec_decode_metrics: str | None = None
'''

INPUTS = '''
class TokensPrompt(dict):
    def __init__(self, prompt_token_ids):
        super().__init__(prompt_token_ids=prompt_token_ids)
'''


def write_fake_vllm(root: Path) -> Path:
    """The package under ``root``/vllm; returns ``root`` (the folder to put on the path)."""
    pkg = root / "vllm"
    for rel, text in {"__init__.py": INIT, "config/__init__.py": CONFIG_INIT,
                      "config/speculative.py": SPECULATIVE, "engine/__init__.py": "",
                      "engine/arg_utils.py": ARG_UTILS, "inputs.py": INPUTS}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text, encoding="utf-8")
    return root
