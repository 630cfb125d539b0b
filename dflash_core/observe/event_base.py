"""The base of every event (events.py holds the vocabulary): the time it was made, the flags that
say where it matters, and its one-line JSON form."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar


def _now() -> float:
    return time.time()


@dataclass(frozen=True)
class Event:
    """Base class: every event carries the wall-clock time it was made.

    The class-level flags below say where an event matters; a subclass sets the ones where it
    differs from these defaults.
    """

    ts: float = field(default_factory=_now, kw_only=True)
    kind: ClassVar[str] = "Event"
    # Fields renamed since events.jsonl files were first written: {old key: field name}, so that
    # ``from_dict`` still reads an old file.
    old_names: ClassVar[dict[str, str]] = {}
    # Rare, and the operator must never miss it: a reader that has fallen far behind and drops
    # events to catch up keeps this one (the dashboard's event buffer).
    keep_when_behind: ClassVar[bool] = False
    # It sets what the dashboard shows (the run, its state, a worker's phase, a plan, an error, a
    # log line) rather than adding one more point to a series of samples that later ones replace.
    # Attaching to a long run reads these from the whole run and the samples only from the tail
    # of events.jsonl.
    sets_state: ClassVar[bool] = True
    # Worth a line in train.log and on the headless console (LineThrottle thins the periodic
    # ones); GPU, host and queue samples are not.
    in_text_log: ClassVar[bool] = True

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["event"] = self.kind
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), default=_json_default)


def _json_default(obj: Any) -> Any:
    # numpy / torch scalars and paths sneak in; keep the line valid JSON.
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)
