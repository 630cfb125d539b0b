"""Step numbers (loss, lr, grad norm, tokens/s, samples/s, teacher-forced tau, last evaluated tau;
DSpark's three loss terms), where the drafters' time goes, above a plot of the loss history."""

from __future__ import annotations

import math
from statistics import fmean

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Sparkline, Static

from dflash_core import acceptance, context_buckets
from dflash_core.models.dspark.calibration import Calibration
from dflash_core.observe.sinks.textlog import LOSS_TERMS

from .. import fmt
from ..state.dashboard import DashboardState
from .panel import Panel, field, note, pack, pack_first


# Narrower than this (an 80-column terminal) the drafters' time split gives way to the loss plot.
DRAFTER_LINE_MIN_WIDTH = 50


class TrainingPanel(Panel):
    PANEL_ID = "training"
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
        caption.update(Text(loss_caption(s.loss_history, width), style="dim"))
        evals = eval_lines(s, width) if s.eval_history or s.set_evals else []
        # Rows of the panel: the numbers, the drafters' split, the evaluation, the caption and at
        # least one row of the plot. A small terminal (80x24: 5 rows) keeps what matters most.
        height = self.scrollable_content_region.height or 100
        room = max(1, height - len(evals) - 2)
        main = pack_first([
            (0, field("loss", f"{st.loss:.4f}", "bold green")),
            # DSpark: its loss's terms (cross-entropy, total variation, confidence)
            *[(3, field(name, f"{v:.3f}")) for name, v in loss_terms(st)],
            (2, field("lr", f"{st.lr:.2e}")),
            (3, field("grad", f"{st.grad_norm:.3f}")),
            (1, field("tok/s", fmt.rate(st.tokens_per_s))),
            (2, field("samples/s", f"{st.samples_per_s:.2f}")),
            (0, field("τ tf", f"{st.tau_tf:.2f}")),
            # the evaluation's own line says it when there is one
            (4 if evals else 1, field("τ eval", f"{s.eval.tau:.2f} @{s.eval.step}"
                                      if s.eval else "-")),
            (4, field("pad", fmt.pct(st.padding_frac)) if st.padding_frac else Text()),
        ], width, room)
        lines = [main]
        shares = s.drafter_shares()
        if (shares is not None and width >= DRAFTER_LINE_MIN_WIDTH
                and len(main.plain.split("\n")) < room):
            lines.append(pack([Text("drafters:", style="dim")] + [
                field(name, fmt.pct(shares[key])) for name, key in (
                    ("data", "waiting"), ("compute", "compute"), ("peers", "barrier"),
                    ("step", "step"))], width))
        lines += evals
        return Text("\n").join(lines)


def loss_terms(st) -> list[tuple[str, float]]:
    """(label, value) of a step's family loss terms (DSpark: ce, tv, conf; DFlash2: ce, sel,
    hit); [] for DFlash."""
    got = [(name, getattr(st, key, -1.0)) for name, key in LOSS_TERMS]
    return [(name, v) for name, v in got if v >= 0]


def loss_caption(hist, width: int) -> str:
    """The plot's range and span in words, as long as the width allows: its low and high
    values are never the part cut off."""
    lo, hi, n = min(hist), max(hist), len(hist)
    for text in (f"loss (log scale) over the last {n} steps: {lo:.3f} .. {hi:.3f}",
                 f"loss {lo:.3f} .. {hi:.3f} (log scale, last {n} steps)",
                 f"loss {lo:.3f}..{hi:.3f}, log, {n} steps",
                 f"loss {lo:.3g}..{hi:.3g}"):
        if len(text) <= width:
            return text
    return text


def empty_reason(s: DashboardState) -> str:
    """What a Training panel with no step says: why there is none."""
    if s.plan is not None and s.plan.start_step and s.plan.start_step >= s.plan.total_steps:
        return (f"no step to take: the run resumed at step {s.plan.start_step}, where it ends "
                f"({s.plan.limit()})")
    why = s.ended_before("training")
    if why:
        return f"no step: {why}"
    return "no step in this run" if s.ended else TrainingPanel.EMPTY


def eval_lines(s: DashboardState, width: int) -> list[Text]:
    """Exact tau over the run (a small plot) beside the teacher-forced taus of the latest
    evaluation and the mismatch gap (red past eval.tau_gap_warn: training and decoding
    disagree); under them exact tau on each prompt set of eval.prompt_sets, the data/target
    agreement, how often each block position was accepted, and the findings raised
    (acceptance.py: what each measure and gap means)."""
    sets = [set_line(s, width)] if s.set_evals else []
    sets += context_lines(s)
    if not s.eval_history:  # prompt sets only (data.eval_prompts 0)
        return [_cut(line, width) for line in sets]
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
    lines = [Text.assemble(*parts)] + sets
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
    cal = Calibration.from_dict(getattr(e, "calibration", None)) if e is not None else None
    if cal is not None:
        # the confidence head (DSpark): per slot expected / observed, ECE, tau at each budget
        # ECE and tau@k first: on a narrow panel the per-slot list is what the cut takes
        fields = acceptance.calibration_fields(cal)
        parts = []
        for label, value in fields[1:] + fields[:1]:
            parts += [Text(f"{label} ", style="dim"), Text(value), Text("  ")]
        if parts:
            lines.append(Text.assemble(*parts[:-1]))
    return [_cut(line, width) for line in lines]


def context_lines(s: DashboardState) -> list[Text]:
    """'tau by context 0-1k 2.91 (412)  1-4k 2.30 (80)': exact tau per bucket of the rounds'
    context length (context_buckets.py), the rounds in brackets, for the latest held-out
    evaluation and each set's latest ('... on long-docs ...'); only those with rounds in more
    than one bucket (with one, the bucket's tau is the evaluation's own)."""
    latest = ([("", s.eval)] if s.eval is not None else []) + list(s.set_evals.latest.items())
    lines = []
    for name, e in latest:
        records = getattr(e, "context", None)
        if not context_buckets.shown(records):
            continue
        parts = [Text(context_buckets.BY_CONTEXT.label + (f" on {name}" if name else ""),
                      style="dim")]
        for r in context_buckets.with_rounds(records):
            parts += [Text(f"  {r['bucket']} ", style="dim"), Text(f"{r['tau']:.2f}",
                                                                   style="bold"),
                      Text(f" ({r['rounds']})", style="dim")]
        lines.append(Text.assemble(*parts))
    return lines


def set_line(s: DashboardState, width: int) -> Text:
    """'tau exact on gsm8k ▃█ 2.10  mt-bench ▂▅ 1.95': each set's exact tau over the run and its
    latest, in the held-out line's words; without the plots when they do not fit."""
    label = Text(f"{acceptance.MEASURES[0].label} on ", style="dim")
    for plot in (8, 0):
        parts = [label]
        for name in s.set_evals.names():
            taus = list(s.set_evals.taus[name])
            parts += [Text(f"{name} ", style="dim")]
            if plot:
                parts += [Text(fmt.spark(taus, plot), style="cyan"), Text(" ")]
            parts += [Text(f"{taus[-1]:.2f}", style="bold"), Text("  ")]
        line = Text.assemble(*parts[:-1])
        if line.cell_len <= width:
            return line
    return _cut(line, width)


def _cut(text: Text, width: int) -> Text:
    text.truncate(max(1, width), overflow="ellipsis")
    return text
