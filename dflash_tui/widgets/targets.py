"""One line per target worker, following it through its life: a load progress bar (bytes, shards,
seconds), then "warming up" (first forward, kernels compiling), then its throughput; a failed
target says why."""

from __future__ import annotations

from rich.text import Text

from dflash_core.observe import events as ev

from .. import fmt
from ..state.dashboard import DashboardState
from ..state.rows import TARGET_LOADED, TargetRow
from .panel import Panel, bar, fit, line, note


def target_line(t: TargetRow, width: int) -> Text:
    # Narrow panels drop the device label (the GPUs panel has it) to keep the numbers.
    device = f"{t.device} " if t.device and width >= 50 else ""
    head = Text.assemble((f"{t.worker} ", "bold"), (device, "cyan"))
    if t.status == ev.WORKER_FAILED:
        # Why it failed gets a line of its own: it is the point of this row.
        return Text("\n").join([line([head, ("FAILED", "bold white on red")], width),
                                line([("  ", ""), (t.error or t.detail or "see the errors pane",
                                                   "red")], width)])
    if t.status == ev.WORKER_LOADING:
        frac = t.bytes_loaded / t.bytes_total if t.bytes_total else 0.0
        nums = Text(f"{t.bytes_loaded / fmt.GIB:.1f}/{fmt.gib(t.bytes_total)}")
        more = f" {t.shards_loaded}/{t.shards_total} shards {t.seconds:.0f}s"
        room = width - head.cell_len - nums.cell_len - 1
        if room - len(more) < 6:
            more = f" {t.seconds:.0f}s"
        bar_w = min(30, room - len(more))
        return line([head, bar(frac, bar_w, "yellow") if bar_w >= 3 else "", nums, more], width)
    if t.status == TARGET_LOADED:
        return line([head, ("loaded", "yellow"),
                     f" {fmt.gib(t.memory_after or t.bytes_total)} in {t.seconds:.0f}s"], width)
    if t.status == ev.WORKER_WARMUP:
        return line([head, ("warming up", "bold magenta"),
                     (f" {t.detail or 'first forward, compiling kernels'}", "dim")], width)
    if t.status == ev.WORKER_RUNNING:
        text, _ = fit([head, (f"{fmt.rate(t.tokens_per_s)} tok/s", "bold green")],
                      [f"  blocked {fmt.pct(t.blocked_frac)}", f"  starved {fmt.pct(t.starved_frac)}",
                       (f"  {t.batches} batches", "dim")], width)
        return line([text], width)
    last = f"  last {fmt.rate(t.tokens_per_s)} tok/s, {t.batches} batches" if t.batches else ""
    return line([head, t.status, (f"  {t.detail}" if t.detail else last, "dim")], width)


class TargetsPanel(Panel):
    PANEL_ID = "targets"
    TITLE = "Targets"
    EMPTY = "no target workers yet"

    def draw(self, s: DashboardState, width: int) -> Text:
        rows = list(s.targets.values())
        if not rows:
            why = s.ended_before("loading")
            return note(f"no target loaded: {why}" if why else "no target worker in this run"
                        if s.ended else self.EMPTY, width)
        lines = [target_line(t, width) for t in rows]
        running = [t for t in rows if t.status == ev.WORKER_RUNNING]
        if len(running) > 1:
            lines.append(line([("all targets ", "dim"),
                               (f"{fmt.rate(sum(t.tokens_per_s for t in running))} tok/s", "bold")],
                              width))
        return Text("\n").join(lines)
