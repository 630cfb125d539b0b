"""The target stage's word on a quantized target's weights: what the load learnt beyond
preflight's line (the matmul that runs kept FP8 weights, or a load again dequantized) is said
once per run, by target 0; what preflight said already is not said again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash_core.models.target.fp8 import QuantizedNote
from dflash_core.observe.events import Log
from dflash_core.pipeline.target_stage import TargetStage


def said(rank: int, note) -> list:
    events = []
    stage = SimpleNamespace(rank=rank, name=f"target-{rank}", publish=events.append)
    TargetStage._say_quantized(stage, note)
    return events


@pytest.mark.parametrize("note, level", [
    (QuantizedNote("kept, run by the engine's FP8 linear", kept=True, planned=False), "info"),
    (QuantizedNote("loaded again dequantized", kept=False, planned=False), "warning"),
])
def test_what_the_load_learnt_is_said_by_target_0(note, level):
    (event,) = said(0, note)
    assert isinstance(event, Log) and event.level == level and event.message == note.line
    assert event.source == "target-0"
    assert said(1, note) == []


def test_what_preflight_said_and_plain_weights_are_not_said_again():
    assert said(0, QuantizedNote("dequantized on the CPU", kept=False, planned=True)) == []
    assert said(0, None) == []
