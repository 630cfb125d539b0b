"""Issue 47: the memory plan against the measured peak of one drafter step, one sample of 8k-128k
tokens, under a card limit: per case (shape, objective, length) the plan's GiB and its phases,
the peak measured in each phase of the step, their ratio, the step time, or OOM. One JSON line a
case, then a table; cases the plan refuses are reported, not run (--run-refused runs them too).

    # on one H200, the 96 GB card rehearsed (the default), one process, a few minutes:
    python bench/training/plan_vs_peak.py --gpu-memory-gib 95 | tee plan_vs_peak.jsonl
    # the layers kept, then recomputed, whatever the plan would pick (calibrating each)
    python bench/training/plan_vs_peak.py --recompute off --run-refused
    python bench/training/plan_vs_peak.py --recompute on
    # the plan alone (no GPU): what preflight accepts, and how long a sample fits
    python bench/training/plan_vs_peak.py --plan-only
    # a CPU smoke run of this script (tiny shape; no peaks there)
    python bench/training/plan_vs_peak.py --device cpu --shapes tiny --lengths 96,192 --anchors 8

Each case trains the engine's replica (DrafterReplica.accumulate, reduce_and_step) on one sample
of the length with random features, with the drafter config preflight would run: 8B 5 layers,
27B 8 layers (the seed's drafter), micro_block_tokens 8192, the loss chunk of the config's
defaults (DFlash 4096, DSpark 1024), drafter.recompute as the plan resolves it (--recompute).
Where those sizes do not fit, the case runs with the ones preflight picks under layout.auto_fit
(its "fitted"). A drafter is built once per shape and objective (its optimizer state then exists,
as in a run); each case runs --warmup untimed steps, then one timed step whose peaks are read.

The phases, marked as the replica runs, each the peak allocated since the last mark:
forward (the drafter's forward), loss (the loss's forward), loss backward (until the gradient of
the final states exists: the loss chunk's recompute), backward (the layers' backward), optimizer.
They compare with the plan's phases (planning/drafter_memory.py): forward, loss (the larger of
loss and loss backward), backward. Each plan term is in the line too, so a term that is off
shows in the phase where it lives. "held" is what was allocated before the step (weights,
gradients, optimizer state, the frozen head, the features).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/training: drafter_step.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import env_line, hf_config  # noqa: E402
from drafter_step import LAYER_IDS, SHAPES, batch_of, sync, watch  # noqa: E402

from dflash_core.anchor_counts import ANCHOR_PAD  # noqa: E402
from dflash_core.config import ConfigError, config_from_dict, set_key_value  # noqa: E402
from dflash_core.families.registry import settings as family_settings  # noqa: E402
from dflash_core.models import registry as drafter_kinds  # noqa: E402
from dflash_core.models.target.shape import model_shape  # noqa: E402
from dflash_core.models.training.replica import prepare_batch  # noqa: E402
from dflash_core.models.training.trainer import make_replicas, reduce_and_step  # noqa: E402
from dflash_core.planning.drafter_memory import drafter_phases  # noqa: E402
from dflash_core.planning.memory import MARGIN_NAMES, fit_sizes, plan_memory  # noqa: E402
from dflash_core.planning.sample_length import longest_sample  # noqa: E402

GiB = 2 ** 30
LAYERS = {"8B": 5, "27B": 8, "tiny": 2}  # the drafters the issue names: 8B's 5, the seed's 8
# Per objective: (block size, loss chunk), the config's defaults (config.yaml ships 4096).
OBJECTIVES = {"dflash": (16, 4096), "dspark": (7, 1024)}
DRAFTER, TARGET = "cuda:0", "cuda:1"  # the plan's devices: one drafter GPU fed by one target


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8B,27B", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--objectives", default="dflash,dspark", help="comma list of dflash, dspark")
    ap.add_argument("--lengths", default="8192,32768,65536,131072",
                    help="tokens of the one sample of each case, comma list")
    ap.add_argument("--gpu-memory-gib", type=float, default=95.0,
                    help="the card limit the plan and the step run under (95: a 96 GB card)")
    ap.add_argument("--anchors", type=int, default=512, help="drafter.num_anchors")
    ap.add_argument("--anchors-per-1k", type=float, default=0.0,
                    help="drafter.anchors_per_1k_tokens (0: a count)")
    ap.add_argument("--micro", type=int, default=8192, help="drafter.micro_block_tokens")
    ap.add_argument("--loss-chunk", type=int, default=None,
                    help="drafter.loss_chunk (default: dflash 4096, dspark 1024)")
    ap.add_argument("--recompute", choices=("auto", "on", "off"), default="auto",
                    help="drafter.recompute (auto: as the plan resolves it per case)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps a case first")
    ap.add_argument("--run-refused", action="store_true",
                    help="run the cases the plan refuses too (does the refusal hold?)")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="start no case after this many seconds (the rest are reported)")
    ap.add_argument("--plan-only", action="store_true", help="no step: the plan per case, and "
                    "the longest sample per shape and objective")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a smoke run of this script (--shapes tiny)")
    args = ap.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    args.objectives = [s.strip() for s in args.objectives.split(",") if s.strip()]
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--lengths {args.lengths!r}: expected tokens, e.g. 8192,32768")
    bad = ([s for s in args.shapes if s not in SHAPES]
           + [o for o in args.objectives if o not in OBJECTIVES])
    if bad or not args.shapes or not args.objectives:
        ap.error(f"unknown {bad}: shapes {', '.join(SHAPES)}; objectives "
                 f"{', '.join(OBJECTIVES)}")
    if not args.lengths or min(args.lengths) < 2:
        ap.error("--lengths: each sample needs 2+ tokens")
    for name in ("anchors", "micro", "gpu_memory_gib"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.warmup < 0 or args.anchors_per_1k < 0:
        ap.error("--warmup and --anchors-per-1k must be >= 0")
    try:  # the config refuses what the engine would
        for shape in args.shapes:
            for objective in args.objectives:
                case_config(args, shape, objective, max(args.lengths))
    except ConfigError as exc:
        ap.error(f"{exc} ({exc.hint})" if exc.hint else str(exc))
    if args.device == "cuda" and not args.plan_only and not torch.cuda.is_available():
        ap.error("no CUDA device here: --plan-only, or --device cpu --shapes tiny for a smoke "
                 "run")
    return args


def case_config(args, shape: str, objective: str, length: int):
    """The engine config of a case: one sample of ``length`` tokens a batch, one queued."""
    block, chunk = OBJECTIVES[objective]
    drafter = {"objective": objective, "num_layers": LAYERS[shape], "block_size": block,
               "num_anchors": args.anchors, "anchors_per_1k_tokens": args.anchors_per_1k,
               "micro_block_tokens": args.micro, "recompute": args.recompute,
               "loss_chunk": args.loss_chunk or chunk}
    return config_from_dict({
        "drafter": drafter,
        "data": {"token_budget": length, "max_length": length, "max_seqs_per_batch": 1},
        "layout": {"device": "cuda", "targets": [1], "drafters": [0], "hs_queue": 1}})


def gib(n) -> float | None:
    return None if n is None else round(n / GiB, 2)


def plan_case(args, shape: str, objective: str, length: int) -> tuple[dict, object]:
    """The plan's side of a case (the drafter GPU under the card limit) and its config, as
    preflight with layout.auto_fit would run it: the sizes that fit when the configured ones do
    not ("fitted"), drafter.recompute resolved."""
    cfg = case_config(args, shape, objective, length)
    hf = SHAPES[shape]
    cap = {DRAFTER: int(args.gpu_memory_gib * GiB)}  # the target GPU's row: said, not run
    plan = plan_memory(cfg, hf, cap, cap)
    fitted = {} if plan.fits else fit_sizes(cfg, hf, cap, cap)
    for key, value in (fitted or {}).items():
        set_key_value(cfg, key, value)
    if fitted:
        plan = plan_memory(cfg, hf, cap, cap)
    row, target = plan.row(DRAFTER), plan.row(TARGET)
    free = int(args.gpu_memory_gib * GiB)
    margin = sum(row.components.get(n, 0) for n in MARGIN_NAMES)
    phases = drafter_phases(cfg, model_shape(hf), hf, True, plan.recompute)
    cfg.drafter.recompute = "on" if plan.recompute else "off"
    return {
        "shape": shape, "objective": objective, "seq_len": length, "layers": LAYERS[shape],
        "anchors": args.anchors, "anchors_per_1k": args.anchors_per_1k, "micro": args.micro,
        "loss_chunk": cfg.drafter.loss_chunk, "recompute": plan.recompute,
        "fitted": fitted, "cap_gib": args.gpu_memory_gib, "plan_gib": gib(row.total),
        "plan_tensors_gib": gib(row.total - margin), "plan_fits": row.fits,
        "plan_peak_phase": plan.drafter_peak,
        "plan_without_recompute_gib": gib(plan.without_recompute),
        "plan_phases_gib": {ph: gib(sum(t.values())) for ph, t in phases.items()},
        "plan_terms_gib": {ph: {k: gib(v) for k, v in t.items()} for ph, t in phases.items()},
        "target_plan_gib": gib(target.total), "target_fits": target.total <= free,
        "target_terms_gib": {k: gib(v) for k, v in target.components.items()},
    }, cfg


class PhasePeaks:
    """The peak allocated bytes of each phase of a replica's step, marked as it runs: its
    drafter's forward, its loss's forward, the loss's backward up to the final states'
    gradient, the layers' backward, the optimizer; each phase's peak the largest over the step's
    passes. ``phase`` names the phase running (where an out-of-memory error struck)."""

    def __init__(self, rep, device: torch.device):
        self.dev, self.peaks, self.phase = device, {}, "setup"
        self.seen: list[str] = []  # the phases in the order they ran
        drafter_forward = rep.drafter.forward

        def forward(*a, **k):
            self.switch("forward")
            out = drafter_forward(*a, **k)
            self.switch("loss")
            if out.requires_grad:
                out.register_hook(lambda grad: self.switch("backward"))
            return out
        rep.drafter.forward = forward  # nn.Module.__call__ finds the instance's own first
        rep.loss = _LossMarks(rep.loss, self)

    def switch(self, following: str) -> None:
        cuda = self.dev.type == "cuda"
        peak = torch.cuda.max_memory_allocated(self.dev) if cuda else 0
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), peak)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.dev)
        self.seen.append(self.phase)
        self.phase = following


class _LossMarks:
    """The replica's step loss, its call marked (the rest of it as it is)."""

    def __init__(self, loss, marks: PhasePeaks):
        self._loss, self._marks = loss, marks

    def __getattr__(self, name):
        return getattr(self._loss, name)

    def __call__(self, *a, **k):
        out = self._loss(*a, **k)
        self._marks.switch("loss backward")
        return out


def build(shape: str, objective: str, cfg, device: torch.device):
    """A fresh replica of the case's drafter, built on its device (tens of GB of float32 weights
    never go through the host), with a random frozen embedding and head as the engine keeps
    them (bf16 on a GPU)."""
    tc = hf_config(SHAPES[shape])
    settings = family_settings(cfg)
    torch.manual_seed(0)
    with torch.device(device):
        drafter = drafter_kinds.new_drafter(
            objective, tc, num_layers=cfg.drafter.num_layers, target_layer_ids=LAYER_IDS,
            block_size=cfg.drafter.block_size, mask_token_id=tc.vocab_size - 1,
            settings=settings)
    wdt = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed = torch.nn.Embedding(tc.vocab_size, tc.hidden_size, dtype=wdt, device=device)
    head = torch.nn.Linear(tc.hidden_size, tc.vocab_size, bias=False, dtype=wdt, device=device)
    (rep,) = make_replicas(drafter, [device], cfg.drafter, cfg.optim, embed, head, settings)
    return rep, tc


def run_case(rep, tc, cfg, args, device: torch.device) -> dict:
    """--warmup steps, then one step with its phases' peaks (None on the CPU) and its time; an
    out-of-memory error is reported with the phase it struck in."""
    cuda = device.type == "cuda"
    L = cfg.data.max_length
    # the case's sizes (the plan may have lowered them) and recompute as it resolved them
    rep.drafter.recompute = cfg.drafter.recompute == "on"
    rep.micro_block_tokens, rep.loss.chunk = (cfg.drafter.micro_block_tokens,
                                              cfg.drafter.loss_chunk)
    batch = prepare_batch(batch_of(1, L, tc.vocab_size), cfg.drafter.num_anchors,
                          rep.drafter.label_width, seed=0,
                          pad_to=ANCHOR_PAD if cuda else 1,
                          per_1k=cfg.drafter.anchors_per_1k_tokens)
    dt = torch.bfloat16 if cuda else torch.float32
    feats = torch.randn(1, L, rep.drafter.feature_vectors * tc.hidden_size, device=device,
                        dtype=dt)
    out = {"blocks": int((batch.anchors >= 0).sum())}
    original = (rep.drafter.forward, rep.loss)
    marks, where, oom = None, "warmup", ""
    try:
        for s in range(args.warmup):
            watch(240)  # a step stuck compiling shows where it is
            rep.accumulate(batch, feats, seed=0)
            reduce_and_step([rep], s, 1000)
            sync(device)
        marks = PhasePeaks(rep, device)
        sync(device)
        held = torch.cuda.memory_allocated(device) if cuda else None
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        rep.accumulate(batch, feats, seed=0)
        marks.switch("optimizer")
        reduce_and_step([rep], args.warmup, 1000)
        sync(device)
        marks.switch("done")
        out["step_s"] = round(time.perf_counter() - t, 3)
    except torch.OutOfMemoryError as exc:
        where = marks.phase if marks is not None else where
        oom = (str(exc).splitlines() or ["out of memory"])[0]
    finally:
        rep.drafter.forward, rep.loss = original
        faulthandler.cancel_dump_traceback_later()
    if oom:  # outside the except block: its traceback held the step's tensors
        del batch, feats
        rep.discard_step()
        return out | {"oom": True, "oom_phase": where, "oom_message": oom[:200]}
    peaks = {k: v for k, v in marks.peaks.items() if k not in ("setup", "done")}
    out["held_gib"] = gib(held)
    out["peak_gib"] = gib(max(peaks.values())) if cuda else None
    out["phases_gib"] = {k: gib(v) for k, v in peaks.items()} if cuda else None
    return out


def compare(plan: dict, measured: dict) -> dict:
    """The measured peak of each of the plan's phases (its loss: the larger of the loss's
    forward and backward), and the plan over the measured, whole and per phase."""
    m = measured.get("phases_gib")
    if not m or not measured.get("peak_gib"):
        return {}
    seen = {"forward": m.get("forward"),
            "loss": max(m.get("loss") or 0, m.get("loss backward") or 0) or None,
            "backward": m.get("backward")}
    ratio = lambda a, b: round(a / b, 3) if a and b else None  # noqa: E731
    return {"ratio": ratio(plan["plan_tensors_gib"], measured["peak_gib"]),
            "measured_plan_phases_gib": seen,
            "phase_ratios": {ph: ratio(plan["plan_phases_gib"][ph], v)
                             for ph, v in seen.items()}}


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def plan_only(args) -> None:
    for shape in args.shapes:
        for objective in args.objectives:
            for length in args.lengths:
                emit(plan_case(args, shape, objective, length)[0])
            cfg = case_config(args, shape, objective, min(args.lengths))
            cap = int(args.gpu_memory_gib * GiB)
            alone = longest_sample(cfg, SHAPES[shape], {DRAFTER: cap}, {DRAFTER: cap})
            both = longest_sample(cfg, SHAPES[shape], {DRAFTER: cap, TARGET: cap},
                                  {DRAFTER: cap, TARGET: cap})
            emit({"shape": shape, "objective": objective, "cap_gib": args.gpu_memory_gib,
                  "recompute": args.recompute, "longest_sample_drafter_gpu": alone,
                  "longest_sample_with_target_gpu": both})


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plan_only:
        plan_only(args)
        return
    cuda = args.device == "cuda"
    device = torch.device("cuda:0" if cuda else "cpu")
    if cuda:
        from dflash_core.planning.allocator import apply_card_limit, configure_allocator

        print(configure_allocator().describe(), flush=True)  # before CUDA allocates
        apply_card_limit(device, args.gpu_memory_gib)
    print(env_line(), flush=True)
    start, rows = time.monotonic(), []
    for shape in args.shapes:
        for objective in args.objectives:
            rep = tc = None
            for length in args.lengths:
                plan, cfg = plan_case(args, shape, objective, length)
                if time.monotonic() - start > args.budget_s:
                    plan["skipped"] = f"time: past --budget-s {args.budget_s:g}"
                elif not plan["plan_fits"] and not args.run_refused:
                    plan["skipped"] = "the plan refuses it (no sizes fit)"
                if "skipped" in plan:
                    rows.append(plan)
                    emit(plan)
                    continue
                if rep is None:
                    rep, tc = build(shape, objective, cfg, device)
                measured = run_case(rep, tc, cfg, args, device)
                record = plan | measured | compare(plan, measured)
                rows.append(record)
                emit(record)
                free_memory(device)
            del rep
            free_memory(device)
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    print("| shape | objective | tokens | recompute | plan GiB (tensors) | peak GiB | plan / peak "
          "| forward / loss / backward: plan vs peak | step s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        seen = r.get("measured_plan_phases_gib") or {}
        per = " / ".join(f"{r['plan_phases_gib'][p]} vs {seen.get(p) or '-'}"
                         for p in ("forward", "loss", "backward"))
        peak = (f"OOM ({r['oom_phase']})" if r.get("oom")
                else r.get("skipped") or r.get("peak_gib") or "-")
        print(f"| {r['shape']} | {r['objective']} | {r['seq_len']} | "
              f"{'on' if r['recompute'] else 'off'} | {r['plan_gib']} "
              f"({r['plan_tensors_gib']}) | {peak} | {r.get('ratio') or '-'} | {per} | "
              f"{r.get('step_s', '-')} |", flush=True)


if __name__ == "__main__":
    main()
