"""Event subscribers: events.jsonl, train.log and (optional) wandb."""

from dflash_core.observe.sinks.jsonl import JsonlSink
from dflash_core.observe.sinks.textlog import LineThrottle, TextLogSink, format_event
from dflash_core.observe.sinks.wandb_sink import WandbSink, validate_wandb_settings

__all__ = ["JsonlSink", "LineThrottle", "TextLogSink", "WandbSink", "format_event",
           "validate_wandb_settings"]
