"""The events.jsonl sink: every event of the run as one line (``event_log.EventLogWriter``),
read back by replay, attach and the report through ``dflash_core.observe.event_log``."""

from __future__ import annotations

from dflash_core.observe.event_log import EventLogWriter


class JsonlSink(EventLogWriter):
    """The run's events.jsonl as a critical bus subscriber: a write that fails stops the run
    rather than lose records (the bus reports it as the sink's error)."""
