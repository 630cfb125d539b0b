"""Step numbers (loss, lr, grad norm, tokens/s, samples/s, teacher-forced tau, last evaluated tau),
where the drafters' time goes, above a plot of the loss history."""

from __future__ import annotations

import math
from statistics import fmean

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Sparkline, Static

from .. import fmt
from ..state import DashboardState
from .panel import Panel, field, note, pack


# Narrower than this (an 80-column terminal) the drafters' time split gives way to the loss plot.
DRAFTER_LINE_MIN_WIDTH = 50


class TrainingPanel(Panel):
    TITLE = "Training"
    EMPTY = "no step yet"

    def compose(self) -> ComposeResult:
        yield from super().compose()
        yield Static("", classes="caption")
        # mean, not max: a bucket of steps should read as its typical loss, not its worst one
        yield Sparkline([], summary_function=fmean, id="loss-plot")

    def draw(self, s: DashboardState, width: int) -> Text:
        plot = self.query_one(Sparkline)
        # log scale: the first steps' loss (tens) would otherwise flatten the rest of the curve
        plot.data = [math.log(max(x, 1e-6)) for x in s.loss_history]
        plot.display = bool(s.loss_history)
        caption = self.query_one(".caption", Static)
        st = s.step
        if st is None:
            caption.update("")
            return note(empty_reason(s), width)
        hist = s.loss_history
        caption.update(Text(f"loss (log scale) over the last {len(hist)} steps: "
                            f"{min(hist):.3f} .. {max(hist):.3f}", style="dim"))
        ev_tau = f"{s.eval.tau:.2f} @{s.eval.step}" if s.eval else "-"
        main = pack([
            field("loss", f"{st.loss:.4f}", "bold green"),
            field("lr", f"{st.lr:.2e}"),
            field("grad", f"{st.grad_norm:.3f}"),
            field("tok/s", fmt.rate(st.tokens_per_s)),
            field("samples/s", f"{st.samples_per_s:.2f}"),
            field("τ tf", f"{st.tau_tf:.2f}"),
            field("τ eval", ev_tau),
            field("pad", fmt.pct(st.padding_frac)) if st.padding_frac else Text(),
        ], width)
        lines = [main]
        shares = s.drafter_shares()
        if shares is not None and width >= DRAFTER_LINE_MIN_WIDTH:
            lines.append(pack([Text("drafters:", style="dim")] + [
                field(name, fmt.pct(shares[key])) for name, key in (
                    ("data", "waiting"), ("compute", "compute"), ("peers", "barrier"),
                    ("step", "step"))], width))
        if s.eval_history:
            lines.append(eval_line(s, width))
        return Text("\n").join(lines)


def empty_reason(s: DashboardState) -> str:
    """What a Training panel with no step says: why there is none."""
    if s.plan is not None and s.plan.start_step and s.plan.start_step >= s.plan.total_steps:
        return (f"no step to take: the run resumed at step {s.plan.start_step}, where it ends "
                f"({s.plan.limit()})")
    why = s.ended_before("training")
    if why:
        return f"no step: {why}"
    return "no step in this run" if s.ended else TrainingPanel.EMPTY


def eval_line(s: DashboardState, width: int) -> Text:
    """Exact tau over the run (a small plot), the gap to teacher-forced tau (red past
    eval.tau_gap_warn: training and serving disagree), how often each block position was
    accepted at the latest evaluation."""
    taus = [tau for _, tau, _ in s.eval_history]
    gap = s.tau_gap
    warn = gap is not None and gap > s.tau_gap_warn
    parts = [Text("τ exact ", style="dim"), Text(fmt.spark(taus, 16), style="cyan"),
             Text(f" {taus[-1]:.2f}", style="bold")]
    if gap is not None:
        parts.append(Text(f" tf gap {gap:+.2f}", style="bold white on red" if warn else "dim"))
    rates = s.accepted_by_position()
    if rates:
        parts.append(Text("  accepted@k ", style="dim"))
        parts.append(Text(" ".join(f"{r:.0%}" for r in rates[:15])))
    text = Text.assemble(*parts)
    text.truncate(max(1, width), overflow="ellipsis")
    return text
