"""Recent log lines: the engine's Log events plus state changes, checkpoints, evaluations and
errors (one line each), and a post-mortem of the previous run when there is one."""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.widgets import RichLog

from .. import fmt
from ..state.dashboard import DashboardState

LEVEL_STYLES = {"debug": "dim", "info": "", "warning": "yellow", "error": "bold red"}


class LogPanel(RichLog):
    PANEL_ID = "log"
    SAMPLED = False  # a log line shows at once

    def __init__(self, max_lines: int = 1000, **kwargs) -> None:
        kwargs.setdefault("id", self.PANEL_ID)
        super().__init__(max_lines=max_lines, wrap=True, min_width=20, markup=False,
                         highlight=False, **kwargs)
        self.border_title = "Log"
        self._seq = 0  # last LogLine.seq written
        self._state: DashboardState | None = None
        self._width = 0

    def show(self, state: DashboardState) -> None:
        self._state = state
        new = [x for x in state.log if x.seq > self._seq][-self.max_lines:]
        for x in new:
            self.write(Text.assemble((fmt.clock(x.ts) + " ", "dim"), (f"{x.source}: ", "cyan"),
                                     (x.text, LEVEL_STYLES.get(x.level, ""))))
        if new:
            self._seq = new[-1].seq

    def on_resize(self, event: events.Resize) -> None:
        # RichLog wraps a line once, when written: after the pane changes width (a tmux split,
        # a resized terminal) write the kept lines again at the new width.
        width = event.size.width
        if width != self._width and self._width and self._state is not None:
            self.clear()
            self._seq = 0
            self.show(self._state)
        self._width = width

    @property
    def text(self) -> str:
        return "\n".join(strip.text for strip in self.lines)
