"""The evaluation's two prompt sets, from the held-out files only (neither the target nor the
drafter saw them), written as ``dflash-tui eval`` reads them (``{"id", "prompt"}`` a line):

- ``code``: a file's first lines up to a line start: the target completes the code;
- ``docstrings``: a file up to and including the opening quotes of a docstring (of the module, a
  class or a function, found by ``ast``): the target writes the English about the code.

Each set's prompts are spread evenly over the context lengths of ``Scale.set_buckets`` (tokens:
[64, 128), [128, 256), ...), so tau can be read by context length; a bucket the held-out files
cannot fill stays short.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import numpy as np

from bench.lab.prefixes import Tokenized, draw_prefixes, token_count

_OPENING = re.compile(r"[rRbBuUfF]{0,2}(\"\"\"|'''|\"|')")


def _buckets(edges: tuple[int, ...]) -> list[tuple[int, int]]:
    return list(zip(edges, edges[1:]))


def _per_bucket(total: int, buckets: int) -> list[int]:
    return [total // buckets + (1 if k < total % buckets else 0) for k in range(buckets)]


def code_prompts(tk, docs: list[Tokenized], edges: tuple[int, ...], total: int,
                 seed: int) -> list[dict]:
    py = [d for d in docs if d.path.endswith((".py", ".pyi"))]
    out = []
    buckets = _buckets(edges)
    for (lo, hi), n in zip(buckets, _per_bucket(total, len(buckets))):
        rng = np.random.default_rng([seed, 60, lo])
        for d, prefix in draw_prefixes(tk, py, n, lo, hi, 16, rng):
            line = prefix.count("\n") + 1
            out.append({"id": f"{d.path}:{line}", "prompt": prefix})
    return out


def _offset(text: str, line_starts: list[int], lineno: int, col_bytes: int) -> int:
    """The character offset of ast's (lineno, col_offset): the column counts UTF-8 bytes."""
    start = 0 if lineno == 1 else line_starts[lineno - 2]
    line = text[start:start + 4 * col_bytes + 4]
    return start + len(line.encode("utf-8")[:col_bytes].decode("utf-8", "ignore"))


def docstring_openings(doc: Tokenized) -> list[tuple[int, str]]:
    """(line, prefix) for every docstring of the file: the text up to and including its
    opening quotes."""
    try:
        tree = ast.parse(doc.text)
    except (SyntaxError, ValueError):  # a file of another Python's grammar is left out
        return []
    out = []
    starts = doc.line_starts
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
            continue
        body = node.body
        if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            continue
        expr = body[0]
        at = _offset(doc.text, starts, expr.lineno, expr.col_offset)
        m = _OPENING.match(doc.text, at)
        if m:
            out.append((expr.lineno, doc.text[:m.end()]))
    return sorted(out)


def docstring_prompts(tk, docs: list[Tokenized], edges: tuple[int, ...], total: int,
                      seed: int) -> list[dict]:
    by_bucket: dict[int, list[dict]] = {}
    for d in docs:
        if not d.path.endswith(".py"):
            continue
        for line, prefix in docstring_openings(d):
            n = token_count(tk, prefix)
            for k, (lo, hi) in enumerate(_buckets(edges)):
                if lo <= n < hi:
                    by_bucket.setdefault(k, []).append({"id": f"{d.path}:{line}",
                                                        "prompt": prefix})
    out = []
    for k, n in enumerate(_per_bucket(total, len(edges) - 1)):
        pool = by_bucket.get(k, [])
        rng = np.random.default_rng([seed, 61, k])
        picks = rng.permutation(len(pool))[:n]
        out += [pool[int(i)] for i in sorted(picks)]
    return out


def write_set(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
