"""Compiled functions called from several threads at once (data-parallel drafters)."""

import threading

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from dflash_core.models.block_attention import chunked_block_attention, flex_block_attention
from dflash_core.models.compile_guard import SerialCompiled
from tests.core.models.test_block_attention import inputs


class _SlowTrace(torch.nn.Module):
    """Stands in for a lowering that FX-traces (FlexAttention's backward does on GPUs): while it
    runs, the process-wide FX tracing flag is up."""

    def __init__(self, entered: threading.Event, release: threading.Event):
        super().__init__()
        self.entered, self.release = entered, release

    def forward(self, x):
        self.entered.set()
        self.release.wait(20)
        return x


def _tracing_backend(entered, release):
    def fw(gm, example_inputs):
        return make_boxed_func(gm)

    def bw(gm, example_inputs):
        torch.fx.symbolic_trace(_SlowTrace(entered, release))
        return make_boxed_func(gm)

    return aot_autograd(fw_compiler=fw, bw_compiler=bw)


def _race(wrap) -> list[BaseException]:
    """Thread A compiles a function with a backward; thread B calls another compiled function
    while A's compile is inside its FX trace. Returns B's errors."""
    entered, release = threading.Event(), threading.Event()
    slow = wrap(lambda x: (x.sin() * 3).sum(), backend=_tracing_backend(entered, release))
    warm = wrap(lambda x: x * 2 + 1, backend="eager")
    warm(torch.randn(4))
    errors: list[BaseException] = []

    def a():
        x = torch.randn(5, requires_grad=True)
        slow(x).backward()

    def b():
        try:
            assert torch.equal(warm(torch.ones(4)), torch.full((4,), 3.0))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    ta = threading.Thread(target=a)
    ta.start()
    assert entered.wait(20), "the stand-in compile never ran"
    tb = threading.Thread(target=b)
    tb.start()
    tb.join(0.5)  # B either failed at once or waits for A's compile to end
    release.set()
    ta.join(20)
    tb.join(20)
    assert not ta.is_alive() and not tb.is_alive()
    return errors


def test_plain_torch_compile_fails_when_threads_overlap_a_compile():
    # The failure the guard exists for, reproduced with torch.compile alone: if this starts to
    # pass, torch made compiled calls thread-safe and the guard can go.
    errors = _race(torch.compile)
    assert errors and "symbolically trace a dynamo-optimized function" in str(errors[0])


def test_serial_compiled_call_waits_for_a_compile_in_another_thread():
    assert _race(SerialCompiled) == []


def test_two_threads_run_compiled_block_attention_at_once():
    # Two drafter threads' first calls of the compiled FlexAttention, at the same moment; both
    # must get the chunked path's answer (CPU: forward only, FlexAttention has no CPU backward).
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    go = threading.Barrier(2)
    args = {i: inputs(S=40, A=3, B=4, d=16, seed=i) for i in range(2)}

    def work(i):
        try:
            go.wait(10)
            results[i] = flex_block_attention(*args[i], compile=True)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == []
    for i in range(2):
        assert torch.allclose(results[i], chunked_block_attention(*args[i]), atol=1e-5)


def _stand_in_triton(monkeypatch):
    """A ``triton.runtime.autotuner`` whose Autotuner keeps the call being tuned on the shared
    kernel object and clears it when done, as Triton's does (the CPU machine has no Triton)."""
    import sys
    import time
    import types

    class Autotuner:
        def __init__(self):
            self.nargs = None
            self.cache = {}

        def run(self, key):
            if key not in self.cache:
                self.nargs = {"key": key}
                time.sleep(0.05)  # benchmarking the configs: the GPU works, the GIL is free
                self.cache[key] = self.nargs["key"]  # fails if another call cleared nargs
                self.nargs = None
            return self.cache[key]
    mod = types.ModuleType("triton.runtime.autotuner")
    mod.Autotuner = Autotuner
    for name, m in (("triton", types.ModuleType("triton")),
                    ("triton.runtime", types.ModuleType("triton.runtime")),
                    ("triton.runtime.autotuner", mod)):
        monkeypatch.setitem(sys.modules, name, m)
    return Autotuner


def _tune_in_two_threads(kernel) -> list:
    errors, meet = [], threading.Barrier(2)

    def call(key):
        meet.wait()
        try:
            kernel.run(key)
        except Exception as exc:  # noqa: BLE001 - collected for the assert
            errors.append(exc)
    threads = [threading.Thread(target=call, args=(k,)) for k in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return errors


def test_two_threads_tuning_one_triton_kernel_break_each_other_unless_serialized(monkeypatch):
    from dflash_core.models import compile_guard

    Autotuner = _stand_in_triton(monkeypatch)
    assert _tune_in_two_threads(Autotuner()), "the stand-in should show the race"
    assert compile_guard.serialize_triton_autotuning()
    assert compile_guard.serialize_triton_autotuning()  # once per process: not wrapped twice
    assert not hasattr(Autotuner.run.__wrapped__, "__wrapped__")
    kernel = Autotuner()
    assert _tune_in_two_threads(kernel) == []
    assert kernel.cache == {"a": "a", "b": "b"}


def test_without_triton_nothing_is_patched(monkeypatch):
    import sys

    from dflash_core.models import compile_guard

    monkeypatch.setitem(sys.modules, "triton", None)  # import fails, as on the CPU machine
    assert compile_guard.serialize_triton_autotuning() is False
