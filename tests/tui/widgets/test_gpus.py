"""One GPU line: what a rehearsed card and a struggling allocator look like."""

from dflash_tui.state.rows import GpuRow
from dflash_tui.widgets.gpus import gpu_line

GIB = 2**30


def test_a_limited_card_shows_its_limit_and_the_allocator_alarms():
    row = GpuRow(7, name="H200", role="drafter", mem_used=int(90.9 * GIB), mem_total=141 * GIB,
                 torch_allocated=86 * GIB, torch_reserved=89 * GIB, limit=95 * GIB,
                 alloc_retries=3, ooms=1, plan=int(91.6 * GIB), util=67, temperature=50,
                 sampled=True)
    text = gpu_line(row, 120).plain
    assert "90.9/95.0G lim" in text  # the limit is the card here
    assert "retries 3 OOM 1" in text
    assert "torch 86.0G res 89.0G plan 91.6G" in text
    narrow = gpu_line(row, 60).plain  # alarms before the nice-to-haves
    assert "retries 3 OOM 1" in narrow and "res" not in narrow


def test_a_whole_card_without_alarms_reads_as_before():
    row = GpuRow(0, role="target", mem_used=20 * GIB, mem_total=int(139.8 * GIB),
                 torch_allocated=16 * GIB, util=3, temperature=40, sampled=True)
    text = gpu_line(row, 120).plain
    assert "20.0/139.8G" in text and "lim" not in text and "retries" not in text
