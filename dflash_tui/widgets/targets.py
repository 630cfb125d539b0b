"""One row per target worker, following it through its life: a load progress bar (bytes, shards,
seconds), then "warming up" (first forward, kernels compiling), then its throughput; a failed
target says why. A rank of a target split over several GPUs is its own row, named by its rank
("rank 1/2"), which stays when the device's words give way.

A row's numbers are never cut: on a narrow panel whole fields are left out, the least important
first, or (when the panel has the rows) the row takes a second line."""

from __future__ import annotations

from rich.text import Text

from dflash_core.observe import events as ev

from .. import fmt
from ..state.dashboard import DashboardState
from ..state.rows import TARGET_LOADED, TargetRow, device_words
from .panel import (Panel, best_head, keep_first, line, note, pack, pack_best, pack_first,
                    pack_rows, tail, wrapped)

INDENT = "  "  # a row's second line
MIN_BAR, MAX_BAR = 6, 30  # a load bar takes the cells left over, between these
DETAIL_ROOM = 12  # cells of a worker's detail worth more than its device's words
WRAP_FOR = 2  # a row takes its second line to keep a field of this priority or a higher one


def heads(t: TargetRow) -> list[Text]:
    """The row's name with its device, fullest first (see rows.device_words)."""
    return [Text.assemble((t.worker, "bold"), (f" {words}" if words else "", "cyan"))
            for words in device_words(t.device)]


def fields_line(t: TargetRow, body: list[tuple[int, Text]], width: int, lines: int) -> Text:
    """The name and ``body`` on one line, or in ``lines`` lines where one line would leave out
    a number that matters (priority up to WRAP_FOR)."""
    return pack_rows(heads(t), body, width, lines, INDENT, WRAP_FOR)


def loading_line(t: TargetRow, width: int, lines: int = 1) -> Text:
    """Name, bar, bytes, seconds, shards on one line, the bar filling what the numbers leave;
    where that leaves the bar or the shards out and the panel has the rows, the bar and the
    shards on a second line."""
    frac = t.bytes_loaded / t.bytes_total if t.bytes_total else 0.0
    place = Text(" " * MIN_BAR)  # the bar's place, given up first
    nums = [(0, Text(f"{t.bytes_loaded / fmt.GIB:.1f}/{fmt.gib(t.bytes_total)}")),
            (1, Text(f"{t.seconds:.0f}s"))]
    shards = Text(f"{t.shards_loaded}/{t.shards_total} shards", style="dim")
    body = [(4, place)] + nums + [(2, shards)]
    head = best_head(heads(t), body, width)
    kept = keep_first([(0, head)] + body, width, whole=True)
    if lines > 1 and len(kept) < 1 + len(body):
        first = pack_best(heads(t), nums, width)
        room = width - len(INDENT) - shards.cell_len - 2
        second = [INDENT, load_bar(frac, min(MAX_BAR, room)), "  "] if room >= MIN_BAR else [
            INDENT]
        return Text("\n").join([first, line(second + [shards], width)])
    if any(f is place for f in kept):
        bar = load_bar(frac, min(MAX_BAR, MIN_BAR + width - pack(kept, width).cell_len))
        kept = [bar if f is place else f for f in kept]
    return line([pack(kept, width)], width)  # a pane too narrow for the bytes: still one line


def load_bar(frac: float, width: int) -> Text:
    filled, empty = fmt.bar(frac, width)
    return Text.assemble((filled, "yellow"), (empty, "dim"))


def with_detail(t: TargetRow, body: list[tuple[int, Text]], detail: str, width: int) -> Text:
    """The name, ``body``, then the worker's own words cut to what is left: the device's words
    give way to DETAIL_ROOM cells of them."""
    room = [(3, Text(" " * min(len(detail), DETAIL_ROOM)))]
    head = best_head(heads(t), body + room, width)
    return tail(pack_first([(0, head)] + body, width, whole=True), detail, width)


def target_line(t: TargetRow, width: int, lines: int = 1) -> Text:
    """The row of ``t`` in ``width`` cells, in at most ``lines`` lines where that keeps more
    of its numbers (a failed one: its reason below it, in that many lines)."""
    if t.status == ev.WORKER_FAILED:
        # Why it failed gets a line of its own: it is the point of this row.
        head = pack_best(heads(t), [(0, Text("FAILED", style="bold white on red"))], width)
        why = t.error or t.detail or "see the errors pane"
        return Text("\n").join([head] + wrapped(why, width, lines, INDENT, "red"))
    if t.status == ev.WORKER_LOADING:
        return loading_line(t, width, lines)
    if t.status == TARGET_LOADED:
        return fields_line(t, [(0, Text("loaded", style="yellow")),
                               (1, Text(f"{fmt.gib(t.memory_after or t.bytes_total)} in "
                                        f"{t.seconds:.0f}s"))], width, lines)
    if t.status == ev.WORKER_WARMUP:
        return with_detail(t, [(0, Text("warming up", style="bold magenta"))],
                           t.detail or "first forward, compiling kernels", width)
    if t.status == ev.WORKER_RUNNING:
        return fields_line(t, [(0, Text(f"{fmt.rate(t.tokens_per_s)} tok/s", style="bold green")),
                               (1, Text(f"blocked {fmt.pct(t.blocked_frac)}")),
                               (2, Text(f"starved {fmt.pct(t.starved_frac)}")),
                               (4, Text(f"{t.batches} batches", style="dim"))], width, lines)
    status = [(0, Text(t.status))]
    if t.detail:
        return with_detail(t, status, t.detail, width)
    last = [(1, Text(f"last {fmt.rate(t.tokens_per_s)} tok/s", style="dim")),
            (4, Text(f"{t.batches} batches", style="dim"))] if t.batches else []
    return fields_line(t, status + last, width, lines)


class TargetsPanel(Panel):
    PANEL_ID = "targets"
    TITLE = "Targets"
    EMPTY = "no target workers yet"

    def draw(self, s: DashboardState, width: int) -> Text:
        rows = list(s.targets.values())
        if not rows and s.building is not None:  # the target itself being made (the demo's)
            filled, empty = fmt.bar(s.building.fraction, min(40, max(8, width - 2)))
            return Text.assemble(note(fmt.building(s.building), width, "bold cyan"), "\n",
                                 (filled, "cyan"), (empty, "dim"), "\n",
                                 note("made once, then reused from the build cache", width))
        if not rows:
            why = s.ended_before("loading")
            return note(f"no target loaded: {why}" if why else "no target worker in this run"
                        if s.ended else self.EMPTY, width)
        running = [t for t in rows if t.status == ev.WORKER_RUNNING]
        total = len(running) > 1
        # Two lines a row where the panel has the rows for them (a split target's ranks at
        # 80x24), else one: every target stays in view.
        height = self.scrollable_content_region.height or 100
        lines = 2 if 2 * len(rows) + total <= height else 1
        out = [target_line(t, width, lines) for t in rows]
        if total:
            out.append(line([("all targets ", "dim"),
                             (f"{fmt.rate(sum(t.tokens_per_s for t in running))} tok/s", "bold")],
                            width))
        return Text("\n").join(out)
