"""The report's tau by context length (context_buckets.py): the latest held-out evaluation and
each prompt set's latest, those with rounds in more than one bucket, as a plot (a line each) and
a table (a row each: per bucket its tau and rounds)."""

from __future__ import annotations

from dflash_core.context_buckets import BY_CONTEXT, bucket_text, shown, with_rounds
from dflash_core.observe import events as ev

from .cells import esc, table
from .data import RunData


def context_evals(data: RunData) -> list[tuple[str, ev.EvalResult]]:
    """(set name, "" for the held-out prompts; its latest EvalResult) of those shown."""
    latest = ([("", data.last_eval)] if data.last_eval is not None else []) + list(
        data.sets.latest.items())
    return [(name, e) for name, e in latest if shown(getattr(e, "context", None))]


def context_html(evals: list[tuple[str, ev.EvalResult]], plot: str) -> str:
    rows = [[f"set {name}" if name else "held-out prompts", e.step,
             "  ".join(bucket_text(r) for r in with_rounds(e.context))] for name, e in evals]
    return (f"<p>{esc(BY_CONTEXT.meaning)}. Buckets follow the target's window "
            "(docs/eval.md, \"Tau by context length\").</p>"
            + f'<div class="small">{plot}</div>'
            + table(["evaluation", "step", "tau (rounds) per bucket of tokens"], rows))
