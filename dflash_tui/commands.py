"""Command palette (ctrl+p) entries for the dashboard's own actions."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

COMMANDS = [
    ("Restart run", "restart", "Abort, re-read config.yaml and resume from the latest checkpoint"),
    ("Abort run", "abort", "Stop every worker (checkpoint first when training)"),
    ("Quit", "quit", "Shut the engine down and leave"),
    ("Worker stacks", "stacks", "Where every worker thread is now, in the log"),
    ("Focus errors", "focus_errors", "Move to the errors table"),
    ("Focus log", "focus_log", "Move to the log"),
    ("Help: keys", "help", "What each key does"),
]


class DashboardCommands(Provider):
    async def discover(self) -> Hits:
        for title, action, help_text in COMMANDS:
            yield DiscoveryHit(title, partial(self._run, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, action, help_text in COMMANDS:
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self._run, action),
                          help=help_text)

    async def _run(self, action: str) -> None:
        await self.app.run_action(action)
