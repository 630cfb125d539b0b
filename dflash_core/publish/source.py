"""Which checkpoint a publish reads: a step folder as given, or the one a run folder names
(checkpoints/best, else the latest complete one), verified against its checksums first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_core.checkpoint.checksums import verify
from dflash_core.checkpoint.folders import checkpoint_step, latest_checkpoint, read_best
from dflash_core.checkpoint.layout import CHECKPOINTS, SERVED_FILES
from dflash_core.publish.errors import PublishError


@dataclass(frozen=True)
class Source:
    folder: Path  # the step folder whose served files are published
    run_dir: Path | None  # the run it belongs to (None: a folder outside any run)
    how: str  # how it was chosen, in words ("checkpoints/best names step-6")
    best: dict | None  # the run's checkpoints/best marker when it names this folder
    note: str  # what verification could not check ("" when every file matched)


def _run_of(folder: Path) -> Path | None:
    """The run folder of a step folder (runs/NAME/checkpoints/step-N), when it looks like one."""
    if folder.parent.name == CHECKPOINTS and (folder.parent.parent / "config.yaml").is_file():
        return folder.parent.parent
    return None


def choose(path: Path) -> Source:
    """The step folder ``path`` names, verified; raises PublishError (one line and a hint)."""
    if not path.exists():
        raise PublishError(f"{path} does not exist",
                           "pass a run folder (runs/NAME) or a checkpoint (runs/NAME/checkpoints/"
                           "step-N)")
    if not path.is_dir():
        raise PublishError(f"{path} is a file, not a run folder or a checkpoint folder",
                           "pass runs/NAME or runs/NAME/checkpoints/step-N")
    if (path / CHECKPOINTS).is_dir() or (path / "config.yaml").is_file():
        run_dir = path
        best = read_best(run_dir)
        folder = run_dir / CHECKPOINTS / str(best.get("path", "")) if best else None
        if folder is not None and (folder / "config.json").is_file():
            how = (f"checkpoints/best names {folder.name} (exact tau {float(best['tau']):.4f})"
                   if "tau" in best else f"checkpoints/best names {folder.name}")
        else:
            folder = latest_checkpoint(run_dir)
            if folder is None:
                raise PublishError(f"the run {run_dir} has no complete checkpoint",
                                   "train it until a checkpoint is written, or pass a step "
                                   "folder")
            best = None
            how = f"the latest complete checkpoint, {folder.name} (checkpoints/best names none)"
    else:
        folder, run_dir = path, _run_of(path)
        best = read_best(run_dir) if run_dir is not None else None
        if best is not None and (run_dir / CHECKPOINTS / str(best.get("path", ""))).resolve() \
                != folder.resolve():
            best = None
        how = f"the checkpoint {folder.name} as given"
    missing = [n for n in SERVED_FILES if not (folder / n).is_file()]
    if missing:
        raise PublishError(f"{folder} holds no served weights ({' and '.join(missing)} "
                           f"missing): it is not a checkpoint a server can load",
                           "pass a step folder that holds config.json and model.safetensors")
    found = verify(folder)
    if found.problems:
        raise PublishError(f"checkpoint {folder} is {found.kind}: {'; '.join(found.problems)}",
                           "publish another checkpoint (a step folder of the run), or restore "
                           "this one from a backup; a damaged one is never published")
    return Source(folder, run_dir, how, best, found.note)


def step_of(folder: Path, state: dict | None) -> int | None:
    """Optimizer steps trained: training_state.json's "step", else the folder's name."""
    if isinstance(state, dict) and isinstance(state.get("step"), int):
        return state["step"]
    try:
        return checkpoint_step(folder)
    except ValueError:
        return None
