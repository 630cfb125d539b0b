"""Several nodes (torchrun): one line per node from the summaries the nodes exchange at each
step boundary: step, this node's samples/s, its queues, its GPU memory, how it ended or its last
error. Hidden on one node."""

from __future__ import annotations

from rich.text import Text

from dflash_core.observe import events as ev

from .. import fmt
from ..state.dashboard import DashboardState
from .panel import Panel, line


def node_lines(n: ev.NodeStatus, lead_step: int, width: int) -> Text:
    """Two lines: the node's progress and queues, then its host, memory and state."""
    queues = " ".join([f"hs {n.hs_depth}/{n.hs_capacity}"] +
                      [f"pf {d}/{c}" for d, c in n.prefetch])
    first = line([(f"node {n.node} ", "bold"), f"step {n.step}  ",
                  f"{fmt.rate(n.samples_per_s)} samples/s  ", (queues, "dim")], width)
    second: list = ["  ", (n.host, "dim")]
    if n.gpu_mem:
        second.append(f"  mem {fmt.gib(sum(n.gpu_mem))}")
    if n.allreduce_s:
        second.append(f"  all-reduce {n.allreduce_s:.2f} s")
    if n.ending:
        second.append((f"  {n.ending}", "bold red" if n.ending == "failed" else "bold yellow"))
    elif n.error:
        second.append((f"  {fmt.short_message(n.error)}", "red"))
    elif n.step < lead_step - 1:
        second.append((f"  {lead_step - n.step} steps behind", "yellow"))
    return Text("\n").join([first, line(second, width)])


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
