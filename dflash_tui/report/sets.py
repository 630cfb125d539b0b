"""The report's prompt sets (eval.prompt_sets): each set's exact tau at every evaluation (bounded
as the held-out evaluations are), a line of the summary, and a table of the sets by step. The
held-out evaluation stays RunData's own (its acceptance section and findings too)."""

from __future__ import annotations

from dflash_core.observe import events as ev

from .cells import esc, table
from .series import FirstLast

MAX_SETS = 16  # sets with their own series; a config names a few


class SetSeries:
    """Per set, in the order they first came: (ts, step, tau, prompts, seconds) of each of its
    evaluations (the first and the last ``cap // 2``) and its latest EvalResult."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.evals: dict[str, FirstLast] = {}
        self.latest: dict[str, ev.EvalResult] = {}
        self.extra = 0  # results of sets past MAX_SETS, not shown

    def add(self, e: ev.EvalResult) -> None:
        name = e.prompt_set
        if name not in self.evals:
            if len(self.evals) >= MAX_SETS:
                self.extra += 1
                return
            self.evals[name] = FirstLast(self.cap // 2, self.cap // 2)
        self.evals[name].add((e.ts, e.step, e.tau, e.prompts, e.seconds))
        self.latest[name] = e

    def __bool__(self) -> bool:
        return bool(self.evals)

    def names(self) -> list[str]:
        return list(self.evals)

    def points(self, name: str) -> list[tuple[float, int, float]]:
        """(ts, step, tau) of each kept evaluation of ``name``: the tau plot's line."""
        return [(ts, step, tau) for ts, step, tau, _, _ in self.evals[name].items()]

    def best(self, name: str) -> tuple[float, int]:
        """(tau, step) of the set's highest exact tau among the kept evaluations."""
        return max((tau, step) for _, step, tau, _, _ in self.evals[name].items())


def summary_text(sets: SetSeries) -> str:
    """'gsm8k 2.1000 (16 prompts), mt-bench 1.9500 (32 prompts) at step 300': the summary row."""
    parts = [f"{name} {e.tau:.4f} ({e.prompts} prompts) at step {e.step}"
             for name, e in sets.latest.items()]
    return ", ".join(parts)


def sets_html(sets: SetSeries) -> str:
    """Two tables: each set (prompts, latest, best, seconds of its latest evaluation), and each
    set's exact tau by step, the newest first."""
    rows = []
    for name in sets.names():
        e, (best, at) = sets.latest[name], sets.best(name)
        rows.append([name, e.prompts, f"{e.tau:.4f} at step {e.step}", f"{best:.4f} at step {at}",
                     f"{e.seconds:.1f}", sets.evals[name].count])
    by_step: dict[int, dict[str, float]] = {}
    for name in sets.names():
        for _, step, tau, _, _ in sets.evals[name].items():
            by_step.setdefault(step, {})[name] = tau
    steps = [[st] + [f"{by_step[st][n]:.4f}" if n in by_step[st] else "-" for n in sets.names()]
             for st in sorted(by_step, reverse=True)]
    more = f" ({sets.extra} results of sets past the first {MAX_SETS} not shown)" \
        if sets.extra else ""
    return ("<p>Exact tau on the named prompt sets (eval.prompt_sets), decoded at each evaluation "
            "as the held-out prompts are; the acceptance section below is the held-out "
            f"evaluation's.{esc(more)}</p>"
            + table(["set", "prompts", "latest exact tau", "best exact tau",
                      "seconds (latest)", "evaluations"], rows)
            + "<details open><summary>exact tau on each set at each evaluation</summary>"
            + table(["step"] + sets.names(), steps) + "</details>")

