"""One row per GPU: role, memory bar (used/total), the engine's own torch allocation and the
preflight plan beside it, utilisation and temperature; then the host line. A CPU-only run shows the
host line and the logical workers instead."""

from __future__ import annotations

from rich.text import Text

from dflash_core.observe import events as ev

from .. import fmt
from ..state.dashboard import DashboardState
from ..state.rows import GpuRow, device_words
from .panel import Panel, bar, fit, line, note, pack_best, tail

MIN_BAR = 8
ROLE_SHORT = {"target": "target", "drafter": "drafter", "target+drafter": "tgt+dft", "": "-"}


def mem_style(frac: float) -> str:
    return "red" if frac >= 0.95 else "yellow" if frac >= 0.8 else "green"


def gpu_line(r: GpuRow, width: int) -> Text:
    head = Text.assemble((f"{r.index:>2} ", "bold"), (f"{ROLE_SHORT.get(r.role, r.role):<8}", "cyan"))
    plan = Text(f" plan {fmt.gib(r.plan)}", style="" if r.plan_fits else "bold red") if r.plan \
        else Text()
    if not r.sampled:
        return line([head, Text("no sample yet", style="dim"), plan], width)
    cap = r.budget  # a rehearsed smaller card: the limit is the card
    frac = r.mem_used / cap if cap else 0.0
    mem = Text(f"{r.mem_used / fmt.GIB:.1f}/{fmt.gib(cap)}" + (" lim" if r.limit else ""))
    alarms = Text()
    if r.alloc_retries:
        alarms.append(f" retries {r.alloc_retries}", style="yellow")
    if r.ooms:
        alarms.append(f" OOM {r.ooms}", style="bold red")
    # The bar and used/total come first, then what warns; the rest as room allows.
    optional = [alarms, f" {r.util:3.0f}%" if r.util >= 0 else "",
                f" {r.temperature:2.0f}°C" if r.temperature >= 0 else "",
                f" torch {fmt.gib(r.torch_allocated)}" if r.torch_allocated else "",
                f" res {fmt.gib(r.torch_reserved)}" if r.torch_reserved else "", plan]
    tail, room = fit([mem], optional, width - head.cell_len, keep=MIN_BAR + 1)
    bar_w = min(24, room - 1)
    return line([head, bar(frac, bar_w, mem_style(frac)) if bar_w >= 3 else "", tail], width)


ROLE_TINY = {"target": "tgt", "drafter": "dft", "target+drafter": "t+d", "": "-"}
MIN_CELL = 17  # narrowest cell of the two-column layout: "7 dft 91/95G 67%"


def gpu_cell(r: GpuRow, width: int) -> Text:
    """One GPU in a cell of the two-column layout (a small terminal with many GPUs): index, role,
    memory used/usable in its warning colour, then alarms, utilisation and a bar as room allows."""
    head = Text.assemble((f"{r.index} ", "bold"), (f"{ROLE_TINY.get(r.role, r.role[:3]):<3} ",
                                                      "cyan"))
    if not r.sampled:
        return line([head, Text("no sample", style="dim")], width)
    cap = r.budget
    frac = r.mem_used / cap if cap else 0.0
    mem = Text(f"{r.mem_used / fmt.GIB:.0f}/{cap / fmt.GIB:.0f}G", style=mem_style(frac))
    alarm = (Text(" OOM", style="bold red") if r.ooms else
             Text(f" R{r.alloc_retries}", style="yellow") if r.alloc_retries else Text())
    util = f" {r.util:.0f}%" if r.util >= 0 else ""
    tail, room = fit([mem], [alarm, util], width - head.cell_len)
    bar_w = min(8, room - 1)
    return line([head, bar(frac, bar_w, mem_style(frac)) if bar_w >= 3 else "", tail], width)


def gpu_lines(rows: list[GpuRow], width: int, height: int) -> list[Text]:
    """One line per GPU; when they and the host line do not fit the panel's height, two columns
    (GPUs 0..k-1 left, k.. right), so every GPU stays in view on an 80x24 terminal."""
    if len(rows) + 1 <= height or width < 2 * MIN_CELL + 1:
        return [gpu_line(r, width) for r in rows]
    half = -(-len(rows) // 2)
    col = (width - 1) // 2
    out = []
    for i in range(half):
        left = gpu_cell(rows[i], col)
        left.pad_right(col - left.cell_len)
        right = gpu_cell(rows[i + half], col) if i + half < len(rows) else Text()
        out.append(Text.assemble(left, " ", right))
    return out


def worker_line(w: ev.WorkerStatus, width: int) -> Text:
    """A CPU run's worker: name, device (a split target's rank: its rank stays when the rest
    gives way), status, then its detail as room allows."""
    # the device in a column of its own where it is short ("cpu", "cpu:0")
    heads = [Text.assemble((f"{w.worker:<10}", "bold"), (f" {words:<5}" if words else "", "cyan"))
             for words in device_words(w.device)]
    return tail(pack_best(heads, [(0, Text(w.status))], width), w.detail, width)


def host_line(s: DashboardState, width: int) -> Text:
    h = s.host
    if h is None:
        return Text("host: not sampled" if s.ended else "host: no sample yet", style="dim")
    frac = h.ram_used / h.ram_total if h.ram_total else 0.0
    rss = Text.assemble(("  this process ", "dim"), fmt.gib(h.process_rss)) if h.process_rss \
        else ""
    text, _ = fit([("host ", "bold"), ("RAM ", "dim"),
                   (f"{h.ram_used / fmt.GIB:.1f}/{fmt.gib(h.ram_total)}", mem_style(frac)),
                   ("  CPU ", "dim"), f"{h.cpu_percent:.0f}%"], [rss], width)
    return line([text], width)


class GpusPanel(Panel):
    PANEL_ID = "gpus"
    TITLE = "GPUs"

    def draw(self, s: DashboardState, width: int) -> Text:
        height = self.scrollable_content_region.height or 100
        rows = s.gpu_rows()
        why = s.ended_before("loading")  # telemetry starts as the targets load
        if why and not rows and not s.workers and s.host is None:
            self.border_title = self.TITLE
            return note(f"no GPU sampled: {why}", width)
        lines = gpu_lines(rows, width, height)
        if not lines and s.cpu_only and s.workers:
            self.border_title = "Workers (CPU)"
            lines = [worker_line(w, width) for w in s.workers.values()]
        else:
            self.border_title = self.TITLE
        lines.append(host_line(s, width))
        return Text("\n").join(lines)
