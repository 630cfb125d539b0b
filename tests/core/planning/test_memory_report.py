"""The memory plan as people read it: the table, and what to change when it does not fit."""

from dflash_core.planning.memory import plan_memory
from dflash_core.planning.memory_report import format_plan

from ..planning.test_memory import H200, QWEN36_27B, node


def test_format_plan_table():
    plan = plan_memory(node(micro_block_tokens=16384), QWEN36_27B, H200, H200)
    lines = format_plan(plan).splitlines()
    assert lines[0].split() == ["memory", "plan", "(GiB)", "cuda:0..6", "cuda:7"]
    assert lines[1].split() == ["role", "target", "drafter"]
    assert "weights" in lines[2] and "50.1" in lines[2] and lines[2].rstrip().endswith("-")
    assert len({len(line) for line in lines[:-2]}) == 1  # fixed width
    assert any(line.split() == ["total", "77.6", "109.3"] for line in lines)
    assert any(line.split() == ["headroom", "61.4", "29.7"] for line in lines)  # 139 GiB free
    assert any(line.split() == ["drafter", "layers", "-", "kept"] for line in lines)
    assert any("full target logits would add 30.3 GiB" in line for line in lines)
