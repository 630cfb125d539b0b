"""Stage ``eval``: ``dflash-tui eval`` of every finished run on both prompt sets, plain decoding of
the target in the same process, into ``<dir>/eval`` (the verb continues an interrupted
evaluation itself); then the recipe's table, ``<dir>/recipe.md`` and ``recipe.json`` (runs of a
scale's run_sets: ``eval-vTAG/``, ``recipe-vTAG.md``):

- per set and objective, over the seeds (mean ± sample sd): tau, accepted drafts per round
  (tau - 1), accepted@1, the speedup over plain decoding, the lossless check, the training
  seconds and steps;
- tau by context length: every verification round counted in the bucket of its context (the
  prompt's tokens, plus the tokens decoded before the round), pooled per run, then over seeds.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.lab.data_stage import set_paths
from bench.lab.errors import LabError
from bench.lab.proc import dflash_tui, last_line
from bench.lab.recipe import (
    BLOCKS, TIMING, blocks, plan, run_row, run_status, variant_changes, variant_tag,
)
from bench.lab.scales import Scale

def context_edges(scale: Scale) -> tuple[int, ...]:
    """Buckets of context length: the sets' buckets, the last one open to the target's
    positions (a round's context grows past its prompt)."""
    return tuple(scale.set_buckets[:-1]) + (scale.max_position_embeddings + 1,)


def rounds_by_context(prompt_tokens: int, acceptance: list[int]) -> list[tuple[int, int]]:
    """(context length at the round's start, tokens the round gave) per round; the first new
    token came with the prefill."""
    out, ctx = [], prompt_tokens + 1
    for a in acceptance:
        out.append((ctx, a + 1))
        ctx += a + 1
    return out


def tau_by_context(lines: list[dict], edges: tuple[int, ...]) -> list[float | None]:
    """Pooled tau per bucket [edges[k], edges[k+1]) (None where no round fell)."""
    gained = [0] * (len(edges) - 1)
    rounds = [0] * (len(edges) - 1)
    for line in lines:
        for ctx, got in rounds_by_context(int(line["prompt_tokens"]), line["acceptance"]):
            for k in range(len(edges) - 1):
                if edges[k] <= ctx < edges[k + 1]:
                    gained[k] += got
                    rounds[k] += 1
    return [g / r if r else None for g, r in zip(gained, rounds)]


def read_prompt_lines(path: Path) -> list[dict]:
    return [x for x in (json.loads(t) for t in path.read_text(encoding="utf-8").splitlines()
                        if t.strip()) if x.get("kind") == "prompt"]


def eval_dir(root: Path, scale: Scale) -> Path:
    """``eval/`` for the default runs, ``eval-vTAG/`` for those of a scale's run_sets."""
    return root / f"eval{variant_tag(scale)}"


def run_eval(root: Path, scale: Scale, device: str, runs: list[Path], log=print) -> int:
    args = ["eval", "--target", str(root / "target"), "--max-new-tokens",
            str(scale.eval_new_tokens), "--batch", str(scale.eval_batch), "--out",
            str(eval_dir(root, scale)), "--device", device]
    for run in runs:
        args += ["--drafter", str(run)]
    for name, path in set_paths(root).items():
        args += ["--prompts", f"{name}={path}"]
    log(f"eval: {len(runs)} drafters, sets {', '.join(set_paths(root))}")
    log_file = root / "eval.log"
    rc = dflash_tui(args, log_file)
    if rc not in (0, 1):  # 1: the lossless check failed, which the table says
        raise LabError(f"dflash-tui eval ended with exit {rc}: {last_line(log_file)}",
                       hint=f"see {log_file}; the same command continues")
    return rc


def _fmt(values: list[float], digits: int = 2) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    return f"{statistics.mean(vals):.{digits}f} ± {statistics.stdev(vals):.{digits}f}"


def summarise(root: Path, scale: Scale, rows: list[dict]) -> dict:
    """The recipe's figures from results.json and the per-prompt results files."""
    from dflash_core.eval.drafters import file_name

    out_dir = eval_dir(root, scale)
    res = json.loads((out_dir / "results.json").read_text(encoding="utf-8"))
    by_run = {Path(info["run"]).name: label for label, info in res["drafters"].items()
              if info.get("run")}
    edges = context_edges(scale)
    out: dict = {"sets": {}, "edges": list(edges)}
    for set_name, s in res["sets"].items():
        per_run = []
        for row in rows:
            label = by_run.get(row["name"])
            if label is None or label not in s["drafters"]:
                continue
            d = s["drafters"][label]
            lines = read_prompt_lines(out_dir / set_name / file_name(label))
            per_run.append({
                **{k: row[k] for k in ("name", "objective", "block_size", "seed", "steps",
                                       "train_s")},
                "label": label, "tau": d["tau"], "tau_per_prompt": d["tau_per_prompt"],
                "accepted_per_round": d["accept_length_without_bonus"],
                "accepted_at_1": d["accepted_at"].get("1"), "speedup": d.get("speedup"),
                "tokens_per_s": d["tokens_per_s"], "mismatches": len(d.get("mismatches") or []),
                "tau_by_context": tau_by_context(lines, edges)})
        plain_lines = read_prompt_lines(out_dir / set_name / "plain.jsonl")
        out["sets"][set_name] = {
            "prompts": s["prompts"], "plain_tokens_per_s": s["plain"]["tokens_per_s"],
            "prompt_tokens": sorted(int(x["prompt_tokens"]) for x in plain_lines),
            "runs": per_run}
    return out


def table(summary: dict, record: dict, scale: Scale) -> str:
    edges = summary["edges"]
    heads = [f"{edges[k]}-{edges[k + 1] - 1}" for k in range(len(edges) - 1)]
    lines = [f"Lab chain, scale {scale.name}: target {record['parameters'] / 1e6:.1f}M "
             f"parameters, held-out loss {record['heldout_loss']} nats/token "
             f"(train {record['final_train_loss']}), {record['tokens_trained']:,} tokens "
             f"trained in {record['train_seconds']} s on {record['device']}.", "",
             f"Each objective's steps fill {scale.train_seconds:g} s of its step time measured "
             f"alone; runs trained {scale.parallel_runs} at a time on the one device, so "
             "'train s' (wall clock) counts the sharing.", ""]
    changes = variant_changes(scale)
    if changes:
        lines += ["Changed from the scale's runs: " + "; ".join(
            f"{k} {','.join(map(str, v)) if isinstance(v, tuple) else v}"
            for k, v in changes.items()) + ".", ""]
    for set_name, s in summary["sets"].items():
        pt = s["prompt_tokens"]
        lines += [f"Set {set_name}: {s['prompts']} prompts of {pt[0]}-{pt[-1]} tokens "
                  f"(median {pt[len(pt) // 2]}), {scale.eval_new_tokens} new tokens; plain "
                  f"decoding {s['plain_tokens_per_s']:.1f} tokens/s.", "",
                  "| objective (B) | seeds | steps | train s | tau | accepted / round | "
                  "accepted@1 | speedup | lossless |", "|---" * 9 + "|"]
        for objective in BLOCKS:
            mine = [r for r in s["runs"] if r["objective"] == objective]
            if not mine:
                continue
            pick = lambda k: [r[k] for r in mine]  # noqa: E731
            bad = sum(pick("mismatches"))
            lines.append(
                f"| {objective} ({mine[0]['block_size']}) | "
                f"{','.join(str(r['seed']) for r in mine)} | "
                f"{','.join(str(r['steps']) for r in mine)} | {_fmt(pick('train_s'), 1)} | "
                f"{_fmt(pick('tau'))} | {_fmt(pick('accepted_per_round'))} | "
                f"{_fmt([100 * v for v in pick('accepted_at_1') if v is not None], 1)}% | "
                f"{_fmt(pick('speedup'))}x | "
                f"{'exact' if bad == 0 else f'{bad} prompts differ'} |")
        lines += ["", f"Tau by context length (tokens) on {set_name}:", "",
                  "| objective | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
        for objective in BLOCKS:
            mine = [r for r in s["runs"] if r["objective"] == objective]
            if mine:
                cells = [_fmt([r["tau_by_context"][k] for r in mine]) for k in range(len(heads))]
                lines.append(f"| {objective} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def ensure_eval(root: Path, scale: Scale, device: str, record: dict, log=print) -> dict:
    path = root / "train" / TIMING
    times = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if not {o + variant_tag(scale) for o in blocks(scale)} <= set(times):
        raise LabError("the train stage has not timed both objectives yet",
                       hint="run --stage train first")
    runs = plan(scale, times)
    missing = [r.name for r in runs if run_status(root / "train" / "runs" / r.name) != "finished"]
    if missing:
        raise LabError(f"the train stage is not finished: {len(missing)} of {len(runs)} runs "
                       f"left ({', '.join(missing)})", hint="run --stage train again")
    rows = [run_row(root / "train" / "runs" / r.name, r) for r in runs]
    rc = run_eval(root, scale, device, [Path(r["run_dir"]) for r in rows], log)
    summary = summarise(root, scale, rows)
    summary["eval_exit"] = rc
    summary["timing"] = times
    summary["runs"] = rows
    name = f"recipe{variant_tag(scale)}"
    (root / f"{name}.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    text = table(summary, record, scale)
    (root / f"{name}.md").write_text(text, encoding="utf-8")
    log(text)
    return summary
