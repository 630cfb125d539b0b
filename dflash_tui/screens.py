"""Modal screens: the yes/no confirmation in front of abort / restart / quit, and the key help."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from .literal import literal

KEYS = [
    ("r", "restart: abort, free memory, re-read config.yaml, resume from the latest checkpoint"),
    ("a", "abort: stop every worker (a checkpoint is written first when training)"),
    ("q", "quit: asks first if the run is live, then shuts the engine down and exits; "
          "attached (--attach): detaches at once, the run goes on"),
    ("s", "stacks: where every worker thread is now, in the log (stalls show there too)"),
    ("e", "focus the errors table; arrows pick an error, its traceback shows below"),
    ("l", "focus the log; arrows / page keys scroll it"),
    ("tab", "move focus between panels"),
    ("ctrl+p", "command palette: the same commands by name"),
    ("?", "this help; escape closes it"),
]


class ConfirmScreen(ModalScreen[bool]):
    """Dismisses with True on yes, False on no / escape."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(literal(self.question), id="question")
            with Horizontal(id="buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # the safe answer is the default

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        keys = Table.grid(padding=(0, 2))  # a grid keeps wrapped descriptions in their column
        keys.add_column(style="bold", no_wrap=True)
        keys.add_column()
        for key, what in KEYS:
            keys.add_row(key, what)
        with VerticalScroll(id="help"):  # a terminal too small for it scrolls it
            yield Static(Text("dflash dashboard: keys", style="bold"))
            yield Static(keys, id="help-text")
            yield Static(Text("A failure never closes this screen: errors show in the errors "
                              "pane, and the run waits for you. Esc closes this help.",
                              style="dim"), id="help-foot")

    def action_dismiss(self) -> None:
        self.dismiss(None)
