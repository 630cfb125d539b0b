"""Each prefetch queue and the hidden-state queue as depth/capacity with a short history, and one
line naming the bottleneck: which side of the HS queue waits on the other."""

from __future__ import annotations

import re

from rich.text import Text

from .. import fmt
from ..state.dashboard import DashboardState
from ..state.rows import QueueRow
from .panel import Panel, line, note, wrapped


def queue_line(q: QueueRow, width: int) -> Text:
    head = Text.assemble((f"{q.name:<10} ", "bold"), f"{q.depth:>3}/{q.capacity:<3} ")
    room = width - head.cell_len
    # An empty queue starves its consumer, a full one blocks its producer: both worth a colour.
    style = "yellow" if q.capacity and q.depth in (0, q.capacity) else "green"
    return line([head, (fmt.spark(q.history, room, top=q.capacity or None), style)], width)


def bottleneck_style(text: str) -> str:
    return "bold green" if text == "balanced" else "bold yellow"


def verdict(neck: str, width: int) -> list[Text]:
    """The bottleneck line in the words that fit: whole, without "of the time", without whose
    share each is (the verdict names the sides); still too long, wrapped at a space, so its
    shares are never cut."""
    style = bottleneck_style(neck)
    short = re.sub(r"\b(targets|drafter) (?=blocked|starved|waited)", "",
                   neck.replace(" of the time", ""))
    for form in (neck, neck.replace(" of the time", ""), short):
        if len(form) <= width:
            return [Text(form, style=style)]
    return wrapped(short, width, 2, style=style)


class QueuesPanel(Panel):
    PANEL_ID = "queues"
    TITLE = "Queues"
    EMPTY = "no queues yet"

    def draw(self, s: DashboardState, width: int) -> Text:
        why = s.ended_before("loading")  # the queues are made as the targets load
        if why and not s.queues:
            return note(f"no queues: {why}", width)
        neck = s.bottleneck()
        # The verdict first: on a small screen the queue rows may need scrolling, it must not.
        yet = "in this run" if s.ended else "yet"
        lines = verdict(neck, width) if neck else [Text(f"flow: no step {yet}", style="dim")]
        lines += [queue_line(q, width) for q in s.queues.values()] or [
            Text(f"no queues {yet}", style="dim")]
        return Text("\n").join(lines)
