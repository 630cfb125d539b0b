"""`dflash-tui check` on each target class, tiny random-weight models on the CPU: the table of
docs/targets.md ("CPU check").

Each class is a model transformers builds from the class's own config
(tests/core/models/target/target_classes.py: CLASSES, the dense ones and TINY), saved to a
folder; the data is random token rows; the check runs
with its own defaults unless told (2 samples, 64 response tokens, 300 steps) and the drafter of
the objective asked (block 8, 2 layers, as the issue-59 matrix). One line per class: passed or
not, the memorise steps, the teacher-forced tau and the exact tau against their ceilings, the
seconds.

    OMP_NUM_THREADS=1 python3 bench/target/check_matrix.py --objective dspark
    OMP_NUM_THREADS=1 python3 bench/target/check_matrix.py --objective dflash --classes qwen3,llama
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.core.models.target.target_classes import CLASSES, build  # noqa: E402


REMOTE = "remote_code"  # Kimi-K2's kind of folder: the model exists only as its own *.py files
# Quantized checkpoints as their releases are laid out (dequantized on the CPU)
QUANTIZED = ("fp8", "mxfp4")
EXTRA = (REMOTE, *QUANTIZED)


def save_class(name: str, folder: Path) -> Path:
    from tests.core.models.target import test_target_classes as made

    if name == REMOTE:
        build("qwen3").save_pretrained(folder)
        return made.made_remote(folder)
    if name in QUANTIZED:
        folder.mkdir(parents=True)
        (made.fp8_checkpoint if name == "fp8" else made.mxfp4_checkpoint)(folder)
        return folder
    build(name).save_pretrained(folder)
    return folder


def layer_ids(folder: Path) -> list[int]:
    """[1, 2] as the tests' 4-layer classes; the first layer of a shallower one."""
    import json

    config = json.loads((folder / "config.json").read_text())
    layers = config.get("text_config", config)["num_hidden_layers"]
    return [1, 2] if layers >= 4 else [0]


def _sections(sets: list[str]) -> dict:
    """--set SECTION.KEY=VALUE pairs as config sections (YAML values); merged over the above
    section by section."""
    import yaml

    out: dict = {}
    for item in sets:
        key, _, value = item.partition("=")
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name] = yaml.safe_load(value)
    return out


def check_one(name: str, tmp: Path, data: Path, args) -> dict:
    from dflash_core.check.serve_check import CheckOptions, run_check
    from dflash_core.config.load import config_from_dict

    target = save_class(name, tmp / name)
    d = {
        "run": {"name": name, "output_dir": str(tmp / "runs"), "seed": 1},
        "target": {"path": str(target), "dtype": "float32", "layer_ids": layer_ids(target),
                   "trust_remote_code": name == REMOTE},
        "drafter": {"objective": args.objective, "num_layers": args.layers,
                    "block_size": args.block},
        "data": {"path": str(data), "token_budget": 512, "max_seqs_per_batch": 4,
                 "max_length": 160},
        "layout": {"device": "cpu", "targets": [0], "drafters": [0]},
    }
    for section, keys in _sections(args.set).items():
        d.setdefault(section, {}).update(keys)
    cfg = config_from_dict(d)
    opts = CheckOptions(samples=args.samples, response_tokens=args.response_tokens,
                        max_steps=args.max_steps, reference=args.reference)
    t0 = time.monotonic()
    lines: list[str] = []
    res = run_check(cfg, opts, say=lines.append)
    memo = next((m for m in lines if m.startswith("memorise: done")
                 or m.startswith("memorise: stopped")), "")
    exact = next((m.strip() for m in lines if "this engine: exact tau" in m), "")
    return {"class": name, "passed": res.verdict.passed, "memorise": memo, "exact": exact,
            "summary": res.verdict.summary.splitlines()[0][:160],
            "seconds": time.monotonic() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objective", default="dspark", choices=["dspark", "dflash"])
    p.add_argument("--classes", default=",".join([*CLASSES, *EXTRA]))
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--response-tokens", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--reference", action="store_true", help="decode DFlash with the reference too")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a config key for every class (e.g. optim.lr=1e-3), over the above")
    args = p.parse_args()
    from dflash_core.demo import quiet_hf, torch_threads
    from tests.core.engine_fixtures import make_data

    names = [n for n in args.classes.split(",") if n]
    unknown = [n for n in names if n not in CLASSES and n not in EXTRA]
    if unknown:
        p.error(f"unknown classes {unknown}: choose from {', '.join([*CLASSES, *EXTRA])}")
    failed = 0
    with tempfile.TemporaryDirectory() as t, torch_threads(1), quiet_hf():
        tmp = Path(t)
        data = make_data(tmp / "data", n=8)
        for name in names:
            r = check_one(name, tmp, data, args)
            failed += not r["passed"]
            print(f"{name:18s} {'pass' if r['passed'] else 'FAIL'}  {r['memorise']}; "
                  f"{r['exact']} ({r['seconds']:.0f} s)"
                  + ("" if r["passed"] else f"\n{'':20s}{r['summary']}"), flush=True)
    print(f"{len(names) - failed} of {len(names)} passed ({args.objective}, block {args.block}, "
          f"{args.layers} layers, {args.samples} samples x {args.response_tokens} tokens, "
          f"at most {args.max_steps} steps)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
