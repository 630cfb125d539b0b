"""Every Error event as it arrives (kind, source, phase, message) in a table; the selected one in
full below it: hint, device, and the whole traceback. Until the operator moves into the table the
newest error stays selected, so a fresh failure is on screen without a key press."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import DataTable, Static

from .. import fmt
from ..literal import literal
from ..state.dashboard import DashboardState
from ..state.rows import ErrorEntry


def error_detail(entry: ErrorEntry) -> Text:
    e = entry.event
    where = " ".join(x for x in (e.source, e.device) if x)
    head = Text.assemble((f"[{e.error_kind}] ", "bold red"), (where, "bold"),
                         (f"  phase {e.phase}" if e.phase else "", "dim"),
                         ("  fatal" if e.fatal else "  not fatal", "red" if e.fatal else "yellow"),
                         ("  (previous run)" if entry.previous else "", "dim"),
                         (f"  {fmt.clock(e.ts)}", "dim"))
    out = Text("\n").join([head, Text(e.message)])
    if e.hint:
        out.append_text(Text.assemble("\n", ("hint: ", "bold green"), e.hint))
    if e.traceback:
        out.append_text(Text("\n" + e.traceback.rstrip(), style="dim"))
    return out


class ErrorsPanel(Vertical):
    PANEL_ID = "errors"
    SAMPLED = False  # an error shows at once

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("id", self.PANEL_ID)
        super().__init__(**kwargs)
        self.border_title = "Errors"
        self._shown = 0
        self._entries: list[ErrorEntry] = []

    def compose(self) -> ComposeResult:
        table: DataTable = DataTable(cursor_type="row", zebra_stripes=False, id="error-table")
        table.add_columns("kind", "source", "phase", "message")  # time and the rest: below
        yield table
        with VerticalScroll(id="error-detail"):
            yield Static(Text("no errors", style="dim"), id="error-text")

    @property
    def table(self) -> DataTable:
        return self.query_one(DataTable)

    @property
    def detail_text(self) -> str:
        content = self.query_one("#error-text", Static).content
        return content.plain if isinstance(content, Text) else str(content)

    def show(self, state: DashboardState) -> None:
        self._entries = state.errors
        table = self.table
        for i, entry in enumerate(state.errors[self._shown:], start=self._shown):
            e = entry.event
            # Text, not str: a str cell is read as markup (literal.py)
            table.add_row(literal(e.error_kind, "bold red"), literal(e.source),
                          literal("previous run" if entry.previous else e.phase),
                          literal(fmt.short_message(e.message)), key=str(i))
        added = len(state.errors) > self._shown
        self._shown = len(state.errors)
        self.border_title = f"Errors ({state.error_count})" if state.error_count else "Errors"
        if added and not table.has_focus:
            table.move_cursor(row=self._shown - 1)
            self._select(self._shown - 1)

    def _select(self, index: int) -> None:
        if 0 <= index < self._shown:
            self.query_one("#error-text", Static).update(error_detail(self._entries[index]))
            self.query_one("#error-detail", VerticalScroll).scroll_home(animate=False)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._select(event.cursor_row)
