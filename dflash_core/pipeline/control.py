"""The one small command interface between an operator (dashboard, signal handler, later a local
socket) and a running engine. Anything that can abort, restart or shut down a run goes through it,
so the same commands reach a headless engine and one owned by the dashboard."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from dflash_core.observe.bus import EventBus
from dflash_core.observe.events import Error

COMMANDS = ("abort", "restart", "shutdown", "stacks")


@runtime_checkable
class Controller(Protocol):
    bus: EventBus
    # True when the run belongs to another process (the dashboard attached to it): quitting then
    # detaches without asking, and shutdown() stops nothing of the run.
    detach_on_quit: bool

    @property
    def state(self) -> str: ...

    @property
    def final_status(self) -> str | None:
        """How the last run this controller ran ended (a terminal state); None before any
        ended, or when it runs none (an attached or replayed run)."""

    @property
    def failure(self) -> Error | None:
        """The first fatal error of the run this controller ran, if it failed (else None)."""

    def start(self) -> None:
        """Begin a run (preflight -> loading -> ...); returns at once, work happens on threads."""

    def abort(self) -> None:
        """Stop every worker (checkpoint first when training); returns at once."""

    def restart(self) -> None:
        """Abort, free memory, re-read the config file, resume from the latest checkpoint."""

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort if live, wait for every thread to end, close the sinks. Blocks up to timeout."""

    def stacks(self) -> None:
        """Publish where every worker thread is now (its Python stack), one Log event each."""

    def stuck_workers(self) -> list[str]:
        """Threads of its run still alive after the run ended, each with where it is now (none
        when the run is another process's)."""


def dispatch(controller: Controller, command: str) -> None:
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}; known: {COMMANDS}")
    getattr(controller, command)()
