"""Several nodes (torchrun): one line per node from the summaries the nodes exchange at each
step boundary: step, this node's samples/s, how it ended, its queues, host and GPU memory, its last
error. Hidden on one node."""

from __future__ import annotations

from rich.text import Text

from dflash_core.observe import events as ev

from .. import fmt
from ..state.dashboard import DashboardState
from .panel import Panel, line, pack_first


def node_lines(n: ev.NodeStatus, lead_step: int, width: int) -> Text:
    """Two lines: the node's progress and how it ended (or how far behind it is), its queues,
    host, memory and all-reduce as room allows (whole fields, the least useful left out
    first); then its last error, cut to the width."""
    fields = [(0, Text(f"node {n.node}", style="bold")), (0, Text(f"step {n.step}")),
              (1, Text(f"{fmt.rate(n.samples_per_s)} samples/s"))]
    if n.ending:
        fields.append((0, Text(n.ending, style="bold red" if n.ending == "failed"
                               else "bold yellow")))
    elif n.step < lead_step - 1:
        fields.append((0, Text(f"{lead_step - n.step} steps behind", style="yellow")))
    fields.append((1, Text(f"hs {n.hs_depth}/{n.hs_capacity}", style="dim")))
    if n.prefetch:
        fields.append((3, Text("pf " + " ".join(f"{d}/{c}" for d, c in n.prefetch),
                               style="dim")))
    fields.append((2, Text(n.host, style="dim")))
    if n.gpu_mem:
        fields.append((2, Text(f"mem {fmt.gib(sum(n.gpu_mem))}")))
    if n.allreduce_s:
        fields.append((3, Text(f"all-reduce {n.allreduce_s:.2f} s")))
    out = [pack_first(fields, width, 2, indent="  ")]
    if n.error and not n.ending:
        out.append(line([("  ", ""), (fmt.short_message(n.error), "red")], width))
    return Text("\n").join(out)


class NodesPanel(Panel):
    PANEL_ID = "nodes"  # hidden until a node summary arrives (several nodes)
    TITLE = "Nodes"
    EMPTY = "one node"

    def show(self, state: DashboardState) -> None:
        self.display = bool(state.nodes)
        super().show(state)

    def draw(self, s: DashboardState, width: int) -> Text:
        if not s.nodes:
            return Text(self.EMPTY, style="dim")
        lead = max(n.step for n in s.nodes.values())
        return Text("\n").join(node_lines(n, lead, width) for n in s.nodes.values())
