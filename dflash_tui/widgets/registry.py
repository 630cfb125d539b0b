"""The dashboard's panels, listed once: the header, then the rows in screen order, each panel
class declaring its own id (``PANEL_ID``: its CSS id in dflash.tcss and the name DashboardState
gives it when an event changes it) and whether high-rate samples feed it (``SAMPLED``: the app
redraws those at most once per period)."""

from __future__ import annotations

from ..state.dashboard import EVERY_PANEL
from .errors import ErrorsPanel
from .gpus import GpusPanel
from .header import HeaderBar
from .log import LogPanel
from .nodes import NodesPanel
from .queues import QueuesPanel
from .targets import TargetsPanel
from .training import TrainingPanel

HEADER = HeaderBar
# (row id, its panels left to right); the rows' heights are in dflash.tcss.
ROWS = (
    ("row-hw", (GpusPanel, TargetsPanel)),
    ("row-flow", (QueuesPanel, NodesPanel, TrainingPanel)),
    ("row-report", (ErrorsPanel, LogPanel)),
)
PANELS = (HEADER,) + tuple(panel for _, row in ROWS for panel in row)
PANEL_IDS = frozenset(panel.PANEL_ID for panel in PANELS)
SAMPLED_PANELS = frozenset(panel.PANEL_ID for panel in PANELS if panel.SAMPLED)


def changed_panels(changed: set[str]) -> set[str]:
    """The ids of the panels DashboardState says changed, with its EVERY_PANEL made into all."""
    return (changed - {EVERY_PANEL}) | PANEL_IDS if EVERY_PANEL in changed else changed
