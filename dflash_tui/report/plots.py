"""The report's plots: matplotlib figures (loaded on first use, Agg backend, drawn without
pyplot) written as inline SVG elements. The dashboard never imports matplotlib: nothing here
does until a report is drawn."""

from __future__ import annotations

import io
import re

from dflash_core.observe import events as ev
from dflash_core.units import GiB as GIB

from .data import RunData
from .series import Series

EVAL_COLOR = "tab:red"  # exact tau and the evaluations' steps
# the prompt sets' exact tau (eval.prompt_sets): neither the held-out red nor the steps' blue
SET_COLORS = ("tab:purple", "tab:orange", "tab:green", "tab:brown", "tab:pink", "tab:olive",
              "tab:cyan", "tab:gray")


class Clock:
    """Elapsed time since the run began, in a unit that suits its length."""

    def __init__(self, t0: float, t1: float) -> None:
        span = max(0.0, t1 - t0)
        self.t0 = t0
        if span >= 2 * 86400 * 3:  # many days: days
            self.div, self.unit = 86400.0, "days"
        elif span >= 2 * 3600:
            self.div, self.unit = 3600.0, "hours"
        elif span >= 120:
            self.div, self.unit = 60.0, "minutes"
        else:
            self.div, self.unit = 1.0, "seconds"

    def __call__(self, xs):
        return [(x - self.t0) / self.div for x in xs]

    @property
    def label(self) -> str:
        return f"time since the run started ({self.unit})"


def svg_element(fig, prefix: str = "f") -> str:
    """The figure as an <svg> element for inline HTML: no XML prolog, DTD or metadata, no
    namespace URLs, a width set by the page's CSS, and its ids prefixed (``figure_1``,
    ``axes_1``, clip paths: several SVGs share one page's id space)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight",
                metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    head_end = text.index(">") + 1
    head = text[:head_end]
    head = re.sub(r'\s(?:xmlns(?::\w+)?|width|height|version)="[^"]*"', "", head)
    text = head + text[head_end:]
    text = re.sub(r'(\sid="|url\(#|href="#)', lambda m: m.group(1) + prefix + "-", text)
    return text


class Plots:
    """matplotlib, loaded on first use with the Agg backend; figures drawn without pyplot."""

    def __init__(self, keep: bool = False) -> None:
        """``keep``: hold on to each figure drawn (``drawn``), for a test to look at its axes."""
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure

        self.matplotlib = matplotlib
        self.Figure = Figure
        self.figures = 0
        self.keep, self.drawn = keep, []
        # a fixed salt: the same events make the same page (matplotlib's default is random)
        self.rc = {"svg.fonttype": "none", "svg.hashsalt": "dflash-report", "font.size": 9,
                   "axes.grid": True, "grid.alpha": 0.3, "path.simplify": True,
                   "axes.spines.top": False, "axes.spines.right": False}

    def figure(self, w: float = 9.0, h: float = 3.0, **kw):
        return self.Figure(figsize=(w, h), layout="constrained", **kw)

    def render(self, draw) -> str:
        self.figures += 1
        with self.matplotlib.rc_context(self.rc):
            fig = draw()
            if self.keep:
                self.drawn.append(fig)
            return svg_element(fig, prefix=f"fig{self.figures}")


def integer_ticks():
    """A tick locator that never puts a tick between two whole numbers."""
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


# Two step labels on the top axis are at least this share of its width apart: closer ones overlap.
MIN_TICK_GAP = 0.08


def step_positions(data: RunData, clock: Clock):
    """A function from an optimizer step to the x (``clock`` units) at which the run reached it,
    read off the step series; None when the run has fewer than two distinct steps. Both the top
    step axis and the exact-tau points use it, so an evaluation stands under its own step."""
    ts, steps = data.step_at.points()
    if len(ts) < 2 or max(steps) <= steps[0]:
        return None
    import numpy as np

    xs_a = np.asarray(clock(ts), dtype=float)
    st_a = np.maximum.accumulate(np.asarray(steps, dtype=float))
    first = np.concatenate(([True], np.diff(st_a) > 0))  # a step held for several points: its first
    xs_a, st_a = xs_a[first], st_a[first]
    return lambda step: float(np.interp(step, st_a, xs_a))


def step_ticks(data: RunData, at_step, lo: float, hi: float) -> list[tuple[float, int, bool]]:
    """(x, step, is an evaluation) of each label of the top step axis within [lo, hi]: every
    evaluation's step first, then round steps in the gaps, no two closer than MIN_TICK_GAP of the
    width (the latest ones kept when they crowd)."""
    gap = MIN_TICK_GAP * (hi - lo)
    kept: list[tuple[float, int, bool]] = []

    def add(steps, is_eval: bool) -> None:
        for x, step in sorted(((at_step(s), s) for s in steps), reverse=True):
            if lo <= x <= hi and all(abs(x - k[0]) >= gap for k in kept):
                kept.append((x, int(step), is_eval))

    evals = {step for _, step, _, _ in data.evals.items()}
    add(evals, True)
    from matplotlib.ticker import MaxNLocator

    _, steps = data.step_at.points()
    first, last = steps[0], max(steps)
    add({int(v) for v in MaxNLocator(nbins=8, integer=True).tick_values(first, last)
         if first <= v <= last} - evals, False)
    return sorted(kept)


def _step_axis(ax, data: RunData, clock: Clock) -> None:
    """A second x axis on top naming the optimizer step (``step_ticks``), evaluations in red;
    drawn once the plot's own x range is known."""
    at_step = step_positions(data, clock)
    if at_step is None:
        return
    lo, hi = ax.get_xlim()
    ticks = step_ticks(data, at_step, lo, hi)
    if not ticks:
        return
    top = ax.secondary_xaxis("top")
    top.set_xticks([x for x, _, _ in ticks], [str(s) for _, s, _ in ticks])
    for label, (_, _, is_eval) in zip(top.get_xticklabels(), ticks):
        if is_eval:
            label.set_color(EVAL_COLOR)
    top.set_xlabel("step" + (" (red: an evaluation)" if any(t[2] for t in ticks) else ""))


# A loss that falls by more than this factor is drawn on a log scale: the first steps' values
# would otherwise flatten the range where training spends its time.
LOG_SCALE_RATIO = 5.0


def _log_scale(ax, ys: list[float]) -> bool:
    """A log y axis labelled 1, 2, 5, 10, ... in plain numbers, when ``ys`` span enough."""
    if not ys or min(ys) <= 0 or max(ys) / min(ys) < LOG_SCALE_RATIO:
        return False
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    return True


def line_plot(plots: Plots, data: RunData, clock: Clock, series: Series, ylabel: str,
              title: str, color: str, log: bool = False) -> str:
    """``series`` over time; ``log``: on a log scale when its values span LOG_SCALE_RATIO."""
    def draw():
        fig = plots.figure()
        ax = fig.add_subplot()
        xs, ys = series.points()
        ax.plot(clock(xs), ys, color=color, linewidth=1.0)
        ax.set_xlabel(clock.label)
        ax.set_ylabel(ylabel)
        scaled = log and _log_scale(ax, ys)
        ax.set_title(title + (" (log scale)" if scaled else ""), loc="left")
        _step_axis(ax, data, clock)
        return fig
    return plots.render(draw)


def tau_plot(plots: Plots, data: RunData, clock: Clock) -> str:
    def draw():
        fig = plots.figure()
        ax = fig.add_subplot()
        xs, ys = data.tau_tf.points()
        if xs:
            ax.plot(clock(xs), ys, color="tab:blue", linewidth=1.0,
                    label="teacher-forced tau (each step)")
        at_step = step_positions(data, clock)

        def xs_of(points):  # (ts, step, tau, ...) each: under its step, else when it ended
            return ([at_step(p[1]) for p in points] if at_step is not None
                    else clock([p[0] for p in points]))
        evals = data.evals.items()
        if evals:
            ax.plot(xs_of(evals), [e[2] for e in evals], "o-", color=EVAL_COLOR, markersize=4,
                    linewidth=1.0, label="exact tau (evaluation, at its step)")
        for k, name in enumerate(data.sets.names()):  # one line per prompt set
            pts = data.sets.points(name)
            ax.plot(xs_of(pts), [p[2] for p in pts], "s--", color=SET_COLORS[k % len(SET_COLORS)],
                    markersize=3, linewidth=1.0, label=f"exact tau on {name}")
        ax.set_xlabel(clock.label)
        ax.set_ylabel("tau (accepted tokens per round)")
        ax.set_title("tau", loc="left")
        # outside the axes: inside, it hid the exact-tau points, which sit low in the range
        fig.legend(loc="outside lower center", ncol=2, fontsize=8)
        _step_axis(ax, data, clock)
        return fig
    return plots.render(draw)


def queue_plot(plots: Plots, data: RunData, clock: Clock) -> str:
    def draw():
        names = sorted(data.queues, key=lambda n: (n != ev.HS_QUEUE, ev.prefetch_rank(n) or 0, n))
        hs = [n for n in names if ev.prefetch_rank(n) is None]
        pre = [n for n in names if ev.prefetch_rank(n) is not None]
        groups = [g for g in ((hs, "hidden-states and other queues"),
                              (pre, "prefetch queues (one per target)")) if g[0]]
        fig = plots.figure(h=2.6 * len(groups))
        axes = fig.subplots(len(groups), 1, sharex=True, squeeze=False)[:, 0]
        for ax, (group, title) in zip(axes, groups):
            for name in group:
                xs, ys = data.queues[name].points()
                ax.plot(clock(xs), ys, linewidth=1.0,
                        label=f"{name} (capacity {data.queue_capacity.get(name, '?')})")
            ax.set_ylabel("depth")
            ax.yaxis.set_major_locator(integer_ticks())  # a depth is a whole number of batches
            ax.set_title(title, loc="left")
            ax.legend(loc="upper left", fontsize=7, ncol=min(4, len(group)))
        axes[-1].set_xlabel(clock.label)
        return fig
    return plots.render(draw)


def _plan_totals(data: RunData) -> dict[int, float]:
    """The memory plan's total per GPU index, in GiB ("cuda:3" -> 3)."""
    out: dict[int, float] = {}
    for row in (data.plan.rows if data.plan else []):
        m = re.fullmatch(r"cuda:(\d+)", str(row.get("device", "")))
        if m and isinstance(row.get("total"), (int, float)):
            idx = int(m.group(1))
            out[idx] = out.get(idx, 0.0) + row["total"] / GIB  # one device may hold two roles
    return out


def memory_plot(plots: Plots, data: RunData, clock: Clock) -> str:
    def draw():
        plan = _plan_totals(data)
        idxs = sorted(data.gpus)
        ncols = min(4, len(idxs))
        nrows = -(-len(idxs) // ncols)
        fig = plots.figure(w=9.0, h=2.3 * nrows + 0.4)
        axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False).ravel()
        for ax, idx in zip(axes, idxs):
            gpu = data.gpus[idx]
            xs, ys = gpu["used"].points()
            ax.plot(clock(xs), ys, linewidth=1.0, color="tab:blue", label="used (NVML)")
            xs, ys = gpu["alloc"].points()
            ax.plot(clock(xs), ys, linewidth=1.0, color="tab:green", label="torch allocated")
            if idx in plan:
                ax.axhline(plan[idx], color="tab:orange", linestyle="--", linewidth=1.0,
                           label="plan total")
            if gpu.get("limit"):
                ax.axhline(gpu["limit"], color="tab:red", linestyle=":", linewidth=1.0,
                           label="limit")
            ax.axhline(gpu.get("total", 0), color="grey", linewidth=0.8, label="card")
            role = f" {gpu['role']}" if gpu.get("role") else ""
            ax.set_title(f"GPU {idx}{role}", loc="left", fontsize=9)
        for ax in axes[len(idxs):]:
            ax.set_visible(False)
        axes[0].legend(loc="lower right", fontsize=7)
        fig.supylabel("GiB")
        fig.supxlabel(clock.label)
        return fig
    return plots.render(draw)


def timeline_plot(plots: Plots, data: RunData, clock: Clock) -> str:
    def draw():
        errors = data.errors.items()
        stalls = data.stalls.items()
        lanes = sorted({e.source for e in errors} | {s.worker for s, _ in stalls})
        lane = {name: i for i, name in enumerate(lanes)}
        fig = plots.figure(h=1.8 + 0.35 * max(1, len(lanes)))
        ax = fig.add_subplot()
        end = data.last_ts if data.last_ts is not None else data.t0
        for stall, cleared in stalls:
            x0, x1 = clock([stall.ts - stall.seconds, cleared if cleared else end])
            y = lane[stall.worker]
            ax.plot([x0, x1], [y, y], color="tab:orange", linewidth=4, alpha=0.6,
                    solid_capstyle="butt")
            ax.plot(clock([stall.ts]), [y], "v", color="tab:orange", markersize=6)
        for fatal, color, label in ((True, "tab:red", "fatal error"),
                                    (False, "darkgoldenrod", "error (not fatal)")):
            pts = [e for e in errors if bool(e.fatal) == fatal]
            if pts:
                ax.plot(clock([e.ts for e in pts]), [lane[e.source] for e in pts], "X",
                        color=color, markersize=8, linestyle="none", label=label)
        if stalls:
            ax.plot([], [], color="tab:orange", linewidth=4, alpha=0.6,
                    label="stall (silent span; open to the end when never cleared)")
        for st in data.states.items():
            x = clock([st.ts])[0]
            ax.axvline(x, color="grey", linewidth=0.6, linestyle=":")
            ax.annotate(st.state, (x, 0.02), xycoords=("data", "axes fraction"), fontsize=7,
                        rotation=90, va="bottom", ha="right", color="grey")
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_ylim(-0.7, max(0, len(lanes) - 1) + 0.7)
        ax.set_xlim(left=min(0.0, ax.get_xlim()[0]))
        ax.set_xlabel(clock.label)
        fig.legend(loc="outside upper right", fontsize=7, ncol=3)
        ax.grid(axis="y", visible=False)
        return fig
    return plots.render(draw)


def acceptance_plot(plots: Plots, e: ev.EvalResult) -> str:
    def draw():
        fig = plots.figure(w=6.0, h=2.8)
        ax = fig.add_subplot()
        counts = list(e.acceptance)
        ax.bar(range(len(counts)), counts, color="tab:purple")
        ax.set_xticks(range(len(counts)))
        ax.set_xlabel("drafted tokens accepted in a round")
        ax.set_ylabel("rounds")
        ax.yaxis.set_major_locator(integer_ticks())
        ax.set_title(f"step {e.step}: exact tau {e.tau:.4f} over {e.prompts} prompts", loc="left")
        ax.grid(axis="x", visible=False)
        return fig
    return plots.render(draw)


def context_plot(plots: Plots, evals: list[tuple[str, ev.EvalResult]],
                 set_names: list[str] = ()) -> str:
    """Exact tau per bucket of context length (context_buckets.py), a line per evaluation
    (``evals``: (name, its latest EvalResult)), each point's rounds beside it; a set in the
    colour the tau plot gives it (``set_names``: the sets in that plot's order)."""
    from dflash_core.context_buckets import with_rounds

    def draw():
        fig = plots.figure(w=7.0, h=3.0)
        ax = fig.add_subplot()
        starts = {r["bucket"]: r["from"] for _, e in evals for r in with_rounds(e.context)}
        names = sorted(starts, key=starts.get)  # the buckets any has rounds in, in order
        for name, e in evals:
            pts = [(names.index(r["bucket"]), r["tau"], r["rounds"])
                   for r in with_rounds(e.context)]
            k = list(set_names).index(name) if name in set_names else 0
            color = EVAL_COLOR if not name else SET_COLORS[k % len(SET_COLORS)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, markersize=4,
                    linewidth=1.0, label=(f"set {name}" if name else "held-out prompts")
                    + f", step {e.step}")
            for x, y, n in pts:
                ax.annotate(f"{n}", (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7, color=color)
        ax.set_xticks(range(len(names)), names)
        ax.set_xlabel("tokens before the round (prompt + generated); rounds beside each point")
        ax.set_ylabel("exact tau")
        ax.set_title("tau by context length (latest evaluations)", loc="left")
        fig.legend(loc="outside lower center", ncol=2, fontsize=8)
        return fig
    return plots.render(draw)
