"""``dflash-tui report RUN_DIR``: one self-contained HTML page of a run, from its events.jsonl.

What operators look at after (or during) a run, on one page that opens anywhere without a network:
loss, tau (teacher-forced per step and exact at each evaluation), samples/s, queue depths, memory
per GPU against its plan, errors and stalls on a timeline, the latest acceptance histogram and the
resolved config. Plots are inline SVG drawn with matplotlib (imported here, lazily, on the Agg
backend: the dashboard never imports it); the CSS is inline; there are no scripts.

Only the file's last run is read (a file may hold several, each beginning with RunStarted); it is
found by reading backwards (``follow.last_run_offset``) and then streamed line by line into series
of at most ``cap`` points each (``Series``), so a multi-day events.jsonl is never held in memory.
An unreadable line (a torn last line of a running or killed run) is counted and skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import html
import io
import json
import math
import os
import re
import sys
from collections import deque
from pathlib import Path

from dflash_core.models import acceptance
from dflash_core.observe import events as ev

from .follow import last_run_offset

DEFAULT_CAP = 2000  # points kept per series
from dflash_core.units import GiB as GIB
MAX_SERIES = 64  # queues or GPUs with their own series; more names than this are counted only
# Events the report reads; any other line is skipped before it is parsed.
WANTED = frozenset(("RunStarted", "StateChanged", "StepMetrics", "EvalResult", "GpuSample",
                    "QueueDepth", "MemoryPlan", "Checkpoint", "Error", "Stall", "RunEnded"))
_KIND_TAG = '"event":'


class Series:
    """A bounded series of (x, y) points.

    Points come in order of x. Up to ``cap`` are kept one for one; past that, the series halves
    itself (neighbouring points merged) and from then on takes one point per ``stride`` input
    points, so it keeps between cap/2 and cap points spread over the whole run. ``mean``: a kept
    point is the mean of the points it stands for (loss, throughput, memory); otherwise it is the
    first of them, an exact value. The last, partly filled group is shown as well, so the latest
    value is never lost to the thinning. Non-finite y values (a NaN loss) are counted, not kept.
    """

    __slots__ = ("cap", "mean", "stride", "xs", "ys", "count", "nonfinite",
                 "_n", "_sx", "_sy")

    def __init__(self, cap: int = DEFAULT_CAP, mean: bool = True) -> None:
        self.cap = max(4, cap + (cap % 2))  # even, so a full series halves evenly
        self.mean = mean
        self.stride = 1
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.count = 0  # points added, all of them
        self.nonfinite = 0
        self._n = 0  # points in the group now being filled
        self._sx = self._sy = 0.0

    def add(self, x: float, y: float) -> None:
        if y is None or not math.isfinite(y):
            self.nonfinite += 1
            return
        self.count += 1
        if self.mean:
            self._sx += x
            self._sy += y
        elif self._n == 0:
            self._sx, self._sy = x, y
        self._n += 1
        if self._n < self.stride:
            return
        self.xs.append(self._sx / self._n if self.mean else self._sx)
        self.ys.append(self._sy / self._n if self.mean else self._sy)
        self._n, self._sx, self._sy = 0, 0.0, 0.0
        if len(self.xs) >= self.cap:
            self._halve()

    def _halve(self) -> None:
        if self.mean:
            self.xs = [(a + b) / 2 for a, b in zip(self.xs[::2], self.xs[1::2])]
            self.ys = [(a + b) / 2 for a, b in zip(self.ys[::2], self.ys[1::2])]
        else:
            self.xs, self.ys = self.xs[::2], self.ys[::2]
        self.stride *= 2

    def points(self) -> tuple[list[float], list[float]]:
        """The kept points and the last partial group: at most ``cap`` in all."""
        xs, ys = list(self.xs), list(self.ys)
        if self._n:
            xs.append(self._sx / self._n if self.mean else self._sx)
            ys.append(self._sy / self._n if self.mean else self._sy)
        return xs, ys

    def __len__(self) -> int:
        return len(self.xs) + (1 if self._n else 0)

    def last(self) -> float | None:
        _, ys = self.points()
        return ys[-1] if ys else None


class FirstLast:
    """The first ``first`` and the last ``last`` items of a stream, and how many there were: the
    root cause is usually among the first errors, the state now among the last."""

    def __init__(self, first: int, last: int) -> None:
        self.head: list = []
        self.tail: deque = deque(maxlen=last)
        self.first = first
        self.count = 0

    def add(self, item) -> None:
        self.count += 1
        if len(self.head) < self.first:
            self.head.append(item)
        else:
            self.tail.append(item)

    def items(self) -> list:
        return self.head + list(self.tail)

    @property
    def dropped(self) -> int:
        return self.count - len(self.head) - len(self.tail)

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)


class RunData:
    """What the report shows of one run, fed one event at a time (``feed``); bounded in memory
    whatever the number of events."""

    def __init__(self, cap: int = DEFAULT_CAP) -> None:
        self.cap = cap
        self.started: ev.RunStarted | None = None
        self.t0: float | None = None
        self.last_ts: float | None = None
        self.state = "unknown"
        self.ended: ev.RunEnded | None = None
        self.states = FirstLast(100, 100)  # StateChanged
        self.loss = Series(cap)
        self.tau_tf = Series(cap)
        self.samples_per_s = Series(cap)
        self.step_at = Series(cap, mean=False)  # x: time, y: step (the plots' step axis)
        self.last_step: ev.StepMetrics | None = None
        self.evals = FirstLast(cap // 2, cap // 2)  # (ts, step, tau, prompts)
        self.last_eval: ev.EvalResult | None = None
        self.queues: dict[str, Series] = {}
        self.queue_capacity: dict[str, int] = {}
        self.gpus: dict[int, dict] = {}  # index -> {"used", "alloc": Series, "name", ...}
        self.plan: ev.MemoryPlan | None = None
        self.checkpoints = FirstLast(5, 20)
        self.errors = FirstLast(50, 450)
        self.stalls = FirstLast(50, 450)  # [Stall, cleared_ts or None]
        self._open_stalls: dict[str, list] = {}  # worker -> its latest uncleared stall entry
        self.events = 0  # events read of this run
        self.unreadable = 0  # lines that did not parse (a torn last line, a damaged one)
        self.extra_names = 0  # samples of queues / GPUs past MAX_SERIES, not plotted

    # -- reading --------------------------------------------------------------------------------
    def feed(self, e: ev.Event) -> None:
        if isinstance(e, ev.RunStarted):
            self.__init__(self.cap)  # a later run in the same file starts the page over
            self.started, self.t0 = e, e.ts
        if self.t0 is None:
            self.t0 = e.ts
        self.events += 1
        self.last_ts = e.ts if self.last_ts is None else max(self.last_ts, e.ts)
        self.state = ev.state_after(self.state, e)
        handler = getattr(self, "_on_" + e.kind, None)
        if handler is not None:
            handler(e)

    def _on_StateChanged(self, e: ev.StateChanged) -> None:
        self.states.add(e)

    def _on_RunEnded(self, e: ev.RunEnded) -> None:
        self.ended = e

    def _on_StepMetrics(self, e: ev.StepMetrics) -> None:
        self.loss.add(e.ts, e.loss)
        self.tau_tf.add(e.ts, e.tau_tf)
        self.samples_per_s.add(e.ts, e.samples_per_s)
        self.step_at.add(e.ts, e.step)
        self.last_step = e

    def _on_EvalResult(self, e: ev.EvalResult) -> None:
        self.evals.add((e.ts, e.step, e.tau, e.prompts))
        self.last_eval = e

    def _on_QueueDepth(self, e: ev.QueueDepth) -> None:
        series = self.queues.get(e.name)
        if series is None:
            if len(self.queues) >= MAX_SERIES:
                self.extra_names += 1
                return
            series = self.queues[e.name] = Series(self.cap)
        series.add(e.ts, e.depth)
        self.queue_capacity[e.name] = e.capacity

    def _on_GpuSample(self, e: ev.GpuSample) -> None:
        gpu = self.gpus.get(e.index)
        if gpu is None:
            if len(self.gpus) >= MAX_SERIES:
                self.extra_names += 1
                return
            gpu = self.gpus[e.index] = {"used": Series(self.cap), "alloc": Series(self.cap)}
        gpu["used"].add(e.ts, e.mem_used / GIB)
        gpu["alloc"].add(e.ts, e.torch_allocated / GIB)
        gpu.update(name=e.name, total=e.mem_total / GIB, limit=e.limit / GIB, role=e.role,
                   retries=e.alloc_retries, ooms=e.ooms)

    def _on_MemoryPlan(self, e: ev.MemoryPlan) -> None:
        self.plan = e

    def _on_Checkpoint(self, e: ev.Checkpoint) -> None:
        self.checkpoints.add(e)

    def _on_Error(self, e: ev.Error) -> None:
        self.errors.add(e)

    def _on_Stall(self, e: ev.Stall) -> None:
        if e.cleared:
            entry = self._open_stalls.pop(e.worker, None)
            if entry is not None:
                entry[1] = e.ts
            return
        entry = [e, None]
        self._open_stalls[e.worker] = entry
        self.stalls.add(entry)

    # -- derived --------------------------------------------------------------------------------
    @property
    def run_name(self) -> str:
        return self.started.run_name if self.started else "(no RunStarted in the file)"

    def status(self) -> str:
        if self.state in ev.TERMINAL_STATES:
            return self.state
        return f"{self.state} (no end recorded: still running, or killed)"


def _kind_of(line: str) -> str | None:
    """The event type a line names ("event" is its last key), without parsing it; None when the
    line does not say (it is parsed then, and a damaged one counted)."""
    tag = line.rfind(_KIND_TAG)
    if tag < 0:
        return None
    start = line.find('"', tag + len(_KIND_TAG)) + 1
    end = line.find('"', start)
    return line[start:end] if start and end > 0 else None


_FIELDS: dict[type, frozenset] = {}


def _parse(line: str) -> ev.Event:
    """``events.from_json`` with each type's field names looked up once, not per line: a
    multi-day file has millions of lines."""
    d = json.loads(line)
    cls = ev.EVENT_TYPES[d.pop("event")]
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    for old, new in cls.old_names.items():
        if old in d and new not in d:
            d[new] = d.pop(old)
    return cls(**{k: v for k, v in d.items() if k in names})


def read_run(path: str | os.PathLike, cap: int = DEFAULT_CAP) -> RunData:
    """The last run of an events.jsonl (a run folder or the file itself), streamed: memory stays
    bounded by ``cap`` whatever the file's size. Lines appended while it reads are left out."""
    path = Path(path)
    if path.is_dir():
        path = path / "events.jsonl"
    data = RunData(cap)
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(last_run_offset(f, size))
        while f.tell() < size:
            raw = f.readline()
            if not raw:
                break
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            kind = _kind_of(line)
            if kind is not None and kind not in WANTED:
                continue  # host samples, worker phases, logs: not on the page
            try:
                event = _parse(line)
            except (ValueError, KeyError, TypeError, AttributeError):
                data.unreadable += 1
                continue
            data.feed(event)
    return data


# -- rendering ---------------------------------------------------------------------------------
def _utc(ts: float | None) -> str:
    if ts is None:
        return "-"
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    if d:
        return f"{d}d {h}h {m:02d}m"
    if h:
        return f"{h}h {m:02d}m {s:02d}s"
    return f"{m}m {s:02d}s"


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


class _Clock:
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


def _svg(fig, prefix: str = "f") -> str:
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


class _Plots:
    """matplotlib, loaded on first use with the Agg backend; figures drawn without pyplot."""

    def __init__(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure

        self.matplotlib = matplotlib
        self.Figure = Figure
        self.figures = 0
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
            return _svg(fig, prefix=f"fig{self.figures}")


def _step_axis(ax, data: RunData, clock: _Clock) -> None:
    """A second x axis on top: the optimizer step at that time (from the step series)."""
    ts, steps = data.step_at.points()
    xs = clock(ts)
    if len(xs) < 2 or xs[-1] <= xs[0] or steps[-1] <= steps[0]:
        return
    import numpy as np

    xs_a, st_a = np.asarray(xs), np.maximum.accumulate(np.asarray(steps, dtype=float))
    try:
        top = ax.secondary_xaxis("top", functions=(lambda x: np.interp(x, xs_a, st_a),
                                                   lambda s: np.interp(s, st_a, xs_a)))
        top.set_xlabel("step")
    except Exception:  # noqa: BLE001 - the step axis is a convenience; the plot stands without it
        pass


def _line_plot(plots: _Plots, data: RunData, clock: _Clock, series: Series, ylabel: str,
               title: str, color: str) -> str:
    def draw():
        fig = plots.figure()
        ax = fig.add_subplot()
        xs, ys = series.points()
        ax.plot(clock(xs), ys, color=color, linewidth=1.0)
        ax.set_xlabel(clock.label)
        ax.set_ylabel(ylabel)
        ax.set_title(title, loc="left")
        _step_axis(ax, data, clock)
        return fig
    return plots.render(draw)


def _tau_plot(plots: _Plots, data: RunData, clock: _Clock) -> str:
    def draw():
        fig = plots.figure()
        ax = fig.add_subplot()
        xs, ys = data.tau_tf.points()
        if xs:
            ax.plot(clock(xs), ys, color="tab:blue", linewidth=1.0,
                    label="teacher-forced tau (each step)")
        evals = data.evals.items()
        if evals:
            ax.plot(clock([e[0] for e in evals]), [e[2] for e in evals], "o-", color="tab:red",
                    markersize=4, linewidth=1.0, label="exact tau (evaluation)")
        ax.set_xlabel(clock.label)
        ax.set_ylabel("tau (accepted tokens per round)")
        ax.set_title("tau", loc="left")
        ax.legend(loc="lower right")
        _step_axis(ax, data, clock)
        return fig
    return plots.render(draw)


def _queue_plot(plots: _Plots, data: RunData, clock: _Clock) -> str:
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


def _memory_plot(plots: _Plots, data: RunData, clock: _Clock) -> str:
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


def _timeline_plot(plots: _Plots, data: RunData, clock: _Clock) -> str:
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


def _acceptance_plot(plots: _Plots, e: ev.EvalResult) -> str:
    def draw():
        fig = plots.figure(w=6.0, h=2.8)
        ax = fig.add_subplot()
        counts = list(e.acceptance)
        ax.bar(range(len(counts)), counts, color="tab:purple")
        ax.set_xticks(range(len(counts)))
        ax.set_xlabel("drafted tokens accepted in a round")
        ax.set_ylabel("rounds")
        ax.set_title(f"step {e.step}: exact tau {e.tau:.4f} over {e.prompts} prompts", loc="left")
        ax.grid(axis="x", visible=False)
        return fig
    return plots.render(draw)


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(x, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def _config_text(config: dict) -> str:
    try:
        import yaml

        return yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=100)
    except Exception:  # noqa: BLE001 - a value yaml cannot write: JSON shows it all the same
        return json.dumps(config, indent=2, default=str)


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1100px;
padding:1rem 1.5rem;color:#1d2330;background:#fff}
h1{font-size:1.5rem;margin:.2rem 0}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}
nav a{margin-right:.8rem}.muted{color:#667}
svg{width:100%;height:auto;display:block}
.small svg{max-width:620px}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}
td,th{border:1px solid #ddd;padding:.2rem .5rem;text-align:left;vertical-align:top}
th{background:#f3f4f7}td.msg{max-width:600px;white-space:pre-wrap;word-break:break-word}
pre{background:#f6f7f9;border:1px solid #e1e3e8;padding:.7rem;overflow:auto;font-size:.8rem}
.status{display:inline-block;padding:.1rem .6rem;border-radius:.8rem;font-weight:600}
.finished{background:#d9f2de}.failed{background:#f8d7d7}.aborted{background:#fbe9c8}
.running{background:#dde8fb}
details{margin:.3rem 0}
"""


def render_html(data: RunData, source: str = "") -> str:
    """The report page for ``data`` (a ``read_run`` result): one self-contained HTML string."""
    plots = _Plots()
    t0 = data.t0 or 0.0
    clock = _Clock(t0, data.last_ts or t0)
    s = data.started
    status = data.status()
    css_status = data.state if data.state in ev.TERMINAL_STATES else "running"
    title = f"dflash run report: {data.run_name}"
    parts: list[str] = []
    add = parts.append

    add(f"<h1>{_esc(title)}</h1>")
    add(f'<p><span class="status {css_status}">{_esc(status)}</span> '
        f'<span class="muted">made {_esc(_utc(_dt.datetime.now(_dt.timezone.utc).timestamp()))}'
        f"{' from ' + _esc(source) if source else ''}</span></p>")
    add('<nav><a href="#summary">summary</a><a href="#loss">loss</a><a href="#tau">tau</a>'
        '<a href="#throughput">samples/s</a><a href="#queues">queues</a>'
        '<a href="#memory">GPU memory</a><a href="#errors">errors and stalls</a>'
        '<a href="#acceptance">acceptance</a><a href="#config">config</a></nav>')

    # -- summary
    last = data.last_step
    total = (last.total_steps if last and last.total_steps else (s.total_steps if s else 0))
    rows = [
        ["run", data.run_name],
        ["run folder", s.run_dir if s else "-"],
        ["status", status],
        ["started", _utc(s.ts if s else data.t0)],
        ["last event", _utc(data.last_ts)],
        ["span", _duration((data.last_ts or t0) - t0)],
        ["step", f"{last.step}" + (f" of {total}" if total else "") if last else "-"],
        ["epoch", last.epoch if last else "-"],
        ["latest loss", _fmt(last.loss if last else None)],
        ["latest teacher-forced tau", _fmt(last.tau_tf if last else None)],
        ["latest exact tau", f"{data.last_eval.tau:.4f} at step {data.last_eval.step}"
         if data.last_eval else "-"],
        ["targets", ", ".join(map(str, s.targets)) if s else "-"],
        ["drafters", ", ".join(map(str, s.drafters)) if s else "-"],
    ]
    if s and s.resumed_from_step:
        rows.append(["resumed from step", s.resumed_from_step])
    if s and s.allocator:
        rows.append(["CUDA allocator", s.allocator])
    if data.ended:
        rows.append(["end", f"{data.ended.status} at step {data.ended.step} after "
                     f"{_duration(data.ended.seconds)}" + (f": {data.ended.reason}"
                                                          if data.ended.reason else "")])
    cks = data.checkpoints.items()
    if cks:
        rows.append(["checkpoints", f"{data.checkpoints.count}; last: step {cks[-1].step} "
                     f"({cks[-1].reason}) {cks[-1].path}"])
    rows.append(["errors / stalls", f"{data.errors.count} / {data.stalls.count}"])
    notes = []
    if data.loss.nonfinite:
        notes.append(f"{data.loss.nonfinite} steps had a non-finite loss (not plotted)")
    if data.unreadable:
        notes.append(f"{data.unreadable} unreadable lines skipped (a torn last line is normal "
                     f"for a running or killed run)")
    if data.extra_names:
        notes.append(f"{data.extra_names} samples of queues or GPUs past the first "
                     f"{MAX_SERIES} not plotted")
    if data.loss.stride > 1:
        notes.append(f"long series are thinned to at most {data.cap} points each (means of "
                     f"neighbouring samples; evaluations are exact)")
    rows.append(["events read", f"{data.events} of this run"
                 + ("; " + "; ".join(notes) if notes else "")])
    add('<h2 id="summary">Summary</h2>')
    add("<table><tbody>" + "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>"
                                   for k, v in rows) + "</tbody></table>")
    states = data.states.items()
    if states:
        add("<details><summary>state changes</summary>" + _table(
            ["time", "elapsed", "state", "from", "reason"],
            [[_utc(x.ts), _duration(x.ts - t0), x.state, x.previous, x.reason] for x in states])
            + "</details>")

    def none(what: str) -> str:
        return f'<p class="muted">No {what} in this run yet.</p>'

    # -- loss, tau, samples/s
    add('<h2 id="loss">Loss</h2>')
    add(_line_plot(plots, data, clock, data.loss, "loss", "training loss (per step)",
                   "tab:blue") if len(data.loss) else none("steps"))
    add('<h2 id="tau">Tau</h2>')
    if len(data.tau_tf) or len(data.evals):
        add(_tau_plot(plots, data, clock))
    else:
        add(none("steps or evaluations"))
    evals = data.evals.items()
    if evals:
        more = (f" ({data.evals.dropped} in the middle of the run not listed)"
                if data.evals.dropped else "")
        add(f"<details open><summary>exact tau at each evaluation{_esc(more)}</summary>"
            + _table(["step", "exact tau", "prompts", "time", "elapsed"],
                     [[st, f"{tau:.4f}", n, _utc(ts), _duration(ts - t0)]
                      for ts, st, tau, n in reversed(evals)]) + "</details>")
    add('<h2 id="throughput">Samples per second</h2>')
    add(_line_plot(plots, data, clock, data.samples_per_s, "samples/s", "training throughput",
                   "tab:green") if len(data.samples_per_s) else none("steps"))

    # -- queues, memory
    add('<h2 id="queues">Queue depths</h2>')
    add(_queue_plot(plots, data, clock) if data.queues else none("queue samples"))
    add('<h2 id="memory">GPU memory</h2>')
    add(_memory_plot(plots, data, clock) if data.gpus else 
        '<p class="muted">No GPU samples in this run (a run on the CPU has none).</p>')
    if data.plan:
        add("<p>Memory plan (preflight)" + ("" if data.plan.fits else
                                             " — <strong>does not fit</strong>") + ":</p>")
        add(_table(["device", "role", "planned GiB", "free GiB", "fits"],
                   [[r.get("device", "?"), r.get("role", ""),
                     _fmt((r.get("total") or 0) / GIB, ".1f"),
                     _fmt((r.get("free") or 0) / GIB, ".1f"), r.get("fits", "")]
                    for r in data.plan.rows]))
    if data.gpus:
        add(_table(["GPU", "name", "role", "last used GiB", "last torch allocated GiB",
                    "card GiB", "limit GiB", "allocator retries", "OOMs"],
                   [[i, g.get("name", ""), g.get("role", ""), _fmt(g["used"].last(), ".1f"),
                     _fmt(g["alloc"].last(), ".1f"), _fmt(g.get("total"), ".1f"),
                     _fmt(g.get("limit"), ".1f") if g.get("limit") else "-", g.get("retries", 0),
                     g.get("ooms", 0)] for i, g in sorted(data.gpus.items())]))

    # -- errors and stalls
    add('<h2 id="errors">Errors and stalls</h2>')
    errors, stalls = data.errors.items(), data.stalls.items()
    if errors or stalls:
        add(_timeline_plot(plots, data, clock))
    else:
        add(none("errors or stalls"))
    if errors:
        more = f" ({data.errors.dropped} in the middle not listed)" if data.errors.dropped else ""
        rows_html = "".join(
            "<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in (
                _utc(e.ts), _duration(e.ts - t0), e.source, e.error_kind,
                "fatal" if e.fatal else "no", e.device or "-", e.phase or "-"))
            + f'<td class="msg">{_esc(e.message)}'
            + (f"<br><em>hint: {_esc(e.hint)}</em>" if e.hint else "")
            + (f"<details><summary>traceback</summary><pre>{_esc(e.traceback)}</pre></details>"
               if e.traceback else "") + "</td></tr>" for e in errors)
        add(f"<p>Errors: {data.errors.count}{_esc(more)}</p><table><thead><tr>"
            + "".join(f"<th>{h}</th>" for h in ("time", "elapsed", "source", "kind", "fatal",
                                                  "device", "phase", "message"))
            + f"</tr></thead><tbody>{rows_html}</tbody></table>")
    if stalls:
        more = f" ({data.stalls.dropped} in the middle not listed)" if data.stalls.dropped else ""
        open_now = sum(1 for _, c in stalls if c is None)
        add(f"<p>Stalls: {data.stalls.count}, {open_now} never cleared{_esc(more)}</p>")
        add(_table(["time", "elapsed", "worker", "phase", "silent s", "where", "cleared"],
                   [[_utc(st.ts), _duration(st.ts - t0), st.worker, st.phase,
                     f"{st.seconds:.0f}", st.where,
                     f"after {_duration(c - st.ts)}" if c else "NOT CLEARED"]
                    for st, c in stalls]))

    # -- acceptance
    add('<h2 id="acceptance">Acceptance (latest evaluation)</h2>')
    if data.last_eval:
        add(_table(["measure", f"step {data.last_eval.step}", "what it is"],
                   acceptance.report_rows(data.last_eval)))
    if data.last_eval and data.last_eval.acceptance:
        add(f'<div class="small">{_acceptance_plot(plots, data.last_eval)}</div>')
        add(_table(["accepted tokens"] + [str(k) for k in range(len(data.last_eval.acceptance))],
                   [["rounds"] + list(data.last_eval.acceptance)]))
    else:
        add(none("evaluations"))

    # -- config
    add('<h2 id="config">Resolved config</h2>')
    if s:
        add(f"<pre>{_esc(_config_text(s.config))}</pre>" if s.config else
            '<p class="muted">The run recorded an empty config.</p>')
    else:
        add(none("RunStarted event"))

    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_esc(title)}</title>"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None,
                 cap: int = DEFAULT_CAP) -> Path:
    """Read the run's events.jsonl and write its report (default RUN_DIR/report.html)."""
    run_dir = Path(run_dir)
    events_path = run_dir if run_dir.is_file() else run_dir / "events.jsonl"
    out = Path(out) if out is not None else events_path.parent / "report.html"
    page = render_html(read_run(events_path, cap), source=str(events_path))
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)  # a reader never sees half a page
    return out


def main(argv: list[str]) -> int:
    """``dflash-tui report RUN_DIR [--out FILE]``."""
    p = argparse.ArgumentParser(
        prog="dflash-tui report",
        description="Write one self-contained HTML report of a run (finished, failed or still "
                    "running) from its events.jsonl: plots, errors, stalls and its config.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                   help="the run folder (run.output_dir/run.name, e.g. runs/demo)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE",
                   help="where to write the page (default RUN_DIR/report.html)")
    args = p.parse_args(argv)
    run_dir = args.run_dir
    events_path = run_dir if run_dir.is_file() else run_dir / "events.jsonl"
    if not events_path.is_file():
        print(f"nothing to report: {events_path} does not exist\nhint: pass the folder of a run "
              f"(run.output_dir/run.name, e.g. runs/demo)", file=sys.stderr)
        return 2
    try:
        out = write_report(run_dir, args.out)
    except OSError as exc:
        print(f"could not write the report: {exc}", file=sys.stderr)
        return 1
    print(f"report written to {out} ({out.stat().st_size / 1024:.0f} KiB)")
    return 0
