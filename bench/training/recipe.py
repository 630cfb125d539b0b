"""The training recipe on the demo: exact tau after the same steps for drafter.objective (dflash,
dspark) x drafter.loss (dflash, dpace) x optim.name (adamw, muon), over several seeds, with the
spread.

    nice -n 10 python bench/training/recipe.py [--steps 80] [--seeds 0,1,2] [--eval-tokens 32]
                                      [--reference-seeds 0] [--out bench/results/recipe]
    # DSpark against DFlash at equal wall time, both verifying 8 tokens a round (DFlash's B 8 is
    # 7 drafts + the bonus; DSpark's B 7 is 7 drafts + the bonus); a DSpark step cost 0.428 s
    # here, DFlash's 0.448 (bench/BENCHMARKS.md, "DSpark against DFlash on the demo"):
    nice -n 10 python bench/training/recipe.py --objectives dflash,dspark --losses dflash --optims adamw \
        --objective-set dspark:drafter.block_size=7 --steps 256 --steps-of dspark=268 \
        --seeds 0,1,2 --eval-tokens 64 --reference-seeds 0 --out <scratch folder>
    # equal wall time at the 27B shape (a Muon step costs 2.601 s there, AdamW's 2.029 s),
    # on a GPU, nine runs at once (bench/BENCHMARKS.md, "Training recipe"):
    python bench/training/recipe.py --device cuda --jobs 9 --steps 512 --steps-of muon=400,muon=512 \
        --seeds 0,1,2 --eval-tokens 64 --reference-seeds 0 --cpu-decode

Each run is the demo's config with run.seed, drafter.objective, drafter.loss and optim.name set
and run.max_steps steps, trained by ``dflash-tui --config ... --headless`` in its own process
(``--jobs`` of them at once; one at a time by default, the machine's cores are shared).
``--objective-set OBJECTIVE:SECTION.KEY=VALUE`` (repeatable) sets a key for one objective's runs
only, as ``--set`` would. ``--steps-of OPTIM=N`` or ``--steps-of OBJECTIVE=N`` gives an optimizer
or an objective other step counts than ``--steps`` (repeat it for several; one kind per sweep): an
equal-wall-time comparison gives the cheaper one's runs the steps that cost the same time as the
other's. DSpark is not combined with drafter.loss dpace (the config refuses it): such pairs are
left out of the sweep, said once.

A run's exact tau is the EvalResult it writes at the end (events.jsonl). For the
``--reference-seeds`` runs the final checkpoint is decoded again through the public reference
implementation (``dflash==0.1.0``'s DFlashDraftModel, installed as tests/core/models/dflash/
test_drafter.py installs it) on the same held-out prompts: the same weights must give the same
tau there (DFlash runs only: the reference is DFlash's). ``--cpu-decode`` decodes every run's
final checkpoint again on the CPU with the engine's own drafter of the run's objective (the figure
when a run's own evaluation did not finish). Writes
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash_core import demo  # noqa: E402
from dflash_core.config import ConfigError, apply_overrides, save_config  # noqa: E402
from dflash_core.data import ShardedDataset  # noqa: E402
from dflash_core.data.batching import split_eval  # noqa: E402
from dflash_core.models.registry import OBJECTIVES, drafter_from_config  # noqa: E402
from dflash_core.eval.evaluate import evaluate_tau, target_fn_for  # noqa: E402
from dflash_core.models.target.load import HF_BUILD_LOCK, load_target  # noqa: E402
from dflash_core.checkpoint import save_load as ckpt  # noqa: E402
from dflash_core.pipeline.evaluation import eval_prompts  # noqa: E402

LOSSES = ("dflash", "dpace")
OPTIMS = ("adamw", "muon")
REFERENCE = "dflash==0.1.0"
# (objective, loss) pairs the config refuses (dflash_core/config/load.py): D-PACE's slot weights
# presuppose DFlash's unlabelled slot 0.
REFUSED = {("dspark", "dpace")}


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


def run_config(out: Path, name: str, device: str, objective: str = "dflash",
               settings: list[tuple[str, str]] = ()):
    """The demo's config for a run of ``objective`` with its ``settings`` ((key, value text), as
    ``--set`` takes them) applied; ConfigError names a bad one."""
    cfg = demo.demo_config(output_dir=str(out / "runs"), name=name, device=device)
    if objective != "dflash" or settings:
        cfg = apply_overrides(cfg, [("drafter.objective", objective), *settings])
    return cfg


def run_one(out: Path, loss: str, optim: str, seed: int, steps: int, eval_tokens: int,
            device: str = "cpu", threads: int = 0, objective: str = "dflash",
            settings: list[tuple[str, str]] = ()) -> dict:
    # DFlash's runs keep the names of the sweeps before the objective was a dimension
    name = ("" if objective == "dflash" else f"{objective}-") + f"{loss}-{optim}-n{steps}-s{seed}"
    cfg = run_config(out, name, device, objective, settings)
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
    evals = [e for e in events if e["event"] == "EvalResult" and not e.get("prompt_set")]
    metrics = [e for e in events if e["event"] == "StepMetrics"]
    last = metrics[-1] if metrics else {}
    return {"name": name, "objective": objective, "block_size": cfg.drafter.block_size,
            "loss": loss, "optim": optim, "seed": seed, "rc": rc,
            "planned_steps": steps, "steps": last.get("step", 0), "wall_s": round(wall, 1),
            "tau": evals[-1]["tau"] if evals else None,
            "acceptance": evals[-1]["acceptance"] if evals else None,
            "train_loss": last.get("loss"), "tau_tf": last.get("tau_tf"),
            "step_s": _step_seconds(metrics), **_phase_seconds(events, metrics),
            "run_dir": str(run_dir), "config": cfg}


def _phase_seconds(events: list[dict], metrics: list[dict]) -> dict:
    """train_s: first to last step (what an equal-wall-time comparison equalises); end_s: last
    step to the run's end (the final checkpoint and evaluation)."""
    if not metrics:
        return {"train_s": None, "end_s": None}
    first, last = metrics[0]["ts"], metrics[-1]["ts"]
    return {"train_s": round(last - first, 1), "end_s": round(events[-1]["ts"] - last, 1)}


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
    if ref_cls is None or got is None or row.get("objective", "dflash") != "dflash":
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
    drafter = drafter_from_config(loaded.drafter_config, row.get("objective", "dflash")).float()
    drafter.load_state_dict(loaded.drafter_state)
    drafter.attach_target_head(tm.embed_tokens, tm.lm_head)
    layer_ids = list(drafter.target_layer_ids)
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
    """A row per (objective,) loss, optimizer and step count; the objective column only when the
    sweep holds another objective than dflash (older sweeps' tables keep their columns)."""
    objective_of = lambda r: r.get("objective", "dflash")  # noqa: E731 (rows of older sweeps)
    with_objective = any(objective_of(r) != "dflash" for r in rows)
    lead = "| drafter.objective (B) " if with_objective else ""
    lines = ["Exact tau on the demo after run.max_steps steps (mean ± sample sd over seeds, "
             "min..max):", "", lead + "| drafter.loss | optim.name | steps | exact tau | exact "
             "tau, CPU re-decode | reference tau | teacher-forced tau | train loss | s / step | "
             "wall s / run | seeds |", "|---" * (12 if with_objective else 11) + "|"]
    step_counts = sorted({r["planned_steps"] for r in rows})
    for objective, loss, optim, steps in [(o, a, b, n) for o in OBJECTIVES for a in LOSSES
                                          for b in OPTIMS for n in step_counts]:
        mine = [r for r in rows if objective_of(r) == objective and r["loss"] == loss
                and r["optim"] == optim and r["planned_steps"] == steps]
        if not mine:
            continue
        pick = lambda k: [r[k] for r in mine if r.get(k) is not None]  # noqa: E731
        mean = lambda v: f"{statistics.mean(v):.3f}" if v else "-"  # noqa: E731
        median = lambda v: f"{statistics.median(v):.3f}" if v else "-"  # noqa: E731
        blocks = ",".join(str(b) for b in sorted(set(pick("block_size"))))
        lead = f"| {objective} ({blocks or '?'}) " if with_objective else ""
        lines.append(
                f"{lead}| {loss} | {optim} | {steps} | {spread(pick('tau'))} | "
                f"{spread(pick('cpu_tau'))} | {spread(pick('ref_tau'))} | "
                f"{spread(pick('tau_tf'))} | {mean(pick('train_loss'))} | "
                f"{median(pick('step_s'))} | {median(pick('wall_s'))} | "
                f"{','.join(str(r['seed']) for r in sorted(mine, key=lambda r: r['seed']))} |")
    return "\n".join(lines) + "\n"


def parse_steps_of(spec: str) -> dict[str, list[int]]:
    """``muon=400,muon=512`` -> {"muon": [400, 512]}; ``dflash=300`` -> {"dflash": [300]}: the
    step counts of an optimizer's or an objective's runs (one kind of the two per sweep, so that
    no run has two answers)."""
    steps_of: dict[str, list[int]] = {}
    for item in filter(None, spec.split(",")):
        name, _, n = item.partition("=")
        if name not in OPTIMS + OBJECTIVES or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--steps-of {item!r}: want OPTIM=N or OBJECTIVE=N with OPTIM one "
                             f"of {', '.join(OPTIMS)}, OBJECTIVE one of {', '.join(OBJECTIVES)} "
                             "and N a whole number of steps")
        steps_of.setdefault(name, []).append(int(n))
    if any(k in OPTIMS for k in steps_of) and any(k in OBJECTIVES for k in steps_of):
        raise ValueError(f"--steps-of {spec!r}: names both optimizers and objectives; give step "
                         "counts to one of the two per sweep (run the other as its own sweep)")
    return steps_of


def parse_objective_sets(items: list[str]) -> dict[str, list[tuple[str, str]]]:
    """``["dspark:drafter.block_size=7"]`` -> {"dspark": [("drafter.block_size", "7")]}: keys
    set for one objective's runs only (the value text as ``--set`` reads it)."""
    sets: dict[str, list[tuple[str, str]]] = {}
    for item in items:
        objective, _, setting = item.partition(":")
        key, eq, value = setting.partition("=")
        if objective not in OBJECTIVES or "." not in key or not eq:
            raise ValueError(f"--objective-set {item!r}: want OBJECTIVE:SECTION.KEY=VALUE with "
                             f"OBJECTIVE one of {', '.join(OBJECTIVES)}, e.g. "
                             "dspark:drafter.block_size=7")
        sets.setdefault(objective, []).append((key, value))
    return sets


def plan_runs(seeds: list[int], losses: list[str], optims: list[str], steps: int,
              steps_of: dict[str, list[int]]) -> list[tuple[str, str, int, int]]:
    """(loss, optim, seed, steps) of every run, seed-major: a sweep cut short still holds every
    combination of its first seeds."""
    return [(loss, optim, seed, n) for seed in seeds for loss in losses for optim in optims
            for n in steps_of.get(optim, [steps])]


def plan_sweep(seeds: list[int], objectives: list[str], losses: list[str], optims: list[str],
               steps: int, steps_of: dict[str, list[int]]) -> list[tuple[str, str, str, int, int]]:
    """(objective, loss, optim, seed, steps) of every run, seed-major as plan_runs; an
    objective's own step counts (``steps_of[objective]``) stand for every optimizer's, and the
    pairs in REFUSED are left out."""
    plan = []
    for seed in seeds:
        for objective in objectives:
            mine = ({optim: steps_of[objective] for optim in optims} if objective in steps_of
                    else steps_of)
            losses_ok = [loss for loss in losses if (objective, loss) not in REFUSED]
            plan += [(objective, *run) for run in plan_runs([seed], losses_ok, optims, steps, mine)]
    return plan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80, help="run.max_steps of every run")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--eval-tokens", type=int, default=32,
                    help="eval.max_new_tokens (the demo's 64 doubles the decoding time)")
    ap.add_argument("--reference-seeds", default="0",
                    help="seeds whose runs are decoded again through the reference ('' = none)")
    ap.add_argument("--objectives", default="dflash", help="drafter.objective of the runs, e.g. "
                    "dflash,dspark")
    ap.add_argument("--losses", default=",".join(LOSSES))
    ap.add_argument("--optims", default=",".join(OPTIMS))
    ap.add_argument("--objective-set", action="append", default=[],
                    metavar="OBJECTIVE:SECTION.KEY=VALUE",
                    help="a key for one objective's runs (repeatable), e.g. "
                         "dspark:drafter.block_size=7")
    ap.add_argument("--steps-of", default="", metavar="NAME=N,...",
                    help="step counts for an optimizer or an objective instead of --steps, e.g. "
                         "muon=400,muon=512 or dflash=300")
    ap.add_argument("--device", default="cpu", help="the demo's --device (cpu, cuda, auto)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once")
    ap.add_argument("--cpu-decode", action="store_true",
                    help="also decode every run's final checkpoint again on the CPU (cpu tau)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "recipe")
    args = ap.parse_args()
    objectives = args.objectives.split(",")
    try:
        steps_of = parse_steps_of(args.steps_of)
        settings = parse_objective_sets(args.objective_set)
        for objective in objectives:  # a bad key or value stops the sweep before its first run
            run_config(args.out, "check", args.device, objective, settings.get(objective, []))
    except (ValueError, ConfigError) as exc:
        ap.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    ref_seeds = {int(s) for s in args.reference_seeds.split(",") if s}
    ref_cls = reference_model_class() if ref_seeds and "dflash" in objectives else None
    plan = plan_sweep([int(s) for s in args.seeds.split(",")], objectives,
                      args.losses.split(","), args.optims.split(","), args.steps, steps_of)
    left_out = sorted({(o, loss) for o in objectives for loss in args.losses.split(",")}
                      & REFUSED)
    if left_out:
        print("left out (the config refuses them): " + ", ".join(
            f"drafter.objective {o} with drafter.loss {loss}" for o, loss in left_out), flush=True)
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else 0
    rows: list[dict] = []

    def one(item: tuple) -> dict:
        objective, loss, optim, seed, n = item
        row = run_one(args.out, loss, optim, seed, n, args.eval_tokens, args.device, threads,
                      objective, settings.get(objective, []))
        referenced = seed in ref_seeds and ref_cls is not None and objective == "dflash"
        again = referenced or args.cpu_decode
        got = _final_decoding(row) if again else None  # the target and prompts, read once
        row["ref_tau"] = reference_tau(ref_cls, row, got) if referenced else None
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
