"""Event subscribers: events.jsonl, train.log and (optional) wandb."""

from .jsonl import JsonlSink
from .textlog import LineThrottle, TextLogSink, format_event
from .wandb_sink import WandbSink, validate_wandb_settings

__all__ = ["JsonlSink", "LineThrottle", "TextLogSink", "WandbSink", "format_event",
           "validate_wandb_settings"]
