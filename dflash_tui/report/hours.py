"""The report's cost: the run's device time (DeviceHours events, observe/device_hours.py) to
its best checkpoint and to its end, and exact tau against GPU-hours, each evaluation at the
figure taken as it began (what the weights it measured had cost).

``HoursData`` is folded by ``RunData`` (data.py); ``hours_html`` draws the page's section with
the report's plots (plots.py)."""

from __future__ import annotations

from dflash_core.observe import events as ev
from dflash_core.observe.device_hours import Figure, figure_text

from .cells import esc
from .series import FirstLast

EVAL_COLOR = "tab:red"
HELDOUT = "held-out"  # the name of the data's held-out prompts among the prompt sets


class HoursData:
    """The run's last figure, each evaluation's (prompt set, step, exact tau, figure), and the
    figure of the best checkpoint. Bounded: the first and last evaluations are kept."""

    def __init__(self, cap: int = 2000) -> None:
        self.last: ev.DeviceHours | None = None
        self.at_eval: ev.DeviceHours | None = None  # the figure of the evaluation under way
        self.points = FirstLast(cap // 2, cap // 2)  # (set, step, tau, DeviceHours)
        self.best: tuple[ev.Checkpoint, ev.DeviceHours | None] | None = None

    def hours(self, e: ev.DeviceHours) -> None:
        self.last = e
        if e.reason == "eval":
            self.at_eval = e

    def evaluated(self, e: ev.EvalResult) -> None:
        fig = self.at_eval
        if fig is not None and fig.step == e.step:
            self.points.add((e.prompt_set or HELDOUT, e.step, e.tau, fig))

    def checkpoint(self, e: ev.Checkpoint) -> None:
        if e.reason == "best":  # marked right after the evaluation of its step
            fig = self.at_eval if self.at_eval is not None and self.at_eval.step == e.step \
                else None
            self.best = (e, fig)


def _gpu_run(data: HoursData) -> bool:
    """GPU-hours are the axis unless the run held only the host (a CPU run)."""
    last = data.last
    return last is None or last.gpu_hours > 0 or last.host_hours == 0


def tau_hours_plot(plots, data: HoursData) -> str:
    gpu = _gpu_run(data)

    def draw():
        fig = plots.figure()
        ax = fig.add_subplot()
        by_set: dict[str, list] = {}
        for name, step, tau, h in data.points.items():
            by_set.setdefault(name, []).append((h.gpu_hours if gpu else h.host_hours, tau))
        for name, pts in by_set.items():
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", markersize=4, linewidth=1.0,
                    label=f"exact tau, {name}",
                    **({"color": EVAL_COLOR} if name == HELDOUT else {}))
        if data.best is not None and data.best[1] is not None:
            ck, h = data.best
            ax.plot([h.gpu_hours if gpu else h.host_hours], [ck.tau], "*", markersize=12,
                    color="gold", markeredgecolor="black",
                    label=f"best checkpoint (step {ck.step})")
        ax.set_xlabel("GPU-hours" if gpu else "host-hours (a CPU run: no GPU-hours)")
        ax.set_ylabel("exact tau")
        ax.set_title("exact tau against the device time spent to reach it", loc="left")
        ax.set_xlim(left=0)
        fig.legend(loc="outside lower center", ncol=3, fontsize=8)
        return fig
    return plots.render(draw)


def hours_html(plots, data: HoursData, over: bool) -> str:
    """The page's cost section: to the best checkpoint, to the end (or so far), the plot."""
    last = data.last
    if last is None:
        return ('<p class="muted">No device time recorded (a run before runs counted it, or '
                "one that ended before its devices were known).</p>")
    lines = []
    if data.best is not None:
        ck, h = data.best
        got = (figure_text(Figure.of_event(h)) if h is not None else
               "not recorded (no figure was taken at its evaluation)")
        lines.append(f"To the best checkpoint (step {ck.step}, exact tau {ck.tau:.4f}, "
                     f"{ck.path}): {got}.")
    when = (f"To the end (step {last.step})" if over and last.reason == "end"
            else f"So far (step {last.step})")
    lines.append(f"{when}: {figure_text(Figure.of_event(last), last.lost_gpu, last.lost_host)}.")
    out = "".join(f"<p>{esc(x)}</p>" for x in lines)
    out += ('<p class="muted">Every device the run holds counts from the run\'s start to its '
            "end (loading, evaluations and checkpoints included), a shared GPU split equally "
            "between its target and drafter, every node's GPUs counted; the figure goes on "
            "across resumes. Each evaluation stands at the figure taken as it began.</p>")
    if len(data.points):
        out += tau_hours_plot(plots, data)
    return out
