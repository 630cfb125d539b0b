"""What the terminal shows once the dashboard that owned a run has left the screen: how the run
ended, its folder and the command that resumes it. The screen is gone by then, and with it
everything it said; these lines stay in the terminal's scrollback."""

from __future__ import annotations

from pathlib import Path

from dflash_core.observe.events import Error
from dflash_core.persist.run_folder import RUN_CONFIG, resume_command


def run_folder(records: str | Path) -> Path:
    """The run folder of a process's records: itself, or the folder above node-K/ (several
    nodes), whichever holds the run's config.yaml."""
    records = Path(records)
    if not (records / RUN_CONFIG).is_file() and (records.parent / RUN_CONFIG).is_file():
        return records.parent
    return records


def exit_summary(state: str, step: int | None, failure: Error | None,
                 records: str | Path | None) -> str:
    """A few lines: the outcome (finished / aborted / failed and the error's first line), the
    run folder and the resume command; "" when no run was started (nothing to say)."""
    if state == "idle":
        return ""
    at = f" at step {step}" if step else ""
    outcome = f"dflash-tui: run {state}{at}"
    if state == "failed" and failure is not None:
        lines = failure.message.strip().splitlines()
        outcome += f": [{failure.error_kind}] {lines[0] if lines else failure.error_kind}"
    out = [outcome]
    if records is None:
        return "\n".join(out)
    folder = run_folder(records)
    out.append(f"  run folder: {folder}")
    if (folder / RUN_CONFIG).is_file():
        more = ("  (raise run.max_steps or optim.epochs in that file to train on)"
                if state == "finished" else "")
        out.append(f"  resume:     {resume_command(folder)}{more}")
    if state == "failed":
        out.append(f"  details:    {folder / 'train.log'}")
    return "\n".join(out)
