"""The side-by-side table of one prompt set: the target alone and each drafter in a column."""

from __future__ import annotations

from dflash_core.context_buckets import shown
from dflash_core.eval.summary import Summary
from dflash_core.observe.device_hours import table_cells


def _ks(per_round: int) -> list[int]:
    """accepted@k rows shown: 1, 2, 4, ... and the last draft of a round."""
    ks, k = [], 1
    while k < per_round:
        ks.append(k)
        k *= 2
    return ks + [per_round] if per_round >= 1 else ks


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def lossless_cell(s: Summary, greedy: bool) -> str:
    if not greedy:
        return "n/a (sampled)"
    if not s.mismatches:
        return "exact"
    ties = sum(1 for m in s.mismatches if m.get("near_tie"))
    bad = [m for m in s.mismatches if not m.get("near_tie")]
    if not bad:
        return f"{ties} near tie{'s' if ties > 1 else ''}"
    m = bad[0]
    return (f"{len(bad)} differ (first: {m['id']} @{m['position']})"
            + (f", {ties} near ties" if ties else ""))


def context_rows(drafters: dict[str, Summary]) -> list[list[str]]:
    """'tau 1-4k' rows, a drafter's cell its tau there and its rounds ('2.31 (412)'): the
    buckets of context length any drafter has rounds in, when one of them has rounds in more
    than one (context_buckets.py); else none (the tau row says it)."""
    if not any(shown(d.context) for d in drafters.values()):
        return []
    names = [r["bucket"] for r in next(iter(drafters.values())).context]
    rows = []
    for j, name in enumerate(names):
        cells = [d.context[j] if j < len(d.context) else {} for d in drafters.values()]
        if any(c.get("rounds") for c in cells):
            rows.append([f"tau {name}", "-"] + [f"{c['tau']:.2f} ({c['rounds']})"
                                                if c.get("rounds") else "-" for c in cells])
    return rows


def served_rows(labels: list[str], served: dict) -> list[list[str]]:
    """The rows of ``eval --engine vllm`` (served.ServedSet per label): vLLM's own counters and
    wall time beside ours, and its lossless check; none without it."""
    if not served:
        return []
    cell = lambda x, f: f(served[x]) if x in served else "-"  # noqa: E731
    return [
        ["vLLM: tau (its counters)", "-"] + [
            cell(x, lambda v: f"{v.counts.mean_acceptance_length:.2f}") for x in labels],
        ["vLLM: steps = our rounds", "-"] + [
            cell(x, lambda v: f"{v.steps_equal}/{v.prompts} prompts") for x in labels],
        ["vLLM: drafts / accepted", "-"] + [
            cell(x, lambda v: f"{v.counts.drafts} / {v.counts.accepted}") for x in labels],
        ["vLLM: per position", "-"] + [
            cell(x, lambda v: " ".join(f"{r:.2f}" for r in v.counts.per_position))
            for x in labels],
        ["vLLM: tokens/s", f"{next(iter(served.values())).plain_tokens_per_s:.1f}"] + [
            cell(x, lambda v: f"{v.tokens_per_s:.1f}") for x in labels],
        ["vLLM: speedup", "1.00x"] + [cell(x, lambda v: f"{v.speedup:.2f}x" if v.speedup
                                           else "-") for x in labels],
        ["vLLM: lossless", "-"] + [cell(x, lambda v: v.lossless_cell()) for x in labels],
    ]


def set_table(name: str, prompts: int, plain: Summary, drafters: dict[str, Summary],
              per_round: dict[str, int], greedy: bool, hours: dict | None = None,
              served: dict | None = None) -> str:
    """``hours``: each drafter's device time (observe/device_hours.Figure, None when not
    known): the rows "GPU-hours" and "cost", "-" where not known. ``served``: label ->
    served.ServedSet (``eval --engine vllm``): the vLLM rows."""
    labels = list(drafters)
    ks = _ks(max(per_round.values(), default=0))
    head = ["", "plain"] + labels
    rows = [["tau"] + [f"{plain.tau:.2f}"] + [f"{drafters[x].tau:.2f}" for x in labels]]
    if any(drafters[x].tau_unary is not None for x in labels):
        # DFlash2: with each slot's unary argmax in place of the selector (the run's row too)
        rows.append(["tau unary argmax", "-"] + [
            f"{drafters[x].tau_unary:.2f}" if drafters[x].tau_unary is not None else "-"
            for x in labels])
    rows.append(["tau per prompt"] + ["-"] + [f"{drafters[x].tau_per_prompt:.2f}"
                                              for x in labels])
    rows += context_rows(drafters)
    for k in ks:
        rows.append([f"accepted@{k}", "-"] + [
            _pct(drafters[x].accepted_at.get(k)) if k <= per_round[x] else "-"
            for x in labels])
    # serving's counts, in vLLM's and SGLang's words (accepted@k: vLLM's per-position rate)
    rows += [
        ["accept length w/o bonus", "-"] + [f"{drafters[x].accept_length_without_bonus:.2f}"
                                            for x in labels],
        ["draft acceptance rate", "-"] + [_pct(drafters[x].draft_acceptance_rate)
                                          for x in labels],
    ]
    if any(drafters[x].vllm_count for x in labels):
        # the same rounds counted as vLLM's counters count them (docs/eval.md, The figures)
        rows.append(["tau, vLLM's count", "-"] + [
            f"{drafters[x].vllm_count.mean_acceptance_length:.2f}" if drafters[x].vllm_count
            else "-" for x in labels])
    rows += served_rows(labels, served or {})
    rows += [
        ["rounds", str(plain.rounds)] + [str(drafters[x].rounds) for x in labels],
        ["new tokens", str(plain.tokens)] + [str(drafters[x].tokens) for x in labels],
        ["tokens/s", f"{plain.tokens_per_s:.1f}"] + [f"{drafters[x].tokens_per_s:.1f}"
                                                     for x in labels],
        ["speedup", "1.00x"] + [f"{drafters[x].speedup:.2f}x" if drafters[x].speedup else "-"
                                for x in labels],
        ["lossless", "-"] + [lossless_cell(drafters[x], greedy) for x in labels],
    ]
    if hours is not None:
        cells = [table_cells(hours.get(x)) for x in labels]
        rows += [["GPU-hours", "-"] + [c[0] for c in cells], ["cost", "-"] + [c[1] for c in cells]]
    widths = [max(len(r[c]) for r in [head] + rows) for c in range(len(head))]
    fmt = lambda r: "  ".join(v.ljust(widths[0]) if c == 0 else v.rjust(widths[c])  # noqa: E731
                              for c, v in enumerate(r)).rstrip()
    done = "" if plain.prompts == prompts else f", {plain.prompts} done"
    return "\n".join([f"set {name} ({prompts} prompts{done})", fmt(head)]
                     + [fmt(r) for r in rows])
