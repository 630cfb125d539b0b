"""The shared shape of a dashboard panel: a titled, scrollable box whose text is drawn from the
DashboardState for the width it has. The app calls `show(state)` only when the state says the panel
changed; a resize redraws from the last state it was shown."""

from __future__ import annotations

import textwrap

from rich.cells import cell_len
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from .. import fmt
from ..state.dashboard import DashboardState


def pack(fields: list[Text], width: int, sep: str = "  ", indent: str = "") -> Text:
    """Lay out short fields left to right, starting a new line (``indent`` first) rather than
    splitting a field."""
    out = Text()
    used = 0
    for f in fields:
        if not f.cell_len:
            continue
        if used and used + len(sep) + f.cell_len > width:
            out.append("\n" + indent)
            used = len(indent)
        elif used:
            out.append(sep)
            used += len(sep)
        out.append_text(f)
        used += f.cell_len
    return out


def fits(text: Text, width: int, lines: int, whole: bool = True) -> bool:
    """In at most ``lines`` lines; ``whole``: none of them wider than ``width`` either."""
    rows = text.plain.split("\n")
    return len(rows) <= lines and (not whole or all(cell_len(row) <= width for row in rows))


def keep_first(fields: list[tuple[int, Text]], width: int, lines: int = 1, sep: str = "  ",
               indent: str = "", whole: bool = False) -> list[Text]:
    """The fields `pack_first` keeps: the ones of lowest priority (highest number) are left out
    until the rest fit in ``lines``; the essentials (0) stay even when they do not. A field
    wider than the width fits on a line of its own, to be cut (outside text: a path), unless
    ``whole``."""
    kept = [(p, t) for p, t in fields if t.cell_len]
    while kept:
        if fits(pack([t for _, t in kept], width, sep, indent), width, lines, whole):
            break
        worst = max(p for p, _ in kept)
        if worst == 0:
            break
        kept.pop(max(i for i, (p, _) in enumerate(kept) if p == worst))
    return [t for _, t in kept]


def pack_first(fields: list[tuple[int, Text]], width: int, lines: int = 1,
               sep: str = "  ", indent: str = "", whole: bool = False) -> Text:
    """Like `pack`, in at most `lines` lines: fields are (priority, text), 0 first; the ones of
    lowest priority (highest number) are left out until the rest fit. Shown in their own order;
    what is still too wide (the essentials, a long path) is cut."""
    text = pack(keep_first(fields, width, lines, sep, indent, whole), width, sep, indent)
    if fits(text, width, lines):
        return text
    rows = list(text.split("\n"))[:lines]
    for row in rows:
        row.truncate(width, overflow="ellipsis")
    return Text("\n").join(rows)


def best_head(heads: list[Text], body: list[tuple[int, Text]], width: int, lines: int = 1,
              sep: str = "  ", indent: str = "") -> Text:
    """The fullest of ``heads`` (fullest first: a name with its device, then shorter) that
    leaves out no more of ``body``'s fields than the shortest head does: a label's words give
    way before any number."""
    def kept(head: Text) -> int:
        fields = keep_first([(0, head)] + body, width, lines, sep, indent, whole=True)
        return len(fields) if fits(pack(fields, width, sep, indent), width, lines) else -1
    least = kept(heads[-1])
    return next(h for h in heads if kept(h) >= least)


def pack_best(heads: list[Text], body: list[tuple[int, Text]], width: int, lines: int = 1,
              sep: str = "  ", indent: str = "") -> Text:
    """``body``'s fields after the `best_head`, packed as `pack_first` packs them, each whole."""
    head = best_head(heads, body, width, lines, sep, indent)
    return pack_first([(0, head)] + body, width, lines, sep, indent, whole=True)


def pack_rows(heads: list[Text], body: list[tuple[int, Text]], width: int, lines: int = 1,
              indent: str = "  ", wrap_for: int = 99) -> Text:
    """`pack_best` on one line where that leaves out no field of priority ``wrap_for`` or
    more important; else in up to ``lines`` lines, the later ones after ``indent``."""
    one = keep_first([(0, heads[-1])] + body, width, 1, whole=True)
    lost = [f for p, f in body if p <= wrap_for and f.cell_len and all(f is not k for k in one)]
    if lines > 1 and lost:
        return pack_best(heads, body, width, lines, indent=indent)
    return pack_best(heads, body, width, 1)


def tail(text: Text, words: str, width: int, style: str = "dim", least: int = 8) -> Text:
    """``text`` with outside words (a worker's detail) after it on its last line, cut to the
    width: they are not a number. Left out where fewer than ``least`` cells are left."""
    room = width - len(text.plain.split("\n")[-1]) - 2
    if not words or room < least:
        return text
    part = Text(words, style=style)
    part.truncate(room, overflow="ellipsis")
    return Text.assemble(text, "  ", part)


def wrapped(words: str, width: int, lines: int, indent: str = "", style: str = "") -> list[Text]:
    """Outside words (a message) wrapped at spaces over at most ``lines`` lines of ``width``,
    each after ``indent``; what does not fit is cut at the end of the last."""
    room = max(8, width - len(indent))
    rows = textwrap.wrap(words, room) or [""]
    if len(rows) > lines:
        rows = rows[:lines - 1] + [" ".join(rows[lines - 1:])]
    out = []
    for row in rows:
        t = Text(indent + row, style=style)
        t.truncate(max(1, width), overflow="ellipsis")
        out.append(t)
    return out


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
