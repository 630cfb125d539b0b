"""The base of every reducer of the event stream: the dashboard's state (``dflash_tui.state``)
and the report's data (``dflash_tui.report.data``) fold events one at a time into what they show.

A subclass handles an event kind with a method ``_on_<Kind>`` (``_on_StepMetrics``); ``handler``
finds it, and kinds without one are passed over. The handlers are checked against the event
vocabulary when the class is defined, so a misspelt kind fails at import instead of never running.
"""

from __future__ import annotations

from typing import Any, Callable

from dflash_core.observe import events as ev

HANDLER_PREFIX = "_on_"


class EventFold:
    _kinds: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kinds = {name[len(HANDLER_PREFIX):] for name in dir(cls)
                 if name.startswith(HANDLER_PREFIX) and callable(getattr(cls, name))}
        unknown = sorted(kinds - set(ev.EVENT_TYPES))
        if unknown:
            raise TypeError(f"{cls.__name__} handles {', '.join(unknown)}: no such event kind "
                            f"(the kinds are those of events.EVENT_TYPES)")
        cls._kinds = frozenset(kinds)

    @classmethod
    def kinds(cls) -> frozenset[str]:
        """The event kinds this fold has a handler for: a reader may skip every other line."""
        return cls._kinds

    def handler(self, e: ev.Event) -> Callable[[Any], Any] | None:
        """This fold's ``_on_<Kind>`` method for ``e``, or None when it does not handle it."""
        return getattr(self, HANDLER_PREFIX + e.kind, None)

    def dispatch(self, e: ev.Event, default: Any = None) -> Any:
        """Fold ``e`` through its handler; ``default`` when there is none."""
        handler = self.handler(e)
        return default if handler is None else handler(e)
