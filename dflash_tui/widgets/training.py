"""Step numbers (loss, lr, grad norm, tokens/s, samples/s, teacher-forced tau, last evaluated tau),
where the drafters' time goes, above a plot of the loss history."""

from __future__ import annotations

import math
from statistics import fmean

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Sparkline, Static

from dflash_core.models import acceptance

from .. import fmt
from ..state import DashboardState
from .panel import Panel, field, pack


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
            return Text(self.EMPTY, style="dim")
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
            lines.extend(eval_lines(s, width))
        return Text("\n").join(lines)


def eval_lines(s: DashboardState, width: int) -> list[Text]:
    """Exact tau over the run (a small plot) beside the teacher-forced taus of the latest
    evaluation and the mismatch gap (red past eval.tau_gap_warn: training and decoding
    disagree); under them the data/target agreement, how often each block position was
    accepted, and the findings raised (acceptance.py: what each measure and gap means)."""
    e = s.eval
    taus = [tau for _, tau, _ in s.eval_history]
    first = acceptance.MEASURES[0]
    parts = [Text(f"{first.label} ", style="dim"), Text(fmt.spark(taus, 16), style="cyan"),
             Text(f" {taus[-1]:.2f}", style="bold")]
    gap = s.tau_gap
    for m in acceptance.MEASURES[1:]:
        value = getattr(e, m.key, acceptance.MISSING) if e else acceptance.MISSING
        if value >= 0:
            parts += [Text(f"  {m.label} ", style="dim"), Text(f"{value:.2f}")]
        if m is acceptance.MEASURES[1] and gap is not None:
            # next to (b): the gap the mismatch alarm watches
            warn = gap > s.tau_gap_warn
            parts.append(Text(f" gap {gap:+.2f}", style="bold white on red" if warn else "dim"))
    lines = [Text.assemble(*parts)]
    more: list[Text] = []
    if e is not None and e.agreement >= 0:
        more += [Text(f"{acceptance.AGREEMENT.label} ", style="dim"), Text(f"{e.agreement:.0%}"),
                 Text("  ")]
    rates = s.accepted_by_position()
    if rates:
        more += [Text(f"{acceptance.ACCEPTED.label} ", style="dim"),
                 Text(" ".join(f"{r:.0%}" for r in rates[:15]))]
    for kind in (e.findings if e is not None else []):
        more.append(Text(f"  {kind}", style="bold white on red"))
    if more:
        lines.append(Text.assemble(*more))
    for line in lines:
        line.truncate(max(1, width), overflow="ellipsis")
    return lines
