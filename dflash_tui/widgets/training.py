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
from .panel import Panel, field, keep_first, note, pack, pack_first, pack_rows


# Narrower than this (an 80-column terminal) the drafters' time split gives way to the loss plot.
DRAFTER_LINE_MIN_WIDTH = 50
PLOT_ROWS = 3  # the loss plot keeps this many rows before the measures take a second line


def rows_of(lines: list[Text]) -> int:
    return sum(len(t.plain.split("\n")) for t in lines)


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
        # least one row of the plot. A small terminal (80x24: 5 rows) keeps what matters most;
        # a taller one (120x40) gives the evaluation's measures a second line where that
        # leaves two lines of numbers and PLOT_ROWS of the plot.
        height = self.scrollable_content_region.height or 100
        # (the second line, two lines of numbers, the caption, then the plot's rows)
        if evals and height - (rows_of(evals) + 1) - 2 - 1 >= PLOT_ROWS:
            evals = eval_lines(s, width, measure_lines=2)
        room = max(1, height - rows_of(evals) - 2)
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
        ], width, room, whole=True)
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


def eval_lines(s: DashboardState, width: int, measure_lines: int = 1) -> list[Text]:
    """Exact tau over the run (a small plot) beside the teacher-forced taus of the latest
    evaluation and the mismatch gap (red past eval.tau_gap_warn: training and decoding
    disagree); under them exact tau on each prompt set of eval.prompt_sets, the data/target
    agreement, how often each block position was accepted, and the findings raised
    (acceptance.py: what each measure and gap means). One line each, its numbers whole: a
    narrow panel leaves out the plot, then the measures that matter least (the findings, exact
    tau and its gap never), and shows as many block positions as fit. ``measure_lines``: the
    taus' line may take that many where one leaves a measure out."""
    sets = [set_line(s, width)] if s.set_evals else []
    sets += context_lines(s, width)
    if not s.eval_history:  # prompt sets only (data.eval_prompts 0)
        return sets
    e = s.eval
    findings = findings_line(s, width)
    lines = [measures_line(s, width, measure_lines)] + sets + ([findings] if findings.cell_len
                                                               else [])
    cal = Calibration.from_dict(getattr(e, "calibration", None)) if e is not None else None
    fields = acceptance.calibration_fields(cal) if cal is not None else []
    if fields:
        # the confidence head (DSpark): ECE, tau at each budget, then per slot expected /
        # observed, as many slots as fit
        (label, slots), rest = fields[0], fields[1:]
        lines.append(with_series([(0 if i == 0 else 1, field(name, value, "")) for i, (name, value)
                                  in enumerate(rest)], [], label, slots.split(" "), width))
    return lines


def measures_line(s: DashboardState, width: int, lines: int = 1) -> Text:
    """'tau exact ▃█ 2.87  tf target 2.95  gap +0.08  tf held-out 3.58  tf train 3.74'."""
    e = s.eval
    taus = [tau for _, tau, _ in s.eval_history]
    first = acceptance.MEASURES[0]
    heads = [Text.assemble((f"{first.label} ", "dim"), (fmt.spark(taus, 16), "cyan"),
                           (f" {taus[-1]:.2f}", "bold")),
             Text.assemble((f"{first.label} ", "dim"), (f"{taus[-1]:.2f}", "bold"))]
    gap = s.tau_gap
    body: list[tuple[int, Text]] = []
    for m in acceptance.MEASURES[1:]:
        value = getattr(e, m.key, acceptance.MISSING) if e else acceptance.MISSING
        if value >= 0:
            body.append((1 if m is acceptance.MEASURES[1] else 2, field(m.label, f"{value:.2f}",
                                                                        "")))
        if m is acceptance.MEASURES[1] and gap is not None:
            # next to (b): the gap the mismatch alarm watches
            warn = gap > s.tau_gap_warn
            body.append((0, Text(f"gap {gap:+.2f}", style="bold white on red" if warn
                                 else "dim")))
    return pack_rows(heads, body, width, lines)


def findings_line(s: DashboardState, width: int) -> Text:
    """The data/target agreement, acceptance by block position (as many positions as fit,
    whole, saying how many more there are) and the findings raised, which never give way."""
    e = s.eval
    before: list[tuple[int, Text]] = []
    if e is not None and e.agreement >= 0:
        before.append((2, field(acceptance.AGREEMENT.label, f"{e.agreement:.0%}", "")))
    findings = [(0, Text(kind, style="bold white on red"))
                for kind in (e.findings if e is not None else [])]
    rates = [f"{r:.0%}" for r in s.accepted_by_position()]
    return with_series(before, findings, acceptance.ACCEPTED.label, rates, width)


def with_series(before: list[tuple[int, Text]], after: list[tuple[int, Text]], label: str,
                values: list[str], width: int) -> Text:
    """One line: ``before``, then '``label`` v1 v2 v3 (12 more)' with as many of ``values``
    as fit whole (priority 1), then ``after``; fields are left out as pack_first leaves them."""
    for n in range(len(values), 0, -1):
        more = len(values) - n
        series = Text.assemble((f"{label} ", "dim"), " ".join(values[:n]),
                               (f" ({more} more)" if more else "", "dim"))
        kept = keep_first(before + [(1, series)] + after, width, whole=True)
        if any(f is series for f in kept):
            return pack(kept, width)
    return pack_first(before + after, width, whole=True)


def items_line(label: Text, forms: list[list[Text]], width: int, sep: str = "  ") -> Text:
    """``label`` and the items of the first of ``forms`` (fullest first) that fits the width;
    where none does, as many items of the last as fit, whole, and how many more there are."""
    def joined(items: list[Text], more: int = 0) -> Text:
        tail = [Text(f"({more} more)", style="dim")] if more else []
        return Text.assemble(label, Text(sep).join(items + tail))
    for items in forms:
        text = joined(items)
        if text.cell_len <= width:
            return text
    items = forms[-1]
    for n in range(len(items) - 1, -1, -1):
        text = joined(items[:n], len(items) - n)
        if text.cell_len <= width:
            return text
    return _cut(text, width)


def context_lines(s: DashboardState, width: int) -> list[Text]:
    """'tau by context  0-1k 2.91 (412)  1-4k 2.30 (80)': exact tau per bucket of the rounds'
    context length (context_buckets.py), the rounds in brackets (left out first where the line
    does not fit), for the latest held-out evaluation and each set's latest ('... on long-docs
    ...'); only those with rounds in more than one bucket (with one, the bucket's tau is the
    evaluation's own)."""
    latest = ([("", s.eval)] if s.eval is not None else []) + list(s.set_evals.latest.items())
    lines = []
    for name, e in latest:
        records = getattr(e, "context", None)
        if not context_buckets.shown(records):
            continue
        label = Text(context_buckets.BY_CONTEXT.label + (f" on {name}" if name else "") + "  ",
                     style="dim")
        buckets = context_buckets.with_rounds(records)
        forms = [[Text.assemble((f"{r['bucket']} ", "dim"), (f"{r['tau']:.2f}", "bold"),
                                (f" ({r['rounds']})" if rounds else "", "dim"))
                  for r in buckets] for rounds in (True, False)]
        lines.append(items_line(label, forms, width))
    return lines


def set_line(s: DashboardState, width: int) -> Text:
    """'tau exact on gsm8k ▃█ 2.10  mt-bench ▂▅ 1.95': each set's exact tau over the run and its
    latest, in the held-out line's words; without the plots when they do not fit, then as
    many sets as fit."""
    label = Text(f"{acceptance.MEASURES[0].label} on ", style="dim")
    forms = []
    for plot in (8, 0):
        items = []
        for name in s.set_evals.names():
            taus = list(s.set_evals.taus[name])
            items.append(Text.assemble((f"{name} ", "dim"),
                                       (fmt.spark(taus, plot) + " " if plot else "", "cyan"),
                                       (f"{taus[-1]:.2f}", "bold")))
        forms.append(items)
    return items_line(label, forms, width)


def _cut(text: Text, width: int) -> Text:
    text.truncate(max(1, width), overflow="ellipsis")
    return text
