"""Which checkpoint a resume loads, and whether it is the model the config describes.

- nothing to resume: said plainly (a warning), and the run starts at step 0;
- a damaged or incomplete checkpoint (a file missing, truncated, garbled, or not matching its
  checksum): each fault named, the folder moved aside to ``checkpoints/damaged-step-<N>`` (kept
  for inspection, never deleted, never picked again), and the newest intact older one is loaded
  instead, saying which step and how many steps that costs; none intact: refused (the run is not
  started over silently), then and at every later resume until one is restored or the user
  starts over;
- a checkpoint written before checksums (format 2 or 1): resumed, with a note that it could not
  be verified;
- a checkpoint of other data than ``data.path`` (its recorded data identity,
  data_identity.py): refused naming both, unless ``data.allow_changed_data``;
- a checkpoint of the other objective than ``drafter.objective`` (a DSpark checkpoint resumed as
  DFlash, or the other way): refused, naming both;
- a checkpoint of another drafter shape than the config's (layers, block size, widths, target
  layers, mask id, target vocabulary; DSpark's Markov rank and confidence head; the rotary
  settings, which are the target's): refused, naming every differing key with both values (a
  block size other than the checkpoint's is one: the weights would load, but the slots and their
  weights would mean other positions; a rotation other than the checkpoint's is another: its
  positions would mean other ones);
- a checkpoint written with another optimizer than ``optim.name``: refused, naming both.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.folders import (
    checkpoint_step, damaged_folders, set_aside, step_folders,
)
from dflash_core.checkpoint.layout import CHECKPOINTS, CheckpointError
from dflash_core.checkpoint.data_identity import describe
from dflash_core.config import Config, ConfigError
from dflash_core.models.rope_settings import RopeConflict, config_rope
from dflash_core.observe.events import Event, LoadProgress, Log
from dflash_core.units import GiB

# Drafter config.json entries that change the model, and the config key that sets each.
SHAPE_KEYS: list[tuple[str, str]] = [
    ("num_hidden_layers", "drafter.num_layers"),
    ("dflash_config.block_size", "drafter.block_size"),
    ("dflash_config.target_layer_ids", "target.layer_ids"),
    ("dflash_config.mask_token_id", "drafter.mask_token_id"),
    ("hidden_size", "drafter.hidden_size"),
    ("intermediate_size", "drafter.intermediate_size"),
    ("num_attention_heads", "drafter.num_attention_heads"),
    ("num_key_value_heads", "drafter.num_key_value_heads"),
    ("head_dim", "drafter.hidden_size"),
    ("vocab_size", "target.path"),
    ("num_target_layers", "target.path"),
    # DSpark's config.json has its entries at the top level (dspark/format.py)
    ("block_size", "drafter.block_size"),
    ("target_layer_ids", "target.layer_ids"),
    ("mask_token_id", "drafter.mask_token_id"),
    ("markov_rank", "drafter.markov_rank"),
    ("enable_confidence_head", "drafter.conf_weight"),
    # DFlash2's, in its dflash_config (dflash2/format.py)
    ("dflash_config.conv_kernel_size", "drafter.conv_kernel_size"),
    ("dflash_config.conv_group_size", "drafter.conv_group_size"),
    ("dflash_config.selector_rank", "drafter.selector_rank"),
    ("dflash_config.selector_top_k", "drafter.selector_top_k"),
]


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def shape_differences(expected: dict, found: dict) -> list[tuple[str, str, object, object]]:
    """(config key, drafter config entry, the config's value, the checkpoint's value) for each
    entry of SHAPE_KEYS on which the two drafter configs differ, then the rotary settings (read
    from either spelling: a checkpoint of transformers 4 has rope_theta + rope_scaling only)."""
    diffs = []
    for entry, key in SHAPE_KEYS:
        want, have = _get(expected, entry), _get(found, entry)
        if want is not None and want != have:
            diffs.append((key, entry, want, have))
    want = config_rope(expected)  # this code's, or drafter.init_from's (preflight read it)
    try:
        have = config_rope(found)
    except RopeConflict as exc:
        have = f"two spellings that differ ({exc})"
    if want is not None and want != have:
        diffs.append(("target.path", "rope_parameters", want, have))
    return diffs


def expected_drafter_config(cfg: Config, target_path: Path, layer_ids: list[int],
                            mask_id: int) -> dict:
    """The drafter config.json a fresh run of ``cfg`` would write (what build_replicas builds)."""
    if cfg.drafter.init_from:
        path = Path(cfg.drafter.init_from) / "config.json"
        try:
            found = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError("drafter.init_from", f"cannot read {path}: {exc}",
                              hint="point drafter.init_from at a drafter checkpoint folder") from exc
        from dflash_core.families.registry import family_of
        from dflash_core.models.registry import start_config

        # A family that starts from another's folder (DFlash2 from DFlash) writes its own.
        return start_config(found, cfg.drafter.objective, family_of(cfg).settings(cfg.drafter))
    from dflash_core.families.registry import family_of
    from dflash_core.models.registry import expected_config
    from dflash_core.models.target.config import load_target_config

    d = cfg.drafter
    target_config = load_target_config(Path(target_path), cfg.target.trust_remote_code)
    return expected_config(
        d.objective, target_config, num_layers=d.num_layers, target_layer_ids=layer_ids,
        block_size=d.block_size, mask_token_id=mask_id, settings=family_of(cfg).settings(d),
        hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_attention_heads=d.num_attention_heads, num_key_value_heads=d.num_key_value_heads)


def _lost(found: list[int], step: int | None) -> str:
    """The steps a resume from ``step`` (None: none) trains again, said for damaged ``found``."""
    newest = max(found)
    if step is None:
        return f"steps 1 to {newest} ({newest} steps)"
    n = newest - step
    return f"steps {step + 1} to {newest} ({n} step{'s' if n != 1 else ''})" if n > 0 else \
        "no steps"


def _refuse_all_damaged(run_dir: Path, damaged: list[str], steps: list[int]) -> None:
    root = Path(run_dir) / CHECKPOINTS
    raise CheckpointError(
        f"resume: no intact checkpoint in {root}: every one is damaged and set aside "
        f"({', '.join(damaged)}); resuming would start over, losing {_lost(steps, None)}",
        hint="restore a checkpoint from a backup into that folder, or start over deliberately: "
             "drop --resume and pass --new-run (a fresh folder beside this one; the damaged "
             "ones stay for inspection)")


def load_for_resume(run_dir: Path, expected: dict | None, publish: Callable[[Event], None], *,
                    set_aside_damaged: bool = True) -> ckpt.LoadedCheckpoint | None:
    """The newest intact checkpoint of ``run_dir`` that matches ``expected`` (None: nothing to
    resume). Every checkpoint is verified against its checksums before it is loaded; a damaged
    or incomplete one is set aside and the next older one tried. Raises CheckpointError when no
    intact checkpoint is left (also when earlier resumes set them all aside), ConfigError on a
    shape mismatch. ``set_aside_damaged`` False: a damaged one is only skipped (the other nodes
    of a shared run folder leave the move to node 0, which makes the same choice)."""
    found = step_folders(run_dir)
    earlier = damaged_folders(run_dir)
    if not found:
        if earlier:
            _refuse_all_damaged(run_dir, [str(p) for p in earlier],
                                [checkpoint_step(p) for p in earlier])
        publish(Log(level="warning", source="engine", message=(
            f"resume: nothing to resume, no checkpoint in {Path(run_dir) / CHECKPOINTS}; "
            "starting at step 0")))
        return None
    damaged: list[str] = []
    damaged_steps: list[int] = []
    for folder in reversed(found):
        t0 = time.monotonic()
        last = [0.0]

        def progress(done: int, total: int, shards: int, shards_total: int) -> None:
            now = time.monotonic()
            end = shards == shards_total
            if now - last[0] >= 0.5 or end:  # two lines a second at most, and the end
                last[0] = now
                publish(LoadProgress(worker="checkpoint", device="host", bytes_loaded=done,
                                     bytes_total=total, shards_loaded=shards,
                                     shards_total=shards_total, seconds=now - t0, done=end))
        try:
            loaded = ckpt.load_checkpoint(folder, progress=progress)
        except CheckpointError as exc:
            damaged_steps.append(checkpoint_step(folder))
            if not set_aside_damaged:
                damaged.append(str(folder))
                publish(Log(level="warning", source="engine", message=(
                    f"resume: {exc}; node 0 sets it aside; trying the next older checkpoint")))
                continue
            moved = set_aside(folder)
            damaged.append(str(moved))
            publish(Log(level="warning", source="engine", message=(
                f"resume: {exc}; moved it to {moved} (kept, not deleted) and trying the next "
                "older checkpoint")))
            continue
        # Its subfolder (the training state) counted too.
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        took = time.monotonic() - t0
        checked = "verified" if not loaded.note else "read"
        publish(Log(level="info", source="engine", message=(
            f"resume: {checked} {folder} ({size / GiB:.1f} GiB) in {took:.1f} s "
            f"({size / GiB / max(took, 1e-9):.2f} GiB/s)")))
        if loaded.note:
            publish(Log(level="info", source="engine", message=(
                f"resume: {folder} was {loaded.note}; resuming from it as it is")))
        if damaged:
            publish(Log(level="warning", source="engine", message=(
                f"resume: resuming from {folder} (step {loaded.step}), the newest intact "
                f"checkpoint: {_lost(damaged_steps, loaded.step)} are trained again; "
                f"damaged: {damaged}")))
        if expected is not None:
            check_objective(expected, loaded.drafter_config, folder)
            diffs = shape_differences(expected, loaded.drafter_config)
            if diffs:
                listed = "; ".join(f"{key} ({entry}): config {want!r}, checkpoint {have!r}"
                                   for key, entry, want, have in diffs)
                raise ConfigError(
                    diffs[0][0], f"the checkpoint {folder} is another drafter than the config "
                    f"describes: {listed}",
                    hint="set these keys back to the checkpoint's values to resume it, or start "
                         "a new run (new run.name or --new-run) to train the new shape")
        return loaded
    _refuse_all_damaged(run_dir, damaged, damaged_steps + [checkpoint_step(p)
                                                           for p in earlier])


def check_objective(expected: dict, found: dict, folder: Path) -> None:
    """A checkpoint of the other objective (DSpark's architecture against DFlash's) is refused
    before its shape is compared: ConfigError naming drafter.objective and both."""
    from dflash_core.families.registry import FAMILIES, objective_of

    try:
        want, have = objective_of(expected), objective_of(found)
    except ValueError as exc:
        raise ConfigError("drafter.objective", f"the checkpoint {folder}: {exc}",
                          hint="resume a checkpoint this engine wrote, or start a new run "
                               "(new run.name or --new-run)") from exc
    if want != have:
        raise ConfigError("drafter.objective",
                          f"the checkpoint {folder} holds {FAMILIES[have].title}, but "
                          f"drafter.objective is {want}",
                          hint=f"set drafter.objective: {have} to resume it, or start a new "
                               "run (new run.name or --new-run) to train a new drafter")


def check_resume_data(loaded: ckpt.LoadedCheckpoint, data: dict, allow_changed: bool,
                      publish: Callable[[Event], None]) -> None:
    """A checkpoint resumes on the data it trained on (``data``: the identity of data.path now,
    data_identity.py): its data position names batches of that data's plan. Another
    data set is refused naming both (ConfigError, key data.allow_changed_data), or, with
    ``allow_changed``, resumed with a warning. A checkpoint written before identities were
    recorded resumes with a note."""
    wrote = loaded.trainer_state.get("data")
    if not isinstance(wrote, dict) or "id" not in wrote:
        publish(Log(level="info", source="engine", message=(
            f"resume: {loaded.path} was written before checkpoints recorded their data: it "
            f"cannot be checked that data.path {data['path']} is the data it trained on")))
        return
    if wrote["id"] == data["id"]:
        if wrote.get("path") != data["path"]:
            publish(Log(level="info", source="engine", message=(
                f"resume: the data moved from {wrote.get('path')} to {data['path']}; "
                f"the same data (data {data['id']})")))
        return
    what = ("its manifest differs" if wrote.get("manifest") and data.get("manifest")
            and wrote["manifest"] != data["manifest"] else "its shards differ (names or sizes)")
    epoch, done = loaded.trainer_state.get("epoch", 0), len(loaded.trainer_state.get("done", []))
    if allow_changed:
        publish(Log(level="warning", source="engine", message=(
            f"resume: data.path {describe(data)} is not the data the checkpoint {loaded.path} "
            f"trained on, {describe(wrote)}: {what}; resuming on it (data.allow_changed_data): "
            f"its position, epoch {epoch} with {done} batches done, now counts this data's "
            "batches")))
        return
    back = (f"put the data it trained on back in {data['path']}" if wrote.get("path") ==
            data["path"] else f"point data.path at the data it trained on ({wrote.get('path')})")
    raise ConfigError(
        "data.path", f"{describe(data)} is not the data the checkpoint {loaded.path} trained "
        f"on, {describe(wrote)}: {what}; set data.allow_changed_data: true to resume on it "
        "deliberately",
        hint=f"{back}, or set data.allow_changed_data: true (its data position then counts "
             "this data's batches), or start a new run (a new run.name or --new-run) on it")


def check_resume_nodes(loaded: ckpt.LoadedCheckpoint, nodes: int) -> None:
    """A checkpoint resumes on as many nodes as wrote it: the data position, the steps of the
    plan and the learning-rate schedule count every node's drafters. Raises ConfigError."""
    wrote = int(loaded.trainer_state.get("nodes", 1))
    if wrote != nodes:
        raise ConfigError(
            "", f"the checkpoint {loaded.path} was written by a run on {wrote} node(s) and this "
            f"run has {nodes}: its data position, planned steps and learning-rate schedule count "
            f"{wrote} node(s)' drafters",
            hint=f"start {wrote} node(s) (torchrun --nnodes {wrote}) to resume it, or start a new "
                 "run (a new run.name) on this many nodes, with drafter.init_from pointing at "
                 "that checkpoint to keep its weights")


def check_resume_optimizer(loaded: ckpt.LoadedCheckpoint, cfg: Config) -> None:
    """A checkpoint resumes with the optimizer that wrote it: AdamW's two moments and Muon's
    momentum are not each other's state, and a silent fresh start would not be the exact resume
    asked for. Raises ConfigError naming both."""
    from dflash_core.models.training.optimizers import state_name

    wrote = state_name(loaded.trainer_state)
    if wrote != cfg.optim.name:
        raise ConfigError(
            "optim.name", f"the checkpoint {loaded.path} was written with optim.name {wrote!r} "
            f"and the config asks for {cfg.optim.name!r}: its optimizer state is {wrote}'s",
            hint=f"set optim.name: {wrote} to resume it, or start a new run (a new run.name or "
                 "--new-run) with drafter.init_from pointing at that checkpoint to keep its "
                 f"weights and train on with {cfg.optim.name}")
