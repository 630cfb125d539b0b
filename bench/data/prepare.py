"""Throughput of the data commands on the CPU: prepare (rows/s, tokens/s at 1 and N workers) and
regenerate against the demo server on 127.0.0.1 at several concurrencies.

    python3 bench/data/prepare.py [--rows 4000] [--regen-samples 48] [--max-tokens 32]

prepare runs on demo conversations (one turn, ~130 tokens) with the demo tokenizer, and on
multi-turn conversations (4 turns, reasoning on the last) with a byte-level BPE trained here and a
Qwen-style template. regenerate asks the demo target (one request generates at a time, as a single
small server would), so its figure is the client's overhead plus the server's generation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def multi_turn_rows(n: int) -> list[dict]:
    from tests.core.data.chat_fixtures import CORPUS

    rows = []
    for k in range(n):
        a, b, c, d = (CORPUS[(k + j) % 5] for j in range(4))
        rows.append({"id": f"m{k}", "messages": [
            {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": a},
            {"role": "assistant", "content": b}, {"role": "user", "content": c},
            {"role": "assistant", "content": d, "reasoning_content": a}]})
    return rows


def bench_prepare(tmp: Path, rows: int) -> list[dict]:
    from dflash_core.demo.chat import write_demo_conversations
    from dflash_core.data.prepare import PrepareOptions, prepare
    from tests.core.data.chat_fixtures import train_bpe

    demo_src = write_demo_conversations(tmp / "demo.jsonl", n=rows)
    multi_src = tmp / "multi.jsonl"
    multi_src.write_text("".join(json.dumps(r) + "\n" for r in multi_turn_rows(rows)))
    bpe = train_bpe(tmp / "bpe")
    out = []
    for name, src, tok in (("demo, 1 turn", demo_src, "builtin:tiny"),
                           ("BPE + Qwen-style, 2 assistant turns", multi_src, str(bpe))):
        for workers in (1, os.cpu_count() or 1):
            t0 = time.perf_counter()
            m = prepare(PrepareOptions(src, tmp / f"out-{len(out)}", tokenizer=tok,
                                       workers=workers, progress=False))
            dt = time.perf_counter() - t0
            out.append({"data": name, "workers": workers, "rows": m["counts"]["rows"],
                        "rows_s": m["counts"]["rows"] / dt, "tokens_s": m["tokens"]["tokens"] / dt,
                        "seconds": dt})
    return out


def bench_regenerate(tmp: Path, n: int, max_tokens: int) -> list[dict]:
    from dflash_core import demo
    from dflash_core.demo.chat import write_demo_conversations
    from dflash_core.demo.server import DemoServer
    from dflash_core.data.regen.options import RegenOptions
    from dflash_core.data.regen.regenerate import regenerate

    src = write_demo_conversations(tmp / "regen.jsonl", n=n)
    target = demo.ensure_tiny_target()
    out = []
    with DemoServer(target) as srv:
        for conc in (1, 4, 16):
            t0 = time.perf_counter()
            s = regenerate(RegenOptions(src, tmp / f"regen-{conc}", [srv.url], api="completions",
                                        tokenizer="builtin:tiny", concurrency=conc,
                                        max_tokens=max_tokens, progress=False))
            dt = time.perf_counter() - t0
            out.append({"concurrency": conc, "samples": s["counts"]["done_now"],
                        "samples_s": s["counts"]["done_now"] / dt,
                        "tokens_s": s["tokens"]["completion"] / dt, "seconds": dt})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--regen-samples", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print(f"cores: {os.cpu_count()}, load average at start: {os.getloadavg()[0]:.1f}")
        print("| data | workers | rows | rows/s | tokens/s |\n|---|---|---|---|---|")
        for r in bench_prepare(tmp, args.rows):
            print(f"| {r['data']} | {r['workers']} | {r['rows']} | {r['rows_s']:,.0f} | "
                  f"{r['tokens_s']:,.0f} |")
        print(f"\nregenerate, {args.regen_samples} samples x {args.max_tokens} tokens max:")
        print("| concurrency | samples/s | generated tokens/s |\n|---|---|---|")
        for r in bench_regenerate(tmp, args.regen_samples, args.max_tokens):
            print(f"| {r['concurrency']} | {r['samples_s']:.2f} | {r['tokens_s']:,.0f} |")
        print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
