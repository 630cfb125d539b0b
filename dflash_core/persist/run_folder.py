"""The run folder a new run may write to: never one that holds an earlier run.

A run writes config.yaml, events.jsonl, train.log and checkpoints/ into ``run.output_dir /
run.name``. Starting a run (not a resume) in a folder that holds an earlier run would overwrite
that run's config and checkpoints and mix the two runs' events, so it is refused with the two ways
out: ``--resume`` to continue that run, or a new run folder (``run.name``, or ``--new-run``, which
picks the first free ``<name>-2``, ``<name>-3``, ... beside it).

An earlier run is one with something to lose: a checkpoint, a trained step in events.jsonl, or
a start that has not ended (it may still be loading in another process). Attempts that all ended
before their first step (a preflight that refused the config, a missing GPU) hold nothing to
lose: a corrected config starts in their folder, its events appended after theirs.
"""

from __future__ import annotations

from pathlib import Path

from dflash_core.config import ConfigError
from dflash_core.checkpoint.folders import list_checkpoints
from dflash_core.checkpoint.layout import CHECKPOINTS

RECORDS = ("config.yaml", "events.jsonl", "train.log", CHECKPOINTS)
EVENTS = "events.jsonl"
_CHUNK = 1 << 20


def records_in(run_dir: str | Path) -> list[str]:
    """What records of earlier starts ``run_dir`` holds (empty: none at all). The commands/ folder
    an attached dashboard writes is not a run's record."""
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


def _marker(kind: str) -> bytes:
    return f'"event":"{kind}"'.encode()  # how events.Event.to_json writes the kind


def _events_story(path: Path) -> tuple[bool, bool]:
    """(trained, ended) of an events.jsonl: some step was taken; the last start has its end.
    Reads forward until the first step (near the top of any run that trained), so only a file of
    attempts that never trained is read whole, and those are small."""
    step, started, ended = _marker("StepMetrics"), _marker("RunStarted"), _marker("RunEnded")
    last_start = last_end = -1
    offset, carry = 0, b""
    with open(path, "rb") as f:  # unreadable: an io error, as the sink's would be
        while block := f.read(_CHUNK):
            text = carry + block
            if step in text:
                return True, False
            base = offset - len(carry)  # the file offset of text[0]
            if (hit := text.rfind(started)) >= 0:
                last_start = max(last_start, base + hit)
            if (hit := text.rfind(ended)) >= 0:
                last_end = max(last_end, base + hit)
            offset += len(block)
            carry = text[-len(step):]  # a marker cut by the chunk's edge
    return False, last_end > last_start


def earlier_run(run_dir: str | Path) -> list[str]:
    """Why ``run_dir`` holds a run a new start must not overwrite (empty: it may start there)."""
    run_dir = Path(run_dir)
    why = []
    found = records_in(run_dir)
    if any(r.startswith(CHECKPOINTS) for r in found):
        why.append("it has checkpoints")
    if EVENTS in found:
        trained, ended = _events_story(run_dir / EVENTS)
        if trained:
            why.append("its events.jsonl has trained steps")
        elif not ended:
            why.append("its last start in events.jsonl has not ended: it may still be running in "
                       "another process, or that process was killed")
    elif "train.log" in found:
        why.append("it has a train.log without events.jsonl")
    return why


def refuse_if_used(run_dir: Path) -> str:
    """Raise ConfigError (key run.name) when a fresh run would overwrite an earlier one. Returns
    what of earlier attempts the new run will start beside ("" for a folder without records)."""
    found = records_in(run_dir)
    why = earlier_run(run_dir)
    if why:
        raise ConfigError(
            "run.name", f"the run folder {run_dir} already holds a run ({'; '.join(found)}): "
            f"{'; '.join(why)}; starting a new run there would overwrite it",
            hint="pass --resume to continue that run, or set a new run.name (or pass --new-run "
                 "to start in a fresh numbered folder beside it)")
    return f"{run_dir}, beside the records of earlier attempts ({'; '.join(found)})" \
        if found else ""


def fresh_name(output_dir: str | Path, name: str) -> str:
    """``name`` if its folder holds no earlier run, else the first ``name-N`` (N = 2, 3, ...)
    that does not."""
    if not earlier_run(Path(output_dir) / name):
        return name
    n = 2
    while earlier_run(Path(output_dir) / f"{name}-{n}"):
        n += 1
    return f"{name}-{n}"


RUN_CONFIG = "config.yaml"  # the config a run uses, its --set applied, in its run folder


def resume_command(run_folder: str | Path) -> str:
    """The command that continues the run in ``run_folder`` from its latest checkpoint: its own
    config.yaml, which holds every --set it was started with (a demo's too), so nothing else
    needs repeating."""
    import shlex

    return f"dflash-tui run --config {shlex.quote(str(Path(run_folder) / RUN_CONFIG))} --resume"
