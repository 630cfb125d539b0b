"""The GPU code paths: compiled FlexAttention, bf16 autocast training, a whole engine run."""

import threading
from pathlib import Path

import pytest
import torch

from dflash_core.models.block_attention import chunked_block_attention, flex_block_attention
from dflash_core.observe.events import Error, EvalResult, Log, StepMetrics
from tests.core.engine_fixtures import make_config, make_data, make_target
from tests.core.models.test_block_attention import dense, inputs
from tests.gpu.watch import Watched, watch_flex


def drafter_on_gpu(tmp_path: Path, n_batches: int):
    """A tiny target's config on cuda:0, with n_batches of its batches, their bf16 features and
    an initial drafter: (cfg, gpu, target model, batches, features, drafter)."""
    from tests.core.models.training.test_trainer import drafter_setup

    target = make_target(tmp_path / "target", head_dim=16)
    data = make_data(tmp_path / "data")
    cfg = make_config(tmp_path, target, data, layout__device="cuda")
    gpu = torch.device("cuda", 0)
    return (cfg, gpu, *drafter_setup(cfg, target, data, n_batches, gpu, "bfloat16"))


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_flex_equals_dense_on_gpu(causal):
    """``causal``: a folder's is_causal: true (models/served_keys.py) through the compiled kernel,
    whose tile map then has partial tiles inside the blocks."""
    args = [a.cuda() if torch.is_tensor(a) else a for a in inputs(S=700, A=40, B=16, d=64, seed=4)]
    want = dense(*args, causal=causal)
    got = flex_block_attention(*args, compile=True, causal=causal)
    assert torch.allclose(got, want, atol=2e-5)
    assert torch.allclose(chunked_block_attention(*args, causal=causal), want, atol=2e-5)


def test_engine_trains_on_one_gpu_and_frees_memory(tmp_path: Path, monkeypatch):
    flex_calls, _ = watch_flex(monkeypatch)
    target = make_target(tmp_path / "target", head_dim=16)
    data = make_data(tmp_path / "data")
    cfg = make_config(tmp_path, target, data, layout__device="cuda", target__dtype="bfloat16")
    run = Watched()
    before_threads = {t.name for t in threading.enumerate()}
    base = torch.cuda.memory_allocated()
    engine = run.run(cfg, keep=True)
    steps = run.of(StepMetrics)
    assert len(steps) == cfg.run.max_steps
    assert flex_calls, "the drafter did not run FlexAttention on the GPU"
    assert all(torch.isfinite(torch.tensor(s.loss)) for s in steps)
    for _ in range(3):  # restart resumes and frees memory each time
        engine.restart()
        threading.Event().wait(0.5)
        assert engine.wait(300) in ("finished", "aborted")
    assert torch.cuda.memory_allocated() - base < 16 * 2**20
    left = {t.name for t in threading.enumerate()} - before_threads
    assert not {n for n in left if n.split("-")[0] in ("target", "drafter", "loader", "engine")}


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="two drafters need two GPUs (a layout never repeats a device)")
def test_engine_trains_two_data_parallel_drafters(tmp_path: Path):
    # Both drafters compile FlexAttention in the same first moments (the launch that failed with
    # "FX to symbolically trace a dynamo-optimized function"). The target shares GPU 0.
    drafters = [0, 1]
    target = make_target(tmp_path / "target", head_dim=16)
    data = make_data(tmp_path / "data")
    cfg = make_config(tmp_path, target, data, layout__device="cuda", target__dtype="bfloat16",
                      layout__drafters=drafters, run__max_steps=8)
    run = Watched()
    run.run(cfg)
    assert run.of(Error) == []
    steps = run.of(StepMetrics)
    assert len(steps) == cfg.run.max_steps
    assert all(torch.isfinite(torch.tensor(s.loss)) for s in steps)


def test_two_drafter_threads_compile_and_train_at_once_on_one_gpu(tmp_path: Path):
    # The data-parallel launch failure is a race between threads (one thread's lazy backward
    # compile seen by another's compiled call), not between devices: two replicas on one GPU,
    # each driven by its own thread through their first compiled steps, reproduce it on a
    # one-GPU machine.
    from dflash_core.models.training.trainer import make_replicas, reduce_and_step
    from dflash_core.pipeline.step_barrier import StepBarrier
    from tests.core.models.training.test_trainer import head_copies

    cfg, gpu, tm, batches, feats, init = drafter_on_gpu(tmp_path, 6)
    pair = make_replicas(init, [gpu, gpu], cfg.drafter, cfg.optim, *head_copies(tm))
    stop = threading.Event()
    barrier = StepBarrier(2, stop)
    results, failures = [], []

    def work(rank: int) -> None:
        try:
            for i in range(rank, len(batches), 2):
                pair[rank].accumulate(batches[i], feats[i], cfg.run.seed)
                barrier.arrive(lambda: results.append(reduce_and_step(pair, len(results), 10)))
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            failures.append(repr(exc))
            stop.set()

    threads = [threading.Thread(target=work, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert failures == []
    assert len(results) == 3 and all(torch.isfinite(torch.tensor(r.loss)) for r in results)
    for a, b in zip(pair[0].drafter.parameters(), pair[1].drafter.parameters()):
        assert torch.equal(a, b)


def syncs_in(seen) -> list[str]:
    """The synchronising calls torch.cuda's sync debug mode warned about, with where they were."""
    return [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}" for w in seen
            if "called a synchronizing" in str(w.message)]


def test_a_drafter_step_synchronises_with_the_gpu_once(tmp_path: Path):
    # The drafter GPU is the bottleneck: its host thread must queue a whole step's work without
    # waiting for the GPU, then read the step's numbers in one synchronisation.
    import warnings

    from dflash_core.models.training.handoff import ready_event
    from dflash_core.models.training.replica import ANCHOR_PAD, prepare_batch
    from dflash_core.models.training.trainer import make_replicas, reduce_and_step
    from tests.core.models.training.test_trainer import head_copies

    cfg, gpu, tm, batches, feats, init = drafter_on_gpu(tmp_path, 3)
    # As the loader hands them over: anchors and labels made, pinned.
    batches = [prepare_batch(b, cfg.drafter.num_anchors, 4, cfg.run.seed, pad_to=ANCHOR_PAD).pin()
               for b in batches]
    (rep,) = make_replicas(init, [gpu], cfg.drafter, cfg.optim, *head_copies(tm))
    for b, f in zip(batches[:2], feats[:2]):  # warm-up: compilation synchronises, and may
        rep.accumulate(b, f, cfg.run.seed, ready=ready_event(f))
        reduce_and_step([rep], 0, 10)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            rep.accumulate(batches[2], feats[2], cfg.run.seed, ready=ready_event(feats[2]))
            in_accumulate = syncs_in(seen)
            res = reduce_and_step([rep], 2, 10)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert in_accumulate == [], in_accumulate
    assert len(syncs_in(seen)) == 1, syncs_in(seen)
    assert res.samples == len(batches[2]) and torch.isfinite(torch.tensor(res.loss))


@pytest.mark.parametrize("S", [5, 127, 128, 129, 300])
def test_compiled_flex_equals_dense_for_one_drafted_block(S):
    # The exact-tau evaluation drafts one block after the whole context (anchor = S, 8 query rows
    # in a 128-row tile): a shape the training batches never have. On an H200 the demo's exact
    # tau ran below the CPU run's while teacher-forced tau matched; this pins the kernel down.
    g = torch.Generator().manual_seed(S)
    B, d, h, hkv = 8, 32, 4, 2
    r = lambda *s: torch.randn(*s, generator=g).cuda()  # noqa: E731
    args = (r(1, h, B, d), r(1, hkv, S, d), r(1, hkv, S, d), r(1, hkv, B, d), r(1, hkv, B, d),
            torch.tensor([[S]], device="cuda"), B, d ** -0.5)
    want = dense(*args)
    assert torch.allclose(flex_block_attention(*args, compile=True), want, atol=2e-5)


def test_a_gpu_run_evaluates_without_compiling_its_attention(tmp_path: Path, monkeypatch):
    # At step 200 of the demo on an H200, inductor found no kernel for compiled FlexAttention at
    # one of the evaluation's shapes (NoValidChoicesError). Training uses it; the evaluation
    # must not (no flex call without gradients), and the run says nothing about it.
    in_training, outside = watch_flex(monkeypatch)
    target = make_target(tmp_path / "target", head_dim=16)
    data = make_data(tmp_path / "data")
    cfg = make_config(tmp_path, target, data, layout__device="cuda", run__max_steps=4,
                      eval__every=2)
    run = Watched()
    run.run(cfg)
    evals = run.of(EvalResult)
    assert [e.step for e in evals] == [2, 4] and all(e.tau >= 1.0 for e in evals)
    assert in_training and not outside
    assert not [e for e in run.of(Log) if "compiled attention" in e.message]
