"""Figures 3 and 5: the whole engine (loader -> target -> HS queue -> drafter) on GPUs with an
8B-shaped random target, synthetic variable-length data, headless; optionally with the dashboard
attached (Textual, headless driver) for the TUI-vs-headless ratio.

    python bench/training/pipeline.py --targets 0 --drafters 0 --steps 30            # one GPU, both roles
    python bench/training/pipeline.py --targets 0 --drafters 1 --steps 30            # two GPUs
    python bench/training/pipeline.py --targets 0 --drafters 0 --steps 30 --tui      # same, dashboard on
    python bench/training/pipeline.py --targets 0 --drafters 1 --steps 12 --profile 3  # where GPU time goes
    # each side alone on one GPU, on the run's own batches: the drafters (random features), and
    # the target in the engine (drafters train nothing) against the same forward outside it
    python bench/training/pipeline.py --targets 0 --drafters 0 --features random --steps 16
    python bench/training/pipeline.py --targets 0 --drafters 0 --drafter-work none --standalone 6 --steps 16
    # two nodes of one GPU each on one machine (NCCL across them; docs/multi-node.md):
    for r in 0 1; do CUDA_VISIBLE_DEVICES=$r RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
        MASTER_ADDR=127.0.0.1 MASTER_PORT=29400 python bench/training/pipeline.py --targets 0 --drafters 0 \
        --features random --steps 20 --budget 16384 > node$r.txt 2>&1 & done; wait
    # config.yaml's drafter and data sections at the 27B shape on a rehearsed 95 GiB card:
    python bench/training/pipeline.py --fixture qwen3_6_27b_config.json --shipped --gpu-memory-gib 95 \
        --targets 0 --drafters 1 --steps 20
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import env_line, gib, hf_config, random_causal_lm, use_transformers_norm, FIXTURES, ROOT
import dflash_core.models.target.model as target_mod
import dflash_core.pipeline.target_stage as target_stage
from dflash_core.planning.allocator import configure_allocator
from dflash_core.observe.bus import EventBus
from dflash_core.config import config_from_dict
from dflash_core.data import write_shards
from dflash_core.pipeline.engine import Engine
from dflash_core.observe import events
from dflash_core.observe.events import (
    HS_QUEUE, Error, GpuSample, Log, MemoryPlan, NodeStatus, QueueDepth, StepMetrics, TargetMetrics,
)

# Absent before the drafters reported their time: the script also measures older engines.
DrafterMetrics = getattr(events, "DrafterMetrics", type(None))


# --device cpu: the same run at a toy size, to check this script without a GPU.
SMOKE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 12,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000,
         "bos_token_id": None, "eos_token_id": None}


# What --standalone times after the run: the engine's target model and batches it ran.
KEPT: dict = {"model": None, "calls": []}


def fake_loader(light: bool = False):
    """load_target that builds random weights of the real shape on the GPU, with progress.
    light: only the embedding and the output head hold memory (the layers stay on the meta
    device), for runs whose target never runs its forward (--features random)."""
    def load(path, *, device="cpu", dtype=torch.bfloat16, progress=None, stop=None, **kw):
        t = time.perf_counter()
        cfg = hf_config(Path(path) / "config.json")
        if light:
            model = random_causal_lm(cfg, device="meta", dtype=torch.bfloat16)
            for m in (model.get_input_embeddings(), model.get_output_embeddings()):
                m.to_empty(device=device)
                torch.nn.init.normal_(m.weight, std=0.02)
        else:
            model = random_causal_lm(cfg, device=device, dtype=torch.bfloat16)
        if progress is not None:
            n = sum(p.numel() * p.element_size() for p in model.parameters())
            progress(bytes_loaded=n, bytes_total=n, shards_loaded=1, shards_total=1,
                     seconds=time.perf_counter() - t, done=True,
                     memory_after=(torch.cuda.memory_allocated(device)
                                   if torch.device(device).type == "cuda" else 0))
        KEPT["model"] = target_mod.TargetModel(model)
        return KEPT["model"]
    return load


def kept_features(keep: int):
    """TargetModel.features that also keeps the inputs of the engine's batches 4..4+keep (past
    kernel tuning), for --standalone."""
    real = target_mod.TargetModel.features
    seen = [0]

    def features(self, input_ids, attention_mask=None, layer_ids=None, stop=None, **kw):
        seen[0] += 1
        if 3 < seen[0] <= 3 + keep:
            KEPT["calls"].append((input_ids, attention_mask, layer_ids))
        return real(self, input_ids, attention_mask, layer_ids, stop=stop, **kw)
    return features


def time_standalone(tm) -> str:
    """The target's forward alone on the kept batches, one after another: from this thread on the
    default stream, then from a thread of its own on a stream of its own with an abort flag, as
    the engine's target stage calls it (without the engine's other threads)."""
    calls = KEPT["calls"]
    cuda = tm.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(stop=None) -> tuple[float, float]:
        ids, mask, layers = calls[0]
        tm.features(ids, mask, layers, stop=stop)  # the engine's tuning already ran; settle caches
        sync()
        t = time.perf_counter()
        tokens = 0
        for ids, mask, layers in calls:
            tm.features(ids, mask, layers, stop=stop)
            tokens += int(mask.sum()) if mask is not None else ids.numel()
        sync()
        dt = time.perf_counter() - t
        return tokens / dt, dt / len(calls)

    plain = timed()
    own: list = []

    def worker():
        if cuda:
            torch.cuda.set_stream(torch.cuda.Stream(tm.device))
        own.append(timed(threading.Event()))
    th = threading.Thread(target=worker)
    th.start()
    th.join()
    return (f"STANDALONE target alone on {len(calls)} of the run's batches: {plain[0]:,.0f} real "
            f"tokens/s ({plain[1]:.2f} s per batch); from a thread with its own stream and abort "
            f"flag: {own[0][0]:,.0f} ({own[0][1]:.2f} s per batch)")


def plan_without_target_layers() -> None:
    """With --features random the target's layers are never built, so a plan that refuses the
    run for their memory (a 27B target and its drafter on one GPU) is reported, not obeyed."""
    import dflash_core.planning.preflight as preflight
    from dflash_core.config import ConfigError
    real = preflight.check_memory

    def check_memory(*a, **k):
        try:
            return real(*a, **k)
        except ConfigError as exc:
            print(f"NOTE the memory plan counts the target's layers, not built here: {exc}")
            return {}
    preflight.check_memory = check_memory


def idle_accumulate(self, batch, features, seed, stop=None, beat=None, ready=None):
    """DrafterReplica.accumulate for --drafter-work none: wait until the batch's features exist,
    count the batch, train nothing. The optimizer steps on zero gradients (loss 0)."""
    from dflash_core.models.training.replica import Micro
    if ready is not None:
        ready.synchronize()
    out = Micro(tokens=int(batch.num_tokens), samples=len(batch), padded=int(batch.padded_tokens))
    self.sample_ids.extend(int(i) for i in batch.indices)
    self.micro.add(out)
    return out


def random_features(self, input_ids, attention_mask=None, layer_ids=None, stop=None,
                    with_last_hidden=False):
    """TargetModel.features at almost no GPU cost: random values of the real shape and dtype, so a
    drafter runs as if a stored-features source fed it (its standalone rate on these batches)."""
    ids = self._layer_ids(layer_ids)
    b, s = input_ids.shape
    width = (len(ids) + int(with_last_hidden)) * self.hidden_size
    return torch.randn(b, s, width, device=self.device, dtype=self.model.dtype)


def make_data(folder: Path, vocab: int, n: int, max_length: int):
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.8, 0.7, n), 256, 3072) * max_length / 3072
    lengths = lengths.astype(int)
    samples = []
    for L in lengths:
        p = min(int(L) // 4, 256)
        samples.append({"input_ids": rng.integers(0, vocab - 2, int(L)).tolist(),
                        "loss_mask": [0] * p + [1] * (int(L) - p)})
    write_shards(samples, folder, samples_per_shard=1000)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="0")
    ap.add_argument("--drafters", default="0")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--budget", type=int, default=32768)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--tui", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--fixture", default="qwen3_8b_config.json",
                    help="target shape from tests/fixtures")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (tiny shape)")
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--micro", type=int, default=None,
                    help="drafter.micro_block_tokens (default 32768, or config.yaml's with "
                         "--shipped; 65536 overflows one GPU holding both roles)")
    ap.add_argument("--shipped", action="store_true",
                    help="drafter and data sections from config.yaml (layers, block, anchors, "
                         "loss chunk, micro-group, token budget, lengths)")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="trace K steps after warm-up with the torch profiler; print where each "
                         "GPU's time went (timeline.py) and write the chrome trace to --trace")
    ap.add_argument("--trace", default="trace.json")
    ap.add_argument("--features", choices=("target", "random"), default="target",
                    help="random: skip the target's forward (random features of the real shape), "
                         "to measure the drafters alone on the same batches")
    ap.add_argument("--drafter-work", choices=("train", "none"), default="train",
                    help="none: drafters (one layer) take each batch once its features are done "
                         "and train nothing, to measure the targets alone inside the engine")
    ap.add_argument("--standalone", type=int, default=0, metavar="K",
                    help="after the run, time the target's forward alone on K of the batches it "
                         "ran (the engine's model, from this thread)")
    ap.add_argument("--no-balance", action="store_true",
                    help="data.balance_steps: false (batch order fully shuffled)")
    ap.add_argument("--hf-norm", action="store_true",
                    help="the drafter with transformers' eager Qwen3RMSNorm (the norm before the "
                         "fused one), for a before/after on the same code")
    ap.add_argument("--gpu-memory-gib", type=float, default=0.0,
                    help="layout.gpu_memory_gib: rehearse a smaller card")
    args = ap.parse_args()
    # Before env_line: asking for the device name initialises CUDA, and the allocator settings
    # must be in place by then (the engine would find them too late).
    print(configure_allocator().describe())
    print(env_line())
    fixture = args.fixture
    tmp = Path(tempfile.mkdtemp())
    tfolder = tmp / "target"
    tfolder.mkdir()
    tcfg = json.loads((FIXTURES / fixture).read_text())
    smoke = args.device == "cpu"
    if smoke:
        tcfg |= SMOKE
        args.budget, args.anchors, args.samples = 2048, 16, 200
    max_length = 256 if smoke else 3072
    (tfolder / "config.json").write_text(json.dumps(tcfg))
    # What the engine's target stage calls.
    target_stage.load_target = fake_loader(light=args.features == "random")
    if args.hf_norm:
        use_transformers_norm()
    if args.features == "random":
        target_mod.TargetModel.features = random_features
        plan_without_target_layers()
    elif args.standalone:
        target_mod.TargetModel.features = kept_features(args.standalone)
    if args.drafter_work == "none":
        import dflash_core.models.training.replica as replica_mod
        replica_mod.DrafterReplica.accumulate = idle_accumulate
    vocab = tcfg.get("text_config", tcfg)["vocab_size"]  # multimodal configs nest it
    t = time.perf_counter()
    make_data(tmp / "data", vocab, args.samples, max_length)
    print(f"data made in {time.perf_counter() - t:.0f} s")
    drafter = {"objective": "dflash", "num_layers": 5, "block_size": 16,
               "num_anchors": args.anchors, "micro_block_tokens": 32768, "loss_chunk": 8192}
    data = {"token_budget": args.budget, "max_seqs_per_batch": 64, "max_length": max_length}
    if args.shipped:
        shipped = yaml.safe_load((ROOT / "config.yaml").read_text())
        drafter = shipped["drafter"]
        data = {k: shipped["data"][k] for k in ("token_budget", "max_seqs_per_batch",
                                                "max_length", "prefetch_batches")}
    data["balance_steps"] = not args.no_balance
    if args.micro:
        drafter["micro_block_tokens"] = args.micro
    if args.drafter_work == "none":
        drafter["num_layers"] = 1  # it trains nothing; only its memory would be in the way
    print(f"drafter {drafter}\ndata {data}")
    cfg = config_from_dict({
        "run": {"name": "bench", "output_dir": str(tmp / "runs"), "max_steps": args.steps},
        "target": {"path": str(tfolder), "dtype": "bfloat16"},
        "drafter": drafter,
        "data": {"path": str(tmp / "data"), "eval_prompts": 0, **data},
        "layout": {"device": args.device, "targets": [int(x) for x in args.targets.split(",")],
                   "drafters": [int(x) for x in args.drafters.split(",")], "hs_queue": 4,
                   "gpu_memory_gib": args.gpu_memory_gib},
        "optim": {"epochs": 1}, "checkpoint": {"every": 0, "on_abort": False},
        "telemetry": {"interval_s": 0.5},
    })
    devices = sorted(set(cfg.layout.targets) | set(cfg.layout.drafters))
    bus = EventBus()
    steps, queues, targets, gpus, plans, drafters, nodes = [], [], [], [], [], [], []
    t0 = time.monotonic()

    def tap(ev):
        if isinstance(ev, StepMetrics):
            steps.append((time.monotonic() - t0, ev))
            # As it happens, so a run cut short by a time limit still reports its steps.
            mem = ""
            if not smoke:  # peaks so far, so a run cut short by a time limit still has them
                mem = "; " + ", ".join(
                    f"cuda:{d} alloc {gib(torch.cuda.max_memory_allocated(d))} reserved "
                    f"{gib(torch.cuda.max_memory_reserved(d))} nvml "
                    f"{gib(max((g.mem_used for _, g in gpus if g.index == d), default=0))}"
                    for d in devices)
            print(f"  step {ev.step} at {steps[-1][0]:.1f} s: loss {ev.loss:.3f}, "
                  f"{ev.samples} samples{mem}", flush=True)
        elif isinstance(ev, QueueDepth):
            queues.append((time.monotonic() - t0, ev.name, ev.depth, ev.capacity))
        elif isinstance(ev, TargetMetrics):
            targets.append(ev)
        elif isinstance(ev, DrafterMetrics) and ev is not None:
            drafters.append(ev)
        elif isinstance(ev, GpuSample):
            gpus.append((time.monotonic() - t0, ev))
        elif isinstance(ev, MemoryPlan):
            plans.append(ev)
        elif isinstance(ev, NodeStatus):  # under torchrun with several nodes (docs/multi-node.md)
            nodes.append(ev)
        elif isinstance(ev, Log) and ev.level in ("warning", "error"):
            print(f"{ev.level.upper()} {ev.source}: {ev.message}", flush=True)
        elif isinstance(ev, Error):
            print(f"ERROR {ev.kind} {ev.source} {ev.phase}: {ev.message}\n  hint: {ev.hint}\n"
                  f"{ev.traceback or ''}", flush=True)
    bus.tap(tap)
    engine = Engine(cfg, bus=bus)
    if args.tui:
        from dflash_tui.app import DFlashApp

        app = DFlashApp(engine, run_dir=None, start=True)

        async def drive():
            async with app.run_test(size=(160, 48)) as pilot:
                while engine.state not in ("finished", "failed", "aborted"):
                    await pilot.pause(0.5)
        import asyncio
        asyncio.run(drive())
    else:
        engine.start()
        if args.profile:
            profile_steps(engine, steps, args.profile, Path(args.trace))
    final = engine.wait()
    standalone = time_standalone(KEPT["model"]) if args.standalone and KEPT["calls"] else ""
    for d in sorted(set(cfg.layout.targets) | set(cfg.layout.drafters)) if not smoke else []:
        st = torch.cuda.memory_stats(d)
        print(f"cuda:{d} peak allocated {gib(torch.cuda.max_memory_allocated(d))}, peak reserved "
              f"{gib(torch.cuda.max_memory_reserved(d))}, allocator retries "
              f"{st.get('num_alloc_retries', 0)}, OOMs {st.get('num_ooms', 0)}")
    print(f"final state {final}, {len(steps)} steps")
    train = [(t, s) for t, s in steps if s.step > 3]  # skip compile/warm-up steps
    if len(train) >= 2:
        dt = train[-1][0] - train[0][0]
        samples = sum(s.samples for _, s in train[1:])
        toks = sum(s.tokens_per_s for _, s in train) / len(train)
        print(f"RESULT samples/s {samples / dt:.2f} over {len(train) - 1} steps "
              f"(mean tokens/s {toks:,.0f}); drafter waited {np.mean([s.drafter_wait_frac for _, s in train]):.0%}, "
              f"targets blocked {np.mean([s.target_blocked_frac for _, s in train]):.0%}; "
              f"loss {train[0][1].loss:.3f} -> {train[-1][1].loss:.3f}")
    # Where each stage's time went, past the first reports (warm-up and compilation).
    for w, mean, n in steady_reports(targets):
        print(f"{w}: tokens/s {mean('tokens_per_s'):,.0f}, blocked on a full HS queue "
              f"{mean('blocked_frac'):.0%}, starved {mean('starved_frac'):.0%} ({n} reports)")
    for w, mean, n in steady_reports(drafters):
        print(f"{w}: waiting for features {mean('waiting_frac'):.0%}, compute "
              f"{mean('compute_frac'):.0%}, barrier {mean('barrier_frac'):.0%}, optimizer step "
              f"{mean('step_frac'):.0%} ({n} reports)")
    # NVML busy over the whole run counts loading and compilation as idle time; the steady share
    # is over the same steps as samples/s.
    t_from, t_to = (train[0][0], train[-1][0]) if len(train) >= 2 else (0.0, float("inf"))
    for g in sorted({g.index for _, g in gpus}):
        util = [x.util for _, x in gpus if x.index == g and x.util >= 0]
        steady = [x.util for t, x in gpus if x.index == g and x.util >= 0 and t_from <= t <= t_to]
        mem = [x.mem_used for _, x in gpus if x.index == g]
        if util:
            print(f"GPU {g}: busy (NVML util) over steps 4-{steps[-1][1].step if steps else 0} "
                  f"{np.mean(steady) if steady else float('nan'):.0f}% ({len(steady)} samples); "
                  f"whole run {np.mean(util):.0f}% ({len(util)}), max used {gib(max(mem))}")
    for k in sorted({n.node for n in nodes}):
        ns = [n for n in nodes if n.node == k and n.step > 4]
        if ns:
            print(f"node {k}: all-reduce across nodes {np.mean([n.allreduce_s for n in ns]) * 1e3:.1f} ms "
                  f"per step (mean of {len(ns)}, max {max(n.allreduce_s for n in ns) * 1e3:.1f}), "
                  f"its drafters {np.mean([n.samples_per_s for n in ns]):.2f} samples/s")
    for p in plans:
        for row in p.rows:
            print(f"plan {row['device']} {row['role']}: {gib(row['total'])} "
                  + ", ".join(f"{k} {gib(v)}" for k, v in row["components"].items()))
    if standalone:
        print(standalone)
    hs = [(round(t, 1), d) for t, n, d, c in queues if n == HS_QUEUE]
    print("HS queue depth over time (s, depth):", hs[:: max(1, len(hs) // 20)])
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": [(t, s.to_dict()) for t, s in steps],
                                              "queues": queues}))


def steady_reports(reports: list):
    """Per worker, past its first two reports (warm-up, compilation): (worker, mean of a field,
    reports left)."""
    for w in sorted({m.worker for m in reports}):
        ms = [m for m in reports if m.worker == w][2:]
        if ms:
            yield w, (lambda field, ms=ms: float(np.mean([getattr(m, field) for m in ms]))), len(ms)


def profile_steps(engine, steps: list, k: int, out: Path, after: int = 5) -> None:
    """Trace k optimizer steps once ``after`` steps (compilation, warm-up) are done."""
    from torch.profiler import ProfilerActivity, profile

    from timeline import summarize

    def wait_for(n: int) -> bool:
        while len(steps) < n:
            if engine.state in ("finished", "failed", "aborted"):
                return False
            time.sleep(0.05)
        return True
    if not wait_for(after):
        return
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:  # the workers' ops, not only this thread's (a newer profiler option)
        every = {"experimental_config": torch._C._profiler._ExperimentalConfig(
            profile_all_threads=True)}
    except (AttributeError, TypeError):
        every = {}
    prof = profile(activities=acts, **every)
    prof.start()
    done = wait_for(after + k)
    prof.stop()
    prof.export_chrome_trace(str(out))
    print(f"trace of steps {after + 1}..{len(steps)}{'' if done else ' (run ended)'}: {out}")
    print(summarize(json.loads(out.read_text())), flush=True)


if __name__ == "__main__":
    main()
