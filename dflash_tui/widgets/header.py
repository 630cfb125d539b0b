"""Top lines: run name, lifecycle state (why it ended), step, epoch, elapsed, ETA, error count on
one line; then what is going on now (attached, stalls, a checkpoint being written), the limit that
ends the run, the best checkpoint, the device time held so far (state/hours.py), where the metrics
go (wandb URL or offline folder) and the run folder, as many as fit."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from .. import fmt
from ..state.dashboard import DashboardState
from ..state.hours import header_text
from .panel import field, pack, pack_first

# Plain ANSI colours: they read the same in 16, 256 and true colour terminals.
STATE_STYLES = {
    "idle": "dim",
    "preflight": "bold cyan",
    "loading": "bold yellow",
    "warmup": "bold magenta",
    "training": "bold green",
    "finished": "bold blue",
    "aborted": "bold black on yellow",
    "failed": "bold white on red",
}


class HeaderBar(Static):
    PANEL_ID = "header"
    SAMPLED = False  # the run's state shows at once

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("id", self.PANEL_ID)
        super().__init__(**kwargs)
        self._state: DashboardState | None = None

    def show(self, state: DashboardState) -> None:
        self._state = state
        # A short terminal (under 40 rows) keeps the header to two lines; a tall one may wrap
        # the second line once.
        lines = 3 if self.app.size.height >= 40 else 2
        self.update(self.draw(state, self.size.width or 80, lines))

    def on_resize(self) -> None:
        if self._state is not None:
            self.show(self._state)

    @property
    def text(self) -> str:
        return self.content.plain if isinstance(self.content, Text) else str(self.content)

    @staticmethod
    def draw(s: DashboardState, width: int, lines: int = 2) -> Text:
        """The first line always fits on one line; the second takes ``lines - 1`` lines at
        most, leaving out what matters least when it does not fit."""
        text = first_line(s, width)
        text.append("\n")
        text.append_text(pack_first(second_line(s, width), width, max(1, lines - 1)))
        return text


# Shown after a failed run's reason: the whole message, hint and traceback are there.
ERRORS_POINTER = " (e: errors)"
MIN_REASON = 12  # narrower than this, a reason is not worth its cells
REASON_WANT = 40  # the epoch, ETA and elapsed time give way to this much of a reason


def first_line(s: DashboardState, width: int) -> Text:
    """Run, state, why it ended, step, epoch, elapsed, ETA, errors: on one line whatever the
    width. What gives way first: the epoch, the ETA, the elapsed time; the reason takes the
    cells left over (cut short, with where to read it whole)."""
    step = s.step
    cur = s.current_step
    total = f"/{s.total_steps}" if s.total_steps else ""
    n = s.error_count
    short = width < 100  # 80 columns: short labels
    parts = {
        "name": (0, Text(s.run_name or "dflash", style="bold")),
        "state": (0, Text(f" {s.state.upper()} ", style=STATE_STYLES.get(s.state, "bold"))),
        "step": (0, field("step", f"{'-' if cur is None else cur}{total}")),
        "epoch": (3, field("ep" if short else "epoch", str(step.epoch)) if step else Text()),
        "elapsed": (1, field("up" if short else "elapsed", fmt.duration(s.elapsed))),
        "eta": (2, field("ETA", fmt.duration(s.eta)) if s.live else Text()),
        "errors": (0, field("err" if short else "errors", str(n),
                            "bold white on red" if n else "bold green")),
    }
    order = ["name", "state", "reason", "step", "epoch", "elapsed", "eta", "errors"]

    def used(names) -> int:
        cells = [parts[k][1].cell_len for k in names if k in parts and parts[k][1].cell_len]
        return sum(cells) + 2 * (len(cells) - 1)
    # Why a run ended matters more than its epoch or elapsed time: room for a useful part of it.
    full = reason_text(s, width)
    want = 2 + min(full.cell_len, REASON_WANT) if full.cell_len else 0
    for k in sorted(parts, key=lambda k: -parts[k][0]):
        if used(parts) + want <= width or parts[k][0] == 0:
            break
        del parts[k]
    reason = reason_text(s, width - used(parts) - 2)
    if reason.cell_len:
        parts["reason"] = (0, reason)
    text = pack([parts[k][1] for k in order if k in parts], width)
    text.truncate(width, overflow="ellipsis")  # a very narrow pane: still one line
    return text


def reason_text(s: DashboardState, room: int) -> Text:
    """Why a run that ended ended, in ``room`` cells; a failure's points to the errors pane."""
    if not s.reason or s.live:
        return Text()
    pointer = ERRORS_POINTER if s.state == "failed" and s.error_count else ""
    if room < MIN_REASON + len(pointer):
        return Text(pointer.strip(" ()"), style="bold") if pointer and room >= 9 else Text()
    reason = fmt.short_message(s.reason)
    if len(reason) + len(pointer) > room:
        reason = reason[:max(0, room - len(pointer) - 1)].rstrip() + "…"
    return Text.assemble((reason, "dim"), (pointer, "bold"))


def second_line(s: DashboardState, width: int) -> list[tuple[int, Text]]:
    """(priority, field): what is going on now first, then the run's limit and best
    checkpoint, then where its records are."""
    out: list[tuple[int, Text]] = []
    if s.attached:  # keys reach another process's run; q leaves it running
        out.append((0, Text("attached" + (", read-only" if s.read_only else "")
                            + ": q detaches", style="bold cyan")))
    if s.stalls:  # a warning, not an error: a compile may take minutes
        out.append((0, Text("stalled: " + ", ".join(
            f"{w} {fmt.duration(s.now - e.ts + e.seconds)}" for w, e in s.stalls.items()),
            style="bold yellow")))
    if s.building is not None:  # minutes on a demo's first use: progress, not a hang
        out.append((0, Text(fmt.building(s.building), style="bold cyan")))
    w = s.checkpoint_writing
    if w is not None:  # the background write of a checkpoint: progress, not a stall
        rate = w.bytes_written / w.seconds if w.seconds > 0 else 0.0
        out.append((0, Text(f"checkpoint step {w.step}: {fmt.gib(w.bytes_written)}/"
                            f"{fmt.gib(w.bytes_total)} at {fmt.gib(rate)}/s",
                            style="bold magenta")))
    if s.plan is not None:  # which limit ends the run
        ends = s.plan.limit(short=True)
        if s.plan.by_epochs and s.plan.max_steps > s.plan.epoch_steps and width >= 120:
            ends += f" ({s.plan.max_steps_from} {s.plan.max_steps} is past them)"
        out.append((1, field("ends", ends)))
    if s.best is not None:  # the checkpoint to serve: highest exact tau so far
        on = f" on {s.best.prompt_set}" if s.best.prompt_set else ""  # eval.best_set
        out.append((2, field("best", f"step {s.best.step} τ {s.best.tau:.2f}{on}", "bold")))
    cost = header_text(s)
    if cost:  # the device time held so far (and its money with cost.gpu_hour_price)
        out.append((2, field("cost", cost)))
    failed_sink = s.sinks.get("wandb") is not None and s.sinks["wandb"].status != "ok"
    out.append((1 if failed_sink else 4, field("wandb", s.wandb or "off")))
    if s.run_dir:
        out.append((3, field("run", s.run_dir, "")))
    if s.allocator:  # which CUDA allocator settings the run's numbers come from
        out.append((5, field("alloc", s.allocator, "dim")))
    return out

