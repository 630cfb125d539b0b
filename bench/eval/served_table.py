"""Ours against vLLM's from the results of `dflash-tui eval --engine vllm` (bench/BENCHMARKS.md,
"vLLM as the judge"): one markdown row per results folder, set and drafter.

    python bench/eval/served_table.py OUT [OUT ...]

tau (ours), our rounds counted as vLLM counts them, vLLM's counters' tau, the prompts whose vLLM
steps equal our rounds, lossless (vLLM's speculative output against its plain decoding and ours),
and the wall time of the decodings: ours (plain and the drafter, prefill included) and vLLM's
`generate` (plain and speculative; its engine's start-up apart).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(out: Path) -> list[str]:
    res = json.loads((out / "results.json").read_text(encoding="utf-8"))
    served = res["served"]
    dtype = served["engine"]["dtype"]
    lines = []
    for name, s in res["sets"].items():
        plain = s["plain"]
        ours_plain = plain["seconds"] + plain["prefill_seconds"]
        v_plain = served["plain"][name]
        for label, d in s["drafters"].items():
            v = served["sets"][name][label]
            lossless = ("exact" if not v["lossless_vs_vllm_plain"] else
                        f"{len(v['lossless_vs_vllm_plain'])} differ")
            if v["differs_from_our_plain"]:
                lossless += f", {len(v['differs_from_our_plain'])} differ from ours"
            lines.append(
                f"| {dtype} | {name} | {s['prompts']} | {d['tau']:.2f} | "
                f"{d['vllm_count']['mean_acceptance_length']:.2f} | "
                f"{v['counts']['mean_acceptance_length']:.2f} | "
                f"{v['prompts_whose_steps_equal_our_rounds']}/{v['prompts']} | {lossless} | "
                f"{ours_plain:.1f} / {d['seconds'] + d['prefill_seconds']:.1f} | "
                f"{v_plain['seconds']:.2f} / {v['seconds']:.2f} |")
    return lines


def main(argv: list[str]) -> int:
    print("| dtype | set | prompts | tau (ours) | ours counted as vLLM | vLLM's counters | "
          "steps equal | vLLM lossless | our wall s (plain / spec) | vLLM wall s (plain / spec) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for out in argv:
        print("\n".join(rows(Path(out))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
