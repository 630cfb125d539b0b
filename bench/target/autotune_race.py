"""Two threads start the first forward of a tiny Qwen3.5 hybrid (Gated DeltaNet) target at the
same moment, as two target workers (or the evaluation beside its target) do; on a GPU with Triton
and flash-linear-attention, those forwards tune the same autotuned kernels at once.

    python bench/target/autotune_race.py            # as transformers and Triton come: may fail
    python bench/target/autotune_race.py --guard    # with the engine's compile_guard.serialize_triton_autotuning
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import ROOT  # noqa: F401  (puts the project on sys.path)
from tests.gpu.test_targets_gpu import _hybrid


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--guard", action="store_true")
    args = ap.parse_args()
    if args.guard:
        from dflash_core.models.compile_guard import serialize_triton_autotuning
        print("guard applied:", serialize_triton_autotuning())
    models = [_hybrid(s) for s in (0, 1)]
    ids = torch.randint(0, 500, (2, 300), device="cuda")
    meet, errors = threading.Barrier(2), []

    def forward(k):
        meet.wait()
        try:
            with torch.inference_mode():
                models[k](input_ids=ids)
        except Exception as exc:  # noqa: BLE001 - what this script reports
            errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
    threads = [threading.Thread(target=forward, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    print("errors:", errors or "none")


if __name__ == "__main__":
    main()
