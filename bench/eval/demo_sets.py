"""Three prompt sets for `dflash-tui eval` on the demo target, written as JSONL:

- heldout.jsonl: slices of the help text the demo target never trained on (its own domain), as
  OpenAI messages;
- docstrings.jsonl: the first paragraph of stdlib module docstrings (English about
  Python, but not the help topics' text), as plain prompts;
- long.jsonl: a long-prompt set (--long-prompts, eval.prompt_sets[].long): held-out
  conversations whose answers run 64, 400 and 1400 characters in turn; read long, half of each
  answer joins the prompt, so the rounds start near 100, 300 and 800 tokens of context, in each
  of the demo target's buckets (0-128, 128-512, 512-1k: docs/eval.md, "Tau by context length").

    python bench/eval/demo_sets.py OUT_DIR [--n 32]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODULES = ["abc", "argparse", "base64", "bisect", "calendar", "collections", "colorsys",
           "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
           "enum", "fnmatch", "fractions", "functools", "getopt", "gettext", "glob", "gzip",
           "hashlib", "heapq", "hmac", "html", "inspect", "io", "ipaddress", "json", "locale",
           "logging", "lzma", "mimetypes", "numbers", "operator", "optparse", "pathlib",
           "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "selectors",
           "shelve", "shlex", "shutil", "signal", "socket", "statistics", "string", "struct",
           "subprocess", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace",
           "traceback", "typing", "uuid", "warnings", "weakref", "zipfile", "zlib"]


def docstring_prompts(n: int, chars: int = 96) -> list[dict]:
    out = []
    for name in MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            doc = (importlib.import_module(name).__doc__ or "").strip()
        first = " ".join(doc.split("\n\n")[0].split())
        if len(first) >= 40:
            out.append({"id": name, "prompt": first[:chars]})
        if len(out) == n:
            break
    return out


LONG_ANSWERS = (64, 400, 1400)  # characters, in turn


def long_conversations(n: int) -> list[dict]:
    from dflash_core.demo.chat import demo_conversations

    rows = []
    for k in range(n):
        (c,) = demo_conversations(1, answer_chars=LONG_ANSWERS[k % len(LONG_ANSWERS)],
                                  seed=100 + k)
        rows.append({**c, "id": f"long-{k}"})
    return rows


def main() -> None:
    from dflash_core.demo.chat import demo_conversations

    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=32)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    held = [{"id": c["id"], "messages": c["messages"][:1]}
            for c in demo_conversations(args.n, seed=7)]
    for name, rows in (("heldout", held), ("docstrings", docstring_prompts(args.n)),
                       ("long", long_conversations(args.n))):
        path = args.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{path}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
