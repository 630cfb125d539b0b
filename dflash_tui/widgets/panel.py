"""The shared shape of a dashboard panel: a titled, scrollable box whose text is drawn from the
DashboardState for the width it has. The app calls `show(state)` only when the state says the panel
changed; a resize redraws from the last state it was shown."""

from __future__ import annotations

import textwrap

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from .. import fmt
from ..state.dashboard import DashboardState


def pack(fields: list[Text], width: int, sep: str = "  ") -> Text:
    """Lay out short fields left to right, starting a new line rather than splitting a field."""
    out = Text()
    used = 0
    for f in fields:
        if not f.cell_len:
            continue
        if used and used + len(sep) + f.cell_len > width:
            out.append("\n")
            used = 0
        elif used:
            out.append(sep)
            used += len(sep)
        out.append_text(f)
        used += f.cell_len
    return out


def pack_first(fields: list[tuple[int, Text]], width: int, lines: int = 1,
               sep: str = "  ") -> Text:
    """Like `pack`, in at most `lines` lines: fields are (priority, text), 0 first; the ones of
    lowest priority (highest number) are left out until the rest fit. Shown in their own order."""
    kept = [(p, t) for p, t in fields if t.cell_len]
    while kept:
        text = pack([t for _, t in kept], width, sep)
        if len(text.plain.split("\n")) <= lines:
            return text
        worst = max(p for p, _ in kept)
        if worst == 0:  # the essentials never go: lines past `lines` are cut instead
            rows = list(text.split("\n"))[:lines]
            for row in rows:
                row.truncate(width, overflow="ellipsis")
            return Text("\n").join(rows)
        i = max(i for i, (p, _) in enumerate(kept) if p == worst)
        kept.pop(i)
    return Text()


def field(label: str, value: str, style: str = "bold") -> Text:
    return Text.assemble((label + " ", "dim"), (value, style)) if label else Text(value, style)


def bar(frac: float, width: int, style: str) -> Text:
    filled, empty = fmt.bar(frac, width)
    return Text.assemble((filled, style), (empty, "dim"), " ")


def note(message: str, width: int, style: str = "dim") -> Text:
    """A sentence in a panel (why it is empty), wrapped at words to the panel's width: panels
    never wrap by themselves."""
    return Text("\n".join(textwrap.wrap(message, max(8, width))) or message, style=style)


def line(parts: list[Text | str], width: int) -> Text:
    """One line, cut with an ellipsis if it is too wide."""
    t = Text.assemble(*parts)
    t.truncate(max(1, width), overflow="ellipsis")
    return t


def fit(required: list, optional: list, width: int, keep: int = 0) -> tuple[Text, int]:
    """`required` parts, then as many `optional` parts (in order) as fit in `width` while leaving
    `keep` cells free; returns the line and the cells left over."""
    out = Text.assemble(*required)
    for part in optional:
        t = Text.assemble(part)
        if out.cell_len + t.cell_len + keep > width:
            break
        out.append_text(t)
    return out, width - out.cell_len


class Panel(VerticalScroll):
    PANEL_ID = ""  # each panel's own (registry.py lists the panels)
    SAMPLED = True  # fed by high-rate samples: redrawn at most once per period
    TITLE = ""
    EMPTY = "waiting for the engine…"

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("id", self.PANEL_ID)
        super().__init__(**kwargs)
        self.border_title = self.TITLE
        self._state: DashboardState | None = None

    def compose(self) -> ComposeResult:
        yield Static(Text(self.EMPTY, style="dim"), classes="body")

    @property
    def body(self) -> Static:
        return self.query_one(".body", Static)

    @property
    def text(self) -> str:
        """What the panel shows, as plain text (tests, debugging)."""
        content = self.body.content
        return content.plain if isinstance(content, Text) else str(content)

    def show(self, state: DashboardState) -> None:
        self._state = state
        self.body.update(self.draw(state, self.scrollable_content_region.width or 80))

    def on_resize(self) -> None:
        if self._state is not None:
            self.show(self._state)

    def draw(self, state: DashboardState, width: int) -> Text:
        raise NotImplementedError
