"""Where a GPU's time goes in a torch profiler trace: busy share per GPU and per stream, and the
longest idle gaps with what each host thread was doing meanwhile (the op it was inside).

    python bench/training/timeline.py trace.json            # a chrome trace from torch.profiler
    (bench/training/pipeline.py --profile K writes one of K steady-state steps and prints this summary)

A GPU counts as busy while any kernel or copy runs on it (the union over its streams), so a copy
overlapping a kernel is not counted twice.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged, sorted (start, end) intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def gaps(busy: list[tuple[float, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    """The idle stretches of [t0, t1] between merged busy intervals."""
    out, at = [], t0
    for s, e in busy:
        if s > at:
            out.append((at, min(s, t1)))
        at = max(at, e)
        if at >= t1:
            break
    if at < t1:
        out.append((at, t1))
    return [(s, e) for s, e in out if e > s]


def _host_ops(events: list[dict]) -> dict:
    """Per host thread: its top-level CPU ops as (start, end, name), sorted."""
    by_tid = defaultdict(list)
    for ev in events:
        if ev.get("cat") in ("cpu_op", "user_annotation", "python_function") and "dur" in ev:
            by_tid[(ev.get("pid"), ev.get("tid"))].append(
                (ev["ts"], ev["ts"] + ev["dur"], ev.get("name", "?")))
    return {k: sorted(v) for k, v in by_tid.items()}


def _inside(ops: list[tuple[float, float, str]], t: float) -> str:
    """The outermost op running at time t (the first that contains it), or '-'."""
    for s, e, name in ops:
        if s <= t < e:
            return name
        if s > t:
            break
    return "-"


def summarize(trace: dict, top: int = 5) -> str:
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    gpu = [e for e in events if e.get("cat") in GPU_CATS and "dur" in e]
    if not gpu:
        return "no GPU activity in the trace"
    t0 = min(e["ts"] for e in events if "ts" in e)
    t1 = max(e["ts"] + e.get("dur", 0) for e in events if "ts" in e)
    span = max(t1 - t0, 1e-9)
    lines = [f"window {span / 1e6:.2f} s"]
    host = _host_ops(events)
    by_dev = defaultdict(list)
    by_stream = defaultdict(list)
    for e in gpu:
        dev = e.get("args", {}).get("device", 0)
        by_dev[dev].append((e["ts"], e["ts"] + e["dur"]))
        by_stream[(dev, e.get("args", {}).get("stream", e.get("tid")))].append(
            (e["ts"], e["ts"] + e["dur"], e["cat"]))
    for dev in sorted(by_dev):
        busy = union(by_dev[dev])
        share = sum(e - s for s, e in busy) / span
        lines.append(f"GPU {dev}: busy {share:.0%} of the window")
        for (d, stream), evs in sorted(by_stream.items(), key=lambda kv: str(kv[0])):
            if d != dev:
                continue
            s_busy = sum(e - s for s, e in union([(s, e) for s, e, _ in evs])) / span
            kinds = sorted({c for _, _, c in evs})
            lines.append(f"  stream {stream}: busy {s_busy:.0%} ({', '.join(kinds)})")
        idle = sorted(gaps(busy, t0, t1), key=lambda g: g[0] - g[1])[:top]
        for s, e in idle:
            mid = (s + e) / 2
            doing = "; ".join(f"thread {tid}: {_inside(ops, mid)}"
                              for (_, tid), ops in sorted(host.items(), key=lambda kv: str(kv[0]))
                              if _inside(ops, mid) != "-")
            lines.append(f"  idle {(e - s) / 1e3:.1f} ms at +{(s - t0) / 1e6:.2f} s"
                         f"{': ' + doing if doing else ''}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path)
    ap.add_argument("--top", type=int, default=5, help="longest idle gaps shown per GPU")
    args = ap.parse_args()
    print(summarize(json.loads(args.trace.read_text()), args.top))


if __name__ == "__main__":
    main()
