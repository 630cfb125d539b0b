"""Stage ``train``: DFlash (block 16) against DSpark (block 7) on the lab target and its data, at
equal GPU time, over several seeds; each run a ``dflash-tui run --headless`` of its own config.

Equal time: each objective's step is first timed by a probe run (``Scale.probe_steps`` steps,
seed 0, no evaluation; seconds per step = the median gap between the steps of its second half,
as bench/training/recipe.py times them), kept in ``<dir>/train/timing.json``. Every run then gets
``train_seconds / seconds per step`` steps, so both objectives train for the same time; the
table reports each run's measured training seconds beside it.

Folders: ``<dir>/train/configs/NAME.yaml``, ``<dir>/train/runs/NAME/`` (NAME =
``OBJECTIVE-bB-nSTEPS-sSEED``). A run that ended ``finished`` is kept; one that stopped with a
checkpoint is resumed (``--resume``); one that stopped before its first checkpoint is started
again. A run folder whose config is not this command's is refused (another scale or budget:
another --dir).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.lab.data_stage import max_length, prepared_path
from bench.lab.errors import LabError
from bench.lab.proc import dflash_tui, last_line
from bench.lab.scales import SCALES, Scale
from bench.training.recipe import _phase_seconds, _step_seconds

BLOCKS = {"dflash": 16, "dspark": 7}  # issue 50: DFlash's released B, DSpark's
TIMING = "timing.json"


@dataclass(frozen=True)
class RunSet:
    objective: str | None  # None: every run
    section: str
    key: str
    value: object


def run_sets(scale: Scale) -> list[RunSet]:
    """``scale.run_sets`` read; LabError names an item that is not [OBJECTIVE:]SECTION.KEY=VALUE
    (the key itself is checked with the rest of the run's config)."""
    import yaml

    out = []
    for item in scale.run_sets:
        head, eq, text = item.partition("=")
        objective, colon, path = head.rpartition(":")
        section, dot, key = path.strip().partition(".")
        if (not eq or not dot or not section or not key or "." in key
                or (colon and objective not in BLOCKS)):
            raise LabError(f"run_sets item {item!r} is not [OBJECTIVE:]SECTION.KEY=VALUE",
                           hint=f"e.g. --set run_sets=dspark:drafter.markov_rank=64 (OBJECTIVE "
                                f"one of {', '.join(BLOCKS)})")
        out.append(RunSet(objective or None, section, key, yaml.safe_load(text)))
    return out


# The fields of the runs' recipe: one changed from its scale's value (--set) makes a variant.
RECIPE_FIELDS = ("drafter_layers", "layer_ids", "num_anchors", "token_budget",
                 "max_seqs_per_batch", "drafter_lr", "probe_steps", "train_seconds", "run_sets")


def variant_changes(scale: Scale) -> dict:
    """The recipe fields that differ from the scale's own values."""
    base = SCALES.get(scale.name)
    return {f: getattr(scale, f) for f in RECIPE_FIELDS
            if base is None or getattr(scale, f) != getattr(base, f)}


def variant_tag(scale: Scale) -> str:
    """'' for the scale's own runs, else '-v' and a short hash of what was changed."""
    changes = variant_changes(scale)
    if not changes:
        return ""
    return "-v" + hashlib.sha256(json.dumps(changes, sort_keys=True, default=list).encode()
                                 ).hexdigest()[:6]


def blocks(scale: Scale) -> dict[str, int]:
    """The block size of each objective the scale trains: BLOCKS, or a run_sets
    drafter.block_size. Run_sets that all name one objective train that one only (the other's
    runs are the default ones: the same command without them)."""
    sets = run_sets(scale)
    named = {rs.objective for rs in sets}
    out = dict(BLOCKS) if None in named or not named else {o: BLOCKS[o] for o in BLOCKS
                                                           if o in named}
    for rs in sets:
        if (rs.section, rs.key) == ("drafter", "block_size"):
            for objective in ([rs.objective] if rs.objective else list(out)):
                out[objective] = int(rs.value)
    return out


@dataclass(frozen=True)
class PlannedRun:
    objective: str
    block: int
    seed: int
    steps: int
    probe: bool = False
    tag: str = ""  # variant_tag of the scale it was planned under

    @property
    def name(self) -> str:
        head = "probe-" if self.probe else ""
        return f"{head}{self.objective}-b{self.block}-n{self.steps}-s{self.seed}{self.tag}"


def run_config_dict(root: Path, scale: Scale, run: PlannedRun, device: str) -> dict:
    """The run's config (config_from_dict checks it): the lab target and data, the scale's
    drafter, ``run.max_steps`` the planned steps."""
    cpu = device == "cpu"
    target = {"path": str(root / "target"), "dtype": scale.dtype, "attn_implementation": "sdpa"}
    if scale.layer_ids:
        target["layer_ids"] = list(scale.layer_ids)
    cfg = {
        "run": {"name": run.name, "output_dir": str(root / "train" / "runs"), "seed": run.seed,
                "max_steps": run.steps, "log_every_s": 10.0},
        "target": target,
        "drafter": {"objective": run.objective, "block_size": run.block,
                    "num_layers": scale.drafter_layers, "num_anchors": scale.num_anchors,
                    "mask_token_id": -1, "dtype": "float32" if cpu else "bfloat16"},
        "data": {"path": str(prepared_path(root)), "token_budget": scale.token_budget,
                 "max_seqs_per_batch": scale.max_seqs_per_batch, "max_length": max_length(scale),
                 "eval_prompts": 0 if run.probe else scale.run_eval_prompts},
        "layout": {"device": "cpu" if cpu else "cuda", "targets": [0], "drafters": [0],
                   "hs_queue": 4},
        # epochs high: run.max_steps is what ends a run
        "optim": {"lr": scale.drafter_lr, "warmup_frac": 0.04, "min_lr_frac": 0.1,
                  "epochs": 1000},
        "checkpoint": {"every": 0 if run.probe else max(1, run.steps // 4), "keep": 2},
        "eval": {"every": 0, "max_new_tokens": scale.run_eval_new_tokens,
                 "prompt_tokens": min(256, scale.prompt_max_tokens)},
        "telemetry": {"interval_s": 1.0},
    }
    for rs in run_sets(scale):
        if rs.objective in (None, run.objective):
            cfg.setdefault(rs.section, {})[rs.key] = rs.value
    return cfg


def write_config(root: Path, scale: Scale, run: PlannedRun, device: str) -> Path:
    """The run's YAML; refuses a run folder made under another config."""
    import yaml

    from dflash_core.config import config_from_dict

    cfg = config_from_dict(run_config_dict(root, scale, run, device))
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    path = root / "train" / "configs" / f"{run.name}.yaml"
    run_dir = root / "train" / "runs" / run.name
    if path.is_file() and path.read_text(encoding="utf-8") != text and run_dir.exists():
        raise LabError(f"{run_dir} was trained under another config than this command's "
                       f"({path} differs)",
                       hint=f"pass another --dir, or remove {run_dir} and {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def read_events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line torn by a kill
            continue
    return out


def run_status(run_dir: Path) -> str:
    """finished | resumable (a checkpoint to go on from) | fresh (nothing to keep)."""
    from dflash_core.checkpoint.folders import latest_checkpoint

    if not run_dir.exists():
        return "fresh"
    ended = [e for e in read_events(run_dir) if e.get("event") == "RunEnded"]
    if ended and ended[-1].get("status") == "finished":
        return "finished"
    return "resumable" if latest_checkpoint(run_dir) is not None else "fresh"


def train_one(root: Path, scale: Scale, run: PlannedRun, device: str, log=print) -> dict:
    cfg = write_config(root, scale, run, device)
    run_dir = root / "train" / "runs" / run.name
    status = run_status(run_dir)
    if status != "finished":
        if status == "fresh" and run_dir.exists():
            shutil.rmtree(run_dir)  # this stage's own run, stopped before any checkpoint
        args = ["run", "--config", str(cfg), "--headless"]
        if status == "resumable":
            args.append("--resume")
        log(f"train: {run.name} ({run.steps} steps{', resumed' if status == 'resumable' else ''})")
        log_file = run_dir.parent / f"{run.name}.log"
        rc = dflash_tui(args, log_file)
        if rc != 0 or run_status(run_dir) != "finished":
            raise LabError(f"run {run.name} ended with exit {rc}: {last_line(log_file)}",
                           hint=f"see {log_file}; the same command continues from its last "
                                "checkpoint")
    return run_row(run_dir, run)


def run_row(run_dir: Path, run: PlannedRun) -> dict:
    """What a finished run measured: its in-engine exact tau, its steps and seconds."""
    events = read_events(run_dir)
    evals = [e for e in events if e.get("event") == "EvalResult" and not e.get("prompt_set")]
    metrics = [e for e in events if e.get("event") == "StepMetrics"]
    ended = [e for e in events if e.get("event") == "RunEnded"]
    return {"name": run.name, "objective": run.objective, "block_size": run.block,
            "seed": run.seed, "steps": metrics[-1]["step"] if metrics else 0,
            "planned_steps": run.steps, "step_s": _step_seconds(metrics),
            **_phase_seconds(events, metrics),
            "run_s": ended[-1].get("seconds") if ended else None,
            "tau_heldout": evals[-1]["tau"] if evals else None,
            "train_loss": metrics[-1]["loss"] if metrics else None,
            "tau_tf": metrics[-1]["tau_tf"] if metrics else None,
            "run_dir": str(run_dir)}


def timing(root: Path, scale: Scale, device: str, log=print) -> dict:
    """Seconds per step and start-up seconds of each objective, from its probe (cached)."""
    path = root / "train" / TIMING
    got = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    tag = variant_tag(scale)
    for objective, block in blocks(scale).items():
        if objective + tag in got:
            continue
        probe = PlannedRun(objective, block, 0, scale.probe_steps, probe=True, tag=tag)
        row = train_one(root, scale, probe, device, log)
        if not row["step_s"]:
            raise LabError(f"the probe {probe.name} gave no step time",
                           hint="raise probe_steps (scales.py)")
        got[objective + tag] = {
            "probe_steps": scale.probe_steps, "s_per_step": row["step_s"],
            "overhead_s": round((row["run_s"] or 0) - (row["train_s"] or 0), 1)}
        path.write_text(json.dumps(got, indent=2), encoding="utf-8")
        log(f"timing: {objective}{tag} {row['step_s']} s/step")
    return got


def plan(scale: Scale, times: dict) -> list[PlannedRun]:
    """Every run, seed-major (a sweep cut short still holds both objectives of its first seeds),
    each objective's steps filling ``train_seconds``."""
    tag, size = variant_tag(scale), blocks(scale)
    steps = {o: max(1, round(scale.train_seconds / times[o + tag]["s_per_step"])) for o in size}
    return [PlannedRun(o, size[o], seed, steps[o], tag=tag) for seed in scale.seeds for o in size]


def groups(runs: list[PlannedRun], size: int) -> list[list[PlannedRun]]:
    """The runs in order, ``size`` at a time (the runs trained side by side)."""
    size = max(1, size)
    return [runs[k:k + size] for k in range(0, len(runs), size)]


def ensure_train(root: Path, scale: Scale, device: str, stop_after_s: float = 0.0,
                 log=print) -> bool:
    """Every planned run finished (True), or stopped before a group of runs that would pass
    ``stop_after_s`` seconds of this call (False: the same command continues).

    Runs go ``scale.parallel_runs`` at a time. A group's time is the longest run's alone time
    times a slowdown: until a group has run, a guess of half the group's size (low: four lab
    runs side by side took 3.72x one alone on an H200; a guess too low costs little, since a run
    cut by the call's limit resumes from its checkpoint), then the slowdown the last group
    showed."""
    t0 = time.monotonic()
    times = timing(root, scale, device, log)
    rows = []
    slowdown = None  # the last group's wall time / its longest run's alone time
    for group in groups(plan(scale, times), scale.parallel_runs):
        todo = [r for r in group if run_status(root / "train" / "runs" / r.name) != "finished"]
        alone = [r.steps * times[r.objective + r.tag]["s_per_step"]
                 + times[r.objective + r.tag]["overhead_s"] for r in todo]
        if todo and stop_after_s > 0:
            need = max(alone) * (slowdown or max(1.0, len(todo) / 2))
            if time.monotonic() - t0 + need > stop_after_s:
                log(f"train: stopping before {', '.join(r.name for r in todo)} (~{need:.0f} s) "
                    f"to end within {stop_after_s / 60:.1f} min; run the same command again to "
                    "continue")
                return False
        if todo:
            started = time.monotonic()
            with ThreadPoolExecutor(len(todo)) as pool:
                # each run is its own process; result() raises the first failure
                for f in [pool.submit(train_one, root, scale, r, device, log) for r in todo]:
                    f.result()
            slowdown = (time.monotonic() - started) / max(alone)
            if len(todo) > 1:
                log(f"train: {len(todo)} runs side by side took {slowdown:.2f}x the longest "
                    "one's time alone")
        rows += [run_row(root / "train" / "runs" / r.name, r) for r in group]
        (root / "train" / "runs.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return True
