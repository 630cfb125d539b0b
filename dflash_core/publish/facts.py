"""What the run recorded about a checkpoint, each fact with where it came from: the drafter's
config.json (objective, block size, layers, mask id), the run's config.yaml (target, data path),
training_state.json (steps, the data's identity, device-hours), the data's manifest, the run's
events.jsonl (exact tau per prompt set at the checkpoint's step) and checkpoints/best."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dflash_core.checkpoint.layout import state_json
from dflash_core.families.registry import family, objective_of
from dflash_core.observe import event_log
from dflash_core.observe.device_hours import Figure
from dflash_core.persist.hours_ledger import read_checkpoint_figure
from dflash_core.publish.errors import PublishError
from dflash_core.publish.source import Source, step_of


@dataclass(frozen=True)
class Tau:
    prompt_set: str  # "" = the held-out prompts of the run's data
    tau: float
    prompts: int


@dataclass
class Facts:
    objective: str  # "dflash" | "dspark" | "dflash2"
    title: str  # "DFlash" | "DSpark" | "DFlash2"
    architecture: str
    block_size: int
    drafts_per_round: int
    layer_ids: list
    mask_token_id: int | None
    num_target_layers: int | None
    drafter_layers: int | None
    target: str | None  # target.path as the run's config.yaml records it
    step: int | None
    data: dict = field(default_factory=dict)  # what is known of the data, by name
    taus: list[Tau] = field(default_factory=list)  # at the checkpoint's step
    best: dict | None = None  # checkpoints/best when it names this checkpoint
    hours: Figure | None = None
    sources: dict = field(default_factory=dict)  # fact -> the file it came from
    causal: bool = False  # the block attends causally (config.json is_causal, as vLLM reads it)


def _read_json(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def _run_config(run_dir: Path | None) -> dict:
    if run_dir is None:
        return {}
    try:
        d = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        return d if isinstance(d, dict) else {}
    except (OSError, yaml.YAMLError):
        return {}


def evaluations_at(run_dir: Path, step: int) -> list[Tau]:
    """Exact tau per prompt set of the run's evaluations at ``step`` (events.jsonl's EvalResult
    events; the last of each set, since a resumed run that trained the step again appends its
    own evaluation after the first's)."""
    path = event_log.events_path(run_dir)
    found: dict[str, Tau] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if event_log.kind_of(line) != "EvalResult":
                    continue
                try:
                    e = event_log.parse(line.strip())
                except event_log.UNREADABLE:
                    continue
                if e.step == step and e.tau >= 0:
                    found[e.prompt_set] = Tau(e.prompt_set, float(e.tau), int(e.prompts))
    except OSError:
        return []
    return sorted(found.values(), key=lambda t: (t.prompt_set != "", t.prompt_set))


def _data(run_cfg: dict, state: dict | None) -> tuple[dict, str]:
    """The data as the checkpoint (trainer.data) and the run's config recorded it, and its
    manifest's source and tokenizer when the data folder is still there."""
    ident = ((state or {}).get("trainer") or {}).get("data") or {}
    cfg_path = (run_cfg.get("data") or {}).get("path") if isinstance(run_cfg.get("data"),
                                                                      dict) else None
    out: dict = {}
    where = []
    path = ident.get("path") or cfg_path
    if path:
        out["path"] = str(path)
    if ident:
        where.append("training_state.json trainer.data")
        out.update({k: ident[k] for k in ("id", "samples") if k in ident})
        if isinstance(ident.get("files"), list):
            out["shards"] = len(ident["files"])
    elif cfg_path:
        where.append("the run's config.yaml data.path")
    if path and Path(str(path)).is_dir():
        from dflash_core.data.manifest import MANIFEST

        manifest = _read_json(Path(str(path)) / MANIFEST)
        if manifest:
            where.append(f"the data's {MANIFEST}")
            src = manifest.get("source")
            if isinstance(src, dict) and src.get("path"):
                out["source"] = f"{src['path']}" + (f" ({src['format']})" if src.get("format")
                                                    else "")
            tok = manifest.get("tokenizer")
            if isinstance(tok, dict) and tok.get("name"):
                out["tokenizer"] = str(tok["name"])
    return out, ", ".join(where)


def served_target(run_dir: Path | None, path) -> tuple[str | None, str]:
    """The target a server loads, and where that came from: the run's ``target.path`` as a
    folder's absolute path when it is one here; the demo's ``builtin:tiny`` as the copy the run
    made of it (``RUN/target``), the folder a server can load; else the path as written (a hub
    id, or a folder on another machine). (None, "") when the run recorded none."""
    if not path:
        return None, ""
    path = str(path)
    if path == "builtin:tiny":
        if run_dir is not None and (run_dir / "target" / "config.json").is_file():
            return (str((run_dir / "target").resolve()),
                    "the run's config.yaml target.path (builtin:tiny: the run's copy of it)")
        return None, ("the run's config.yaml names builtin:tiny, and the run folder holds no "
                      "copy of it (target/) to name")
    folder = Path(path).expanduser()
    if not folder.is_absolute() and run_dir is not None and not folder.exists():
        folder = run_dir / folder
    if (folder / "config.json").is_file():
        return str(folder.resolve()), "the run's config.yaml target.path"
    return path, "the run's config.yaml target.path (not a folder here: a hub id, or a path on " \
                 "another machine)"


def _title(fam) -> str:
    """The family's name as people write it: "DFlash" of "a DFlash drafter"."""
    words = fam.title.split()
    return words[1] if len(words) >= 2 else fam.name


def gather(src: Source) -> Facts:
    config = _read_json(src.folder / "config.json")
    if config is None:
        raise PublishError(f"{src.folder / 'config.json'} cannot be read as JSON",
                           "pass a checkpoint written by dflash-tui")
    try:
        fam = family(objective_of(config))
    except ValueError as exc:
        raise PublishError(f"{src.folder}: {exc}", "pass a DFlash, DSpark or DFlash2 checkpoint") from exc
    # DFlash's and DFlash2's entries are in dflash_config, DSpark's at the top level
    block = config.get("dflash_config") if "dflash_config" in config else config
    block = block if isinstance(block, dict) else {}
    b = block.get("block_size")
    if not isinstance(b, int):
        raise PublishError(f"{src.folder / 'config.json'} records no block size",
                           "pass a checkpoint written by dflash-tui")
    from dflash_core.models.served_keys import ServedKeyRefused, read

    try:  # as a server reads it (models/served_keys.py); this engine's checkpoints always pass
        served = read(config, fam.name)[1]
    except ServedKeyRefused as exc:
        raise PublishError(f"{src.folder}: {exc}", "publish a checkpoint this engine trained")
    state = _read_json(state_json(src.folder))
    run_cfg = _run_config(src.run_dir)
    target = (run_cfg.get("target") or {}).get("path") if isinstance(run_cfg.get("target"),
                                                                     dict) else None
    target, target_from = served_target(src.run_dir, target)
    step = step_of(src.folder, state)
    data, data_from = _data(run_cfg, state)
    sources = {
        "objective, block size, layer ids, mask token id": "config.json",
        "target": target_from,
        "steps": "training_state.json step" if state and "step" in state
        else "the folder's name",
        "data": data_from,
    }
    taus = evaluations_at(src.run_dir, step) if src.run_dir is not None and step is not None \
        else []
    sources["tau"] = "the run's events.jsonl (EvalResult at this step)" if taus else ""
    hours = read_checkpoint_figure(src.folder)
    sources["hours"] = "training_state.json trainer.device_hours" if hours else ""
    return Facts(
        objective=fam.name, title=_title(fam),
        architecture=fam.architecture, block_size=b, drafts_per_round=fam.drafts_per_round(b),
        layer_ids=list(block.get("target_layer_ids") or []),
        mask_token_id=block.get("mask_token_id"),
        num_target_layers=config.get("num_target_layers"),
        drafter_layers=config.get("num_hidden_layers"),
        target=str(target) if target else None, step=step, data=data, taus=taus,
        best=src.best, hours=hours, sources=sources, causal=served.causal)
