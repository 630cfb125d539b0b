"""``data inspect``: what a data folder holds, and (given the target) whether the target wrote it.

Reports the manifest (when there is one: what prepare cut, too), sample count, a token-length
histogram, the lengths of the prompts and the answers (percentiles and buckets: an answer is a run
of trained tokens, its prompt the untrained tokens since the answer before), the share of trained
tokens, the rows with nothing to train, a few samples decoded with the trained spans marked
``[[...]]``, and, given a target, the agreement of trained labels with the target's greedy next
token on a seeded sample of positions (the samples and positions depend on the seed alone: the
same folder gives the same figure every time): responses the target wrote itself agree at high
rates (the demo target: ~0.9), text written by someone else far less.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_core.data.conversations import Conversation, read_rows
from dflash_core.acceptance import data_cause
from dflash_core.data.cutting import describe as describe_cut
from dflash_core.data.manifest import read_manifest
from dflash_core.data.provenance import describe, of_manifest
from dflash_core.data.shards import DataError, ShardedDataset


def _holds_conversations(path: str | Path) -> bool:
    if Path(path).suffix in (".jsonl", ".json"):
        return True
    try:
        return isinstance(next(read_rows(path), None), Conversation)
    except DataError:
        return False


def length_histogram(lengths: np.ndarray, bins: int = 8) -> list[tuple[int, int, int]]:
    """(low, high, count) over powers of two from the shortest to the longest sample."""
    if lengths.size == 0:
        return []
    lo, hi = int(lengths.min()), int(lengths.max())
    edges = sorted({lo, *[2 ** k for k in range(1, 40) if lo < 2 ** k <= hi], hi + 1})
    if len(edges) - 1 > bins:  # too many: equal widths instead
        edges = sorted(set(np.linspace(lo, hi + 1, bins + 1).astype(int).tolist()))
    counts, _ = np.histogram(lengths, bins=edges)
    return [(edges[i], edges[i + 1] - 1, int(c)) for i, c in enumerate(counts)]


def turn_lengths(mask: np.ndarray) -> tuple[list[int], list[int]]:
    """(prompts, answers) of one sample, in tokens: each run of trained tokens is an answer, the
    untrained tokens before it since the answer before are its prompt (0: an answer from the
    first token). Untrained tokens after the last answer are no answer's prompt."""
    m = np.asarray(mask).astype(bool)
    edges = np.diff(np.concatenate([[False], m, [False]]).astype(np.int8))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    prompts = starts - np.concatenate([[0], ends[:-1]])
    return prompts.tolist(), (ends - starts).tolist()


PERCENTILES = (10, 50, 90, 99)


def distribution(values) -> dict:
    """Count, mean, percentiles, max and the buckets of ``values`` (token counts)."""
    a = np.asarray(values, np.int64)
    if a.size == 0:
        return {"count": 0}
    return {"count": int(a.size), "mean": round(float(a.mean()), 1),
            **{f"p{q}": int(round(float(np.percentile(a, q)))) for q in PERCENTILES},
            "max": int(a.max()), "histogram": length_histogram(a)}


def mark_trained(tok, ids: np.ndarray, mask: np.ndarray) -> str:
    """The sample as text, trained spans in [[...]]."""
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or mask[k] != mask[start]:
            text = tok.decode([int(t) for t in ids[start:k]])
            out.append(f"[[{text}]]" if mask[start] else text)
            start = k
    return "".join(out)


def _label_agreement(target_model, input_ids, loss_mask, max_positions: int = 512,
                     chunk: int = 32768, seed: int = 0) -> tuple[int, int]:
    """(agree, total) of trained labels equal to the target's greedy next token. Uses the
    engine's ``models.agreement.label_agreement`` when it is there; else this plain version
    (whole logits per sample: fine for inspect's few samples)."""
    try:
        from dflash_core.models.agreement import label_agreement
    except ImportError:
        label_agreement = None
    if label_agreement is not None:
        return label_agreement(target_model, input_ids, loss_mask, max_positions=max_positions,
                               chunk=chunk, seed=seed)
    import torch

    agree = total = 0
    with torch.no_grad():
        for ids, mask in zip(input_ids, loss_mask):
            pos = np.flatnonzero(np.asarray(mask)[1:]) + 1
            if pos.size == 0 or total >= max_positions:
                continue
            pos = pos[:max_positions - total]
            x = torch.as_tensor(np.asarray(ids[:pos[-1]]), dtype=torch.long)[None]
            pred = target_model(input_ids=x).logits[0].argmax(-1)
            labels = torch.as_tensor(np.asarray(ids)[pos], dtype=torch.long)
            agree += int((pred[pos - 1] == labels).sum())
            total += int(pos.size)
    return agree, total


def inspect(path: str | Path, *, samples: int = 2, tokenizer=None, target=None,
            agreement_samples: int = 16, max_positions: int = 512, seed: int = 0) -> dict:
    """A report (a dict, printed by the verb). ``tokenizer``: decodes the samples (None: ids are
    shown). ``target``: a loaded HF causal LM, for the agreement."""
    try:
        ds = ShardedDataset.open(path)
    except DataError as exc:
        if _holds_conversations(path):
            raise DataError("holds conversations, not prepared (tokenized) data", file=path,
                            hint=f"prepare it first: dflash-tui data prepare {path} --tokenizer "
                                 "TARGET --out DATA, then inspect DATA") from exc
        raise
    if len(ds) == 0:
        raise DataError("holds no samples", file=path, hint="prepare the data again")
    lengths = ds.lengths
    trained = np.zeros(len(ds), np.int64)
    prompts: list[int] = []
    answers: list[int] = []
    for i in range(len(ds)):
        mask = ds.get(i)[1]
        trained[i] = int(mask.sum())
        p, a = turn_lengths(mask)
        prompts += p
        answers += a
    rng = np.random.default_rng([seed, 27])
    show = sorted(rng.choice(len(ds), size=min(samples, len(ds)), replace=False).tolist())
    shown = []
    for i in show:
        ids, mask = ds.get(i)
        shown.append({"index": int(i), "tokens": int(len(ids)), "trained": int(mask.sum()),
                      "text": mark_trained(tokenizer, ids, mask) if tokenizer is not None
                      else " ".join(str(int(t)) for t in ids[:64])})
    report = {
        "path": str(path), "manifest": read_manifest(path) if Path(path).is_dir() else None,
        "samples": len(ds), "tokens": int(lengths.sum()), "trained_tokens": int(trained.sum()),
        "trained_share": round(float(trained.sum() / max(1, lengths.sum())), 4),
        "nothing_to_train": int((trained == 0).sum()),
        "histogram": length_histogram(lengths), "lengths": distribution(lengths),
        "prompts": distribution(prompts), "answers": distribution(answers), "shown": shown,
    }
    if target is not None:
        # A stream of its own: the samples measured depend on the seed alone, not on how many
        # samples are shown (the same folder and seed give the same figure every time).
        pick = sorted(np.random.default_rng([seed, 28]).choice(
            len(ds), size=min(agreement_samples, len(ds)), replace=False).tolist())
        rows = [ds.get(int(i)) for i in pick]
        agree, total = _label_agreement(target, [r[0] for r in rows], [r[1] for r in rows],
                                        max_positions=max_positions, seed=seed)
        report["agreement"] = {"agree": agree, "positions": total,
                               "share": round(agree / total, 4) if total else None,
                               "samples": len(rows), "seed": seed, "indices": pick}
    return report


def format_report(r: dict, agreement_warn: float = 0.8) -> str:
    """The report as text. ``agreement_warn``: below it the agreement is called low, with the
    likely cause from the data's provenance (the run's eval.agreement_warn; its default)."""
    lines = [f"{r['path']}: {r['samples']} samples, {r['tokens']} tokens, "
             f"{r['trained_tokens']} trained ({r['trained_share']:.1%})"]
    m = r.get("manifest")
    if m:
        c = m.get("counts", {})
        lines.append(f"prepared from {m['source']['path']} with {m['tokenizer']['name']} "
                     f"(tokenizer {m['fingerprints']['tokenizer']}, template "
                     f"{m['fingerprints']['chat_template']}); rows {c.get('rows')}, dropped "
                     f"{c.get('dropped') or 'none'}")
        lines.append(describe(of_manifest(m)))
        if describe_cut(c.get("cut") or {}):
            lines.append(describe_cut(c["cut"]))
    else:
        lines.append("no manifest (not made by data prepare)")
    lines.append(f"rows with nothing to train: {r['nothing_to_train']}")
    lines.append("token lengths:")
    peak = max((c for _, _, c in r["histogram"]), default=1) or 1
    for lo, hi, c in r["histogram"]:
        lines.append(f"  {lo:>7}-{hi:<7} {c:>8}  {'#' * round(40 * c / peak)}")
    lines += _length_table(r)
    if "agreement" in r:
        a = r["agreement"]
        share = "n/a" if a["share"] is None else f"{a['share']:.1%}"
        lines.append(f"agreement with the target's greedy next token: {share} of "
                     f"{a['positions']} trained positions in {a['samples']} samples (seed "
                     f"{a.get('seed', 0)})")
        if a["share"] is not None and a["share"] < agreement_warn:
            cause, fix = data_cause(of_manifest(m), a["share"], inspected=True)
            lines.append(f"  low (below {agreement_warn:.0%}): the likely cause: {cause}: {fix}")
    for s in r["shown"]:
        lines.append(f"--- sample {s['index']} ({s['tokens']} tokens, {s['trained']} trained)")
        lines.append(s["text"])
    return "\n".join(lines)


def _length_table(r: dict) -> list[str]:
    """Percentiles of the samples', prompts' and answers' lengths, then their buckets."""
    rows = [(name, r.get(key) or {"count": 0}) for name, key in
            (("samples", "lengths"), ("prompts", "prompts"), ("answers", "answers"))]
    head = "".join(f"{f'p{q}':>8}" for q in PERCENTILES)
    lines = [f"lengths in tokens{'':<8}{head}{'max':>8}{'mean':>9}"]
    for name, d in rows:
        label = f"  {name} ({d['count']})"
        if not d["count"]:
            lines.append(f"{label:<25}  none")
            continue
        cells = "".join(f"{d[f'p{q}']:>8}" for q in PERCENTILES)
        lines.append(f"{label:<25}{cells}{d['max']:>8}{d['mean']:>9}")
    for name, d in rows[1:]:
        if not d["count"]:
            continue
        lines.append(f"{name[:-1]} lengths:")
        peak = max((c for _, _, c in d["histogram"]), default=1) or 1
        for lo, hi, c in d["histogram"]:
            lines.append(f"  {lo:>7}-{hi:<7} {c:>8}  {'#' * round(40 * c / peak)}")
    return lines
