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
"""

from __future__ import annotations

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
