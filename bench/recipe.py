"""The training recipe on the demo: exact tau after the same steps for drafter.loss (dflash,
dpace) x optim.name (adamw, muon), over several seeds, with the spread.

    nice -n 10 python bench/recipe.py [--steps 80] [--seeds 0,1,2] [--eval-tokens 32]
                                      [--reference-seeds 0] [--out bench/results/recipe]
    # equal wall time at the 27B shape (a Muon step costs 2.601 s there, AdamW's 2.029 s),
    # on a GPU, nine runs at once (bench/BENCHMARKS.md, "Training recipe"):
    python bench/recipe.py --device cuda --jobs 9 --steps 512 --steps-of muon=400,muon=512 \
        --seeds 0,1,2 --eval-tokens 64 --reference-seeds 0 --cpu-decode

Each run is the demo's config with run.seed, drafter.loss and optim.name set and run.max_steps
steps, trained by ``dflash-tui --config ... --headless`` in its own process (``--jobs`` of them at
once; one at a time by default, the machine's cores are shared). ``--steps-of OPTIM=N`` gives an
optimizer other step counts than ``--steps`` (repeat it for several): an equal-wall-time comparison
gives the slower optimizer's runs the steps that cost the same time as the other's.

A run's exact tau is the EvalResult it writes at the end (events.jsonl). For the
``--reference-seeds`` runs the final checkpoint is decoded again through the public reference
implementation (``dflash==0.1.0``'s DFlashDraftModel, installed as tests/core/models/
test_drafter.py installs it) on the same held-out prompts: the same weights must give the same
tau there. ``--cpu-decode`` decodes every run's final checkpoint again on the CPU with the
engine's own drafter (the figure when a run's own evaluation did not finish). Writes
``recipe.json`` (every run) and ``recipe.md`` (the table) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_core import demo  # noqa: E402
from dflash_core.config import save_config  # noqa: E402
from dflash_core.data import ShardedDataset  # noqa: E402
from dflash_core.data.batching import split_eval  # noqa: E402
from dflash_core.models.drafter import DFlashDrafter  # noqa: E402
from dflash_core.models.evaluate import evaluate_tau, target_fn_for  # noqa: E402
from dflash_core.models.target import HF_BUILD_LOCK, load_target  # noqa: E402
from dflash_core.persist import checkpoint as ckpt  # noqa: E402
from dflash_core.pipeline.evaluation import eval_prompts  # noqa: E402

LOSSES = ("dflash", "dpace")
OPTIMS = ("adamw", "muon")
REFERENCE = "dflash==0.1.0"


def reference_model_class():
    """The public reference's DFlashDraftModel (installed beside the venv, without its
    dependencies), or None when it cannot be installed here."""
    target = Path(sys.prefix) / "reference-dflash-0.1.0"
    if not (target / "dflash" / "model.py").exists():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                               "--target", str(target), REFERENCE], check=False)
        if done.returncode != 0:
            return None
    sys.path.insert(0, str(target))
    from dflash.model import DFlashDraftModel

    return DFlashDraftModel


class ReferenceDrafter:
    """The reference model behind evaluate.Drafter's ``draft``: the block [last, MASK...] at
    positions S..S+B-1 after the context's 0..S-1, the target's head on its output."""

    def __init__(self, model, folder: Path, embed, lm_head):
        cfg = json.loads((folder / "config.json").read_text())["dflash_config"]
        self.model, self.embed, self.lm_head = model, embed, lm_head
        self.block_size = int(cfg["block_size"])
        self.target_layer_ids = list(cfg["target_layer_ids"])
        self.mask_id = int(cfg["mask_token_id"])

    def parameters(self):  # evaluate.py finds the drafter's device through its parameters
        return self.model.parameters()

    @torch.no_grad()
    def draft(self, context, last_token, num_tokens=None):
        S, B = context.shape[1], self.block_size
        ids = torch.tensor([[last_token] + [self.mask_id] * (B - 1)], device=context.device)
        pos = torch.arange(S + B, device=context.device)[None]
        hidden = self.model(position_ids=pos, noise_embedding=self.embed(ids).float(),
                            target_hidden=context.float())
        logits = self.lm_head(hidden[0, 1:].to(self.lm_head.weight.dtype))
        return logits.argmax(-1)[: num_tokens or B - 1]


def run_one(out: Path, loss: str, optim: str, seed: int, steps: int, eval_tokens: int,
            device: str = "cpu", threads: int = 0) -> dict:
    name = f"{loss}-{optim}-n{steps}-s{seed}"
    cfg = demo.demo_config(output_dir=str(out / "runs"), name=name, device=device)
    cfg.run.seed, cfg.run.max_steps = seed, steps
    cfg.drafter.loss, cfg.optim.name = loss, optim
    cfg.eval.every = 0  # exact tau once, at the end
    cfg.eval.max_new_tokens = eval_tokens
    path = out / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_config(cfg, path)
    run_dir = cfg.run_dir
    if run_dir.exists():  # a bench run starts from scratch
        import shutil
        shutil.rmtree(run_dir)
    t = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if threads:  # runs side by side share the host's cores
        env["OMP_NUM_THREADS"] = str(threads)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    with open(out / "runs" / f"{name}.log", "w") as log:
        rc = subprocess.run([sys.executable, "-m", "dflash_tui.cli", "--config", str(path),
                             "--headless"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
                            ).returncode
    wall = time.monotonic() - t
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    evals = [e for e in events if e["event"] == "EvalResult"]
    metrics = [e for e in events if e["event"] == "StepMetrics"]
    last = metrics[-1] if metrics else {}
    return {"name": name, "loss": loss, "optim": optim, "seed": seed, "rc": rc,
            "planned_steps": steps, "steps": last.get("step", 0), "wall_s": round(wall, 1),
            "tau": evals[-1]["tau"] if evals else None,
            "acceptance": evals[-1]["acceptance"] if evals else None,
            "train_loss": last.get("loss"), "tau_tf": last.get("tau_tf"),
            "step_s": _step_seconds(metrics), "run_dir": str(run_dir), "config": cfg}


def _step_seconds(metrics: list[dict]) -> float | None:
    """Median seconds per step over the second half of the run (past warm-up)."""
    ts = [m["ts"] for m in metrics]
    gaps = [b - a for a, b in zip(ts, ts[1:])][len(ts) // 2:]
    return round(statistics.median(gaps), 4) if gaps else None


def _final_decoding(row: dict):
    """(target, held-out prompts, final checkpoint folder) of a run, on the CPU."""
    cfg = row["config"]
    folder = ckpt.latest_checkpoint(row["run_dir"])
    if folder is None:
        return None
    tm = load_target(Path(row["run_dir"]) / "target", device="cpu", dtype=torch.float32)
    dataset = ShardedDataset.open(demo.ensure_demo_data(demo.ensure_tiny_target()))
    n_eval = min(cfg.data.eval_prompts, max(0, len(dataset) - 1))
    _, indices = split_eval(len(dataset), n_eval, cfg.run.seed)
    return tm, eval_prompts(dataset, indices, cfg.eval.prompt_tokens), folder


def reference_tau(ref_cls, row: dict, got) -> float | None:
    """Exact tau of the run's final checkpoint through the reference model, same prompts
    (``got``: the run's ``_final_decoding``)."""
    if ref_cls is None or got is None:
        return None
    tm, prompts, folder = got
    with HF_BUILD_LOCK:  # transformers' loading is not thread-safe (runs decode side by side)
        model = ref_cls.from_pretrained(str(folder), dtype=torch.float32).eval()
    drafter = ReferenceDrafter(model, folder, tm.embed_tokens, tm.lm_head)
    res = evaluate_tau(target_fn_for(tm, drafter.target_layer_ids), drafter, prompts,
                       row["config"].eval.max_new_tokens, drafter.target_layer_ids)
    return res.tau


def cpu_tau(row: dict, got) -> float | None:
    """Exact tau of the run's final checkpoint with the engine's own drafter, decoded again on
    the CPU: the same figure as the run's own last evaluation wherever that ran."""
    if got is None:
        return None
    tm, prompts, folder = got
    loaded = ckpt.load_checkpoint(folder)
    drafter = DFlashDrafter(DFlashDrafter.config_from_dict(loaded.drafter_config)).float()
    drafter.load_state_dict(loaded.drafter_state)
    drafter.attach_target_head(tm.embed_tokens, tm.lm_head)
    layer_ids = list(loaded.drafter_config["dflash_config"]["target_layer_ids"])
    res = evaluate_tau(target_fn_for(tm, layer_ids), drafter.eval(), prompts,
                       row["config"].eval.max_new_tokens, layer_ids)
    return res.tau


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = statistics.mean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {sd:.3f} ({min(values):.2f}..{max(values):.2f})"


def table(rows: list[dict]) -> str:
    lines = ["Exact tau on the demo after run.max_steps steps (mean ± sample sd over seeds, "
             "min..max):", "", "| drafter.loss | optim.name | steps | exact tau | exact tau, CPU "
             "re-decode | reference tau | teacher-forced tau | train loss | s / step | seeds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    step_counts = sorted({r["planned_steps"] for r in rows})
    for loss, optim, steps in [(a, b, n) for a in LOSSES for b in OPTIMS for n in step_counts]:
        mine = [r for r in rows
                if r["loss"] == loss and r["optim"] == optim and r["planned_steps"] == steps]
        if not mine:
            continue
        pick = lambda k: [r[k] for r in mine if r.get(k) is not None]  # noqa: E731
        mean = lambda v: f"{statistics.mean(v):.3f}" if v else "-"  # noqa: E731
        median = lambda v: f"{statistics.median(v):.3f}" if v else "-"  # noqa: E731
        lines.append(
                f"| {loss} | {optim} | {steps} | {spread(pick('tau'))} | {spread(pick('cpu_tau'))} | "
                f"{spread(pick('ref_tau'))} | "
                f"{spread(pick('tau_tf'))} | {mean(pick('train_loss'))} | "
                f"{median(pick('step_s'))} | "
                f"{','.join(str(r['seed']) for r in sorted(mine, key=lambda r: r['seed']))} |")
    return "\n".join(lines) + "\n"


def parse_steps_of(spec: str) -> dict[str, list[int]]:
    """``muon=400,muon=512`` -> {"muon": [400, 512]}."""
    steps_of: dict[str, list[int]] = {}
    for item in filter(None, spec.split(",")):
        optim, _, n = item.partition("=")
        if optim not in OPTIMS or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--steps-of {item!r}: want OPTIM=N with OPTIM one of "
                             f"{', '.join(OPTIMS)} and N a whole number of steps")
        steps_of.setdefault(optim, []).append(int(n))
    return steps_of


def plan_runs(seeds: list[int], losses: list[str], optims: list[str], steps: int,
              steps_of: dict[str, list[int]]) -> list[tuple[str, str, int, int]]:
    """(loss, optim, seed, steps) of every run, seed-major: a sweep cut short still holds every
    combination of its first seeds."""
    return [(loss, optim, seed, n) for seed in seeds for loss in losses for optim in optims
            for n in steps_of.get(optim, [steps])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80, help="run.max_steps of every run")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--eval-tokens", type=int, default=32,
                    help="eval.max_new_tokens (the demo's 64 doubles the decoding time)")
    ap.add_argument("--reference-seeds", default="0",
                    help="seeds whose runs are decoded again through the reference ('' = none)")
    ap.add_argument("--losses", default=",".join(LOSSES))
    ap.add_argument("--optims", default=",".join(OPTIMS))
    ap.add_argument("--steps-of", default="", metavar="OPTIM=N,...",
                    help="step counts for an optimizer instead of --steps, e.g. muon=400,muon=512")
    ap.add_argument("--device", default="cpu", help="the demo's --device (cpu, cuda, auto)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once")
    ap.add_argument("--cpu-decode", action="store_true",
                    help="also decode every run's final checkpoint again on the CPU (cpu tau)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "recipe")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ref_seeds = {int(s) for s in args.reference_seeds.split(",") if s}
    ref_cls = reference_model_class() if ref_seeds else None
    try:
        steps_of = parse_steps_of(args.steps_of)
    except ValueError as exc:
        ap.error(str(exc))
    plan = plan_runs([int(s) for s in args.seeds.split(",")], args.losses.split(","),
                     args.optims.split(","), args.steps, steps_of)
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else 0
    rows: list[dict] = []

    def one(item: tuple) -> dict:
        loss, optim, seed, n = item
        row = run_one(args.out, loss, optim, seed, n, args.eval_tokens, args.device, threads)
        again = (seed in ref_seeds and ref_cls is not None) or args.cpu_decode
        got = _final_decoding(row) if again else None  # the target and prompts, read once
        row["ref_tau"] = reference_tau(ref_cls, row, got) if seed in ref_seeds else None
        row["cpu_tau"] = cpu_tau(row, got) if args.cpu_decode else None
        row.pop("config")
        return row

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for row in pool.map(one, plan):
            rows.append(row)
            print(json.dumps(row), flush=True)
            (args.out / "recipe.json").write_text(json.dumps(rows, indent=1))
            (args.out / "recipe.md").write_text(table(rows))
    print(table(rows))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
