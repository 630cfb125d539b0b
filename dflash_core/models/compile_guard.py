"""torch.compile from several worker threads of one process.

torch.compile keeps process-wide flags (``torch.fx._symbolic_trace._is_fx_tracing_flag``,
``torch.compiler._is_compiling_flag``, dynamo's config) that one thread raises while it traces or
lowers a graph. A second thread that enters a compiled function in that window is taken for a
nested FX trace and fails ("Detected that you are using FX to symbolically trace a
dynamo-optimized function"): two data-parallel drafters compiling FlexAttention at once did so on
GPUs. Compiling itself is already serialised by dynamo's own lock; the call entries are not.

``SerialCompiled`` closes the window: every call of a compiled function in the process goes
through one lock, and the backward graph is compiled together with the forward (not lazily at
the first backward, which runs on autograd's device thread, outside any lock of ours). So no
compiled call ever starts while another thread compiles. A warm call holds the lock only while
it launches its kernels (microseconds to a millisecond of host time; the GPU work runs after
the lock is released), so the drafters still train at once.

``serialize_triton_autotuning`` does the same for Triton's autotuner, which the hybrid targets'
flash-linear-attention kernels go through: it keeps the call being tuned on the shared kernel
object and clears it when done, so two threads tuning the same kernel at once (two targets'
first forwards, or the evaluation's forward beside its target's) break each other's tuning.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

# One lock for the whole process: every compile of every compiled function must exclude every
# call of every other compiled function. Re-entrant: a compiled call may call another.
COMPILE_LOCK = threading.RLock()


class SerialCompiled:
    """``torch.compile(fn, **options)`` that is safe to call from any number of threads."""

    def __init__(self, fn: Callable, **options: Any):
        self._compiled = torch.compile(fn, **options)

    def __call__(self, *args: Any, **kwargs: Any):
        from torch._functorch import config as functorch_config

        with COMPILE_LOCK, functorch_config.patch(force_non_lazy_backward_lowering=True):
            return self._compiled(*args, **kwargs)


def is_compile_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a kernel failing to build
    (torch.compile's inductor lowering or codegen, dynamo's backend; Triton's compiler, or its
    runtime refusing the built kernel), as opposed to the computation."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__module__.startswith(("torch._inductor", "torch._dynamo", "triton.compiler",
                                          "triton.runtime")):
            return True
        e = e.__cause__ or e.__context__
    return False


# Separate from COMPILE_LOCK: autotuned kernels run in target threads, compiled attention in
# drafter threads; neither calls the other, so the two locks are never held together.
AUTOTUNE_LOCK = threading.RLock()


def serialize_triton_autotuning() -> bool:
    """Make every call of a ``triton.autotune`` kernel in this process take one lock (once per
    process; False when Triton is absent). A tuned kernel's call holds it while it looks up its
    config and launches; a call that tunes (a new shape key) holds it while it benchmarks, and a
    second thread that wants the same or another autotuned kernel waits meanwhile."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return False
    with AUTOTUNE_LOCK:
        if getattr(Autotuner.run, "serialized_by_dflash", False):
            return True
        original = Autotuner.run

        @functools.wraps(original)
        def run(self, *args: Any, **kwargs: Any):
            with AUTOTUNE_LOCK:
                return original(self, *args, **kwargs)
        run.serialized_by_dflash = True
        Autotuner.run = run
    return True
