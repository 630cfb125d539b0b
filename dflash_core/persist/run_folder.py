"""The run folder a new run may write to: never one that holds an earlier run's records.

A run writes config.yaml, events.jsonl, train.log and checkpoints/ into ``run.output_dir /
run.name``. Starting a run (not a resume) in a folder that already holds any of them would
overwrite that run's config and checkpoints and mix the two runs' events, so it is refused with
the two ways out: ``--resume`` to continue that run, or a new run folder (``run.name``, or
``--new-run``, which picks the first free ``<name>-2``, ``<name>-3``, ... beside it).
"""

from __future__ import annotations

from pathlib import Path

from dflash_core.persist.checkpoint import CHECKPOINTS, list_checkpoints
from dflash_core.config import ConfigError

RECORDS = ("config.yaml", "events.jsonl", "train.log", CHECKPOINTS)


def records_in(run_dir: str | Path) -> list[str]:
    """What of an earlier run ``run_dir`` holds (empty: the folder is free to start in). The
    commands/ folder an attached dashboard writes is not a run's record."""
    run_dir = Path(run_dir)
    found = []
    for name in RECORDS:
        path = run_dir / name
        if name == CHECKPOINTS:
            steps = [p.name for p in list_checkpoints(run_dir)]
            if steps:
                found.append(f"checkpoints {', '.join(steps)}")
            elif path.is_dir() and any(path.iterdir()):
                found.append("checkpoints/")
        elif path.exists():
            found.append(name)
    return found


def refuse_if_used(run_dir: Path) -> None:
    """Raise ConfigError (key run.name) when a fresh run would overwrite an earlier one."""
    found = records_in(run_dir)
    if found:
        raise ConfigError(
            "run.name", f"the run folder {run_dir} already holds a run ({'; '.join(found)}); "
            "starting a new run there would overwrite it",
            hint="pass --resume to continue that run, or set a new run.name (or pass --new-run "
                 "to start in a fresh numbered folder beside it)")


def fresh_name(output_dir: str | Path, name: str) -> str:
    """``name`` if its folder holds no run, else the first ``name-N`` (N = 2, 3, ...) that does
    not."""
    if not records_in(Path(output_dir) / name):
        return name
    n = 2
    while records_in(Path(output_dir) / f"{name}-{n}"):
        n += 1
    return f"{name}-{n}"
