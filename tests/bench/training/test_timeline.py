"""bench/training/timeline.py: GPU busy shares and idle gaps from a profiler trace."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "training"))

from timeline import gaps, summarize, union  # noqa: E402


def test_union_and_gaps():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert gaps([(0, 3), (5, 8)], 0, 10) == [(3, 5), (8, 10)]
    assert gaps([(2, 12)], 0, 10) == [(0, 2)]


def test_summary_counts_overlapping_streams_once_and_names_what_the_host_did():
    k = lambda ts, dur, stream, cat="kernel": {  # noqa: E731
        "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": stream,
        "args": {"device": 1, "stream": stream}}
    trace = {"traceEvents": [
        k(0, 400, 7), k(200, 400, 20, "gpu_memcpy"),  # overlap: busy 0..600, once
        k(800, 200, 7),  # idle 600..800
        {"cat": "cpu_op", "name": "aten::item", "ts": 550, "dur": 300, "pid": 1, "tid": 42},
    ]}
    text = summarize(trace)
    assert "GPU 1: busy 80% of the window" in text  # 800 of 1000 us
    assert "stream 20: busy 40% (gpu_memcpy)" in text
    assert "idle 0.2 ms at +0.00 s: thread 42: aten::item" in text
