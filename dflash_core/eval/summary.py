"""What a set's results say: tau, accepted@k, rounds, tokens per second, the speedup over plain
decoding, and the lossless check.

- **tau**: tokens gained per target forward (verification round), accepted drafts plus the
  target's own token, pooled over every round of every prompt (the engine's exact tau).
  ``tau_per_prompt`` is the mean of the prompts' own taus, the public DFlash benchmark's figure;
  it usually runs above tau when the prompts' taus differ (a prompt with a high tau needs few
  rounds, so it weighs little in the pooled figure).
- **accepted@k**: of the rounds that proposed at least k drafts, the share that accepted at least
  k (k = 1 is the first draft's acceptance rate): vLLM's per-position acceptance rate, every
  position of it in ``acceptance_rate_per_position``; beside it serving's other counts
  (acceptance.serving_counts): accepted drafts per round without the bonus token (tau - 1) and
  the share of proposed drafts accepted.
- **tokens/s**: new tokens over decoding time, the prefill left out (the time to the first token
  is the target's alone), summed over the batches: each batch's time is shared by its prompts.
- **speedup**: tokens/s over plain decoding's on the same prompts, batches and target code.
- **context**: tau per bucket of the rounds' positions (context_buckets.py: the prompt's tokens and
  those generated before the round), from each prompt's length and acceptance per round.
- **lossless**: greedy only; every prompt's speculative tokens equal to plain decoding's.
- **tau_unary**: a DFlash2 drafter's tau with each slot's unary argmax in place of its
  selector's walk (the same prompts decoded again; the run's evaluation's ``tau unary argmax``):
  tau minus it is what the selector gains. None for the other families, and when a prompt's
  line predates it.
- **vllm_count**: greedy only; the same rounds counted as vLLM's counters count them
  (served_counts.VllmCounts: every round drafted the full count and its accepted drafts counted
  whole, the last round's too); None when a prompt's line predates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_core.eval.results import ResultsFile
from dflash_core.acceptance import histogram, pooled_tau, serving_counts
from dflash_core.served_counts import VllmCounts
from dflash_core.context_buckets import Buckets, by_context, round_positions


@dataclass
class Summary:
    prompts: int
    tokens: int
    rounds: int
    tau: float
    tau_per_prompt: float
    acceptance: list[int]  # histogram: rounds that accepted k drafts
    accepted_at: dict[int, float]  # k -> share (see the module)
    seconds: float  # decoding time, prefill left out
    prefill_seconds: float
    tokens_per_s: float
    speedup: float | None = None
    mismatches: list[dict] = field(default_factory=list)  # lossless check: prompt, position
    proposed: list[int] = field(default_factory=list)  # histogram: rounds that proposed j drafts
    # serving's counts, named as vLLM and SGLang name them (acceptance.SERVING)
    accept_length_without_bonus: float = 0.0
    acceptance_rate_per_position: list[float] = field(default_factory=list)
    draft_acceptance_rate: float = 0.0
    # tau per bucket of context length (context_buckets.py's record)
    context: list[dict] = field(default_factory=list)
    vllm_count: VllmCounts | None = None  # the rounds counted as vLLM counts them (greedy)
    tau_unary: float | None = None  # DFlash2: with each slot's unary argmax (see the module)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["accepted_at"] = {str(k): v for k, v in self.accepted_at.items()}
        d["vllm_count"] = self.vllm_count.record() if self.vllm_count else None
        return d


def vllm_count(rows: list[dict]) -> VllmCounts | None:
    """The prompts' rounds counted as vLLM's counters count them; None unless every prompt's
    line has them (a drafter's greedy line written since they are recorded)."""
    if not rows or not all("served_acceptance" in r for r in rows):
        return None
    total = VllmCounts(0, 0, 0, [])
    for r in rows:
        total = total + VllmCounts.of_rounds(r["served_acceptance"], int(r["served_drafts"]),
                                             r.get("served_proposed"))
    return total


def unary_tau(rows: list[dict]) -> float | None:
    """Pooled tau of the prompts' unary-argmax decodings (DFlash2's ``unary_acceptance``); None
    unless every prompt's line has one."""
    if not rows or not all("unary_acceptance" in r for r in rows):
        return None
    return pooled_tau(histogram([a for r in rows for a in r["unary_acceptance"]]))


def summarise(res: ResultsFile, indices: list[int] | None = None,
              buckets: Buckets | None = None) -> Summary:
    """The summary of ``res`` over the prompts ``indices`` (None: all done); ``buckets``: the
    target's context-length buckets (None: the defaults)."""
    rows = [res.prompts[i] for i in (indices if indices is not None else sorted(res.prompts))
            if i in res.prompts]
    counts = [v for r in rows for v in r["acceptance"] + r["proposed"]]
    size = 1 + max(counts) if counts else 0
    hist = histogram([a for r in rows for a in r["acceptance"]], size)
    proposed = histogram([p for r in rows for p in r["proposed"]], size)
    per_prompt = [sum(a + 1 for a in r["acceptance"]) / len(r["acceptance"])
                  for r in rows if r["acceptance"]]
    rounds = sum(hist)
    serving = serving_counts(hist, proposed)
    at = dict(enumerate(serving.acceptance_rate_per_position, start=1))
    wanted = {int(r["index"]) for r in rows}
    batches = [b for b in res.batches if wanted & set(b.prompts)]
    # a batch's time is its prompts' together: a share of it for each prompt asked about
    seconds = sum((b.seconds - b.prefill_seconds) * len(wanted & set(b.prompts)) / len(b.prompts)
                  for b in batches)
    prefill = sum(b.prefill_seconds * len(wanted & set(b.prompts)) / len(b.prompts)
                  for b in batches)
    tokens = sum(len(r["tokens"]) for r in rows)
    # the first token of each prompt came with the prefill
    decoded = tokens - sum(1 for r in rows if r["tokens"])
    return Summary(
        prompts=len(rows), tokens=tokens, rounds=rounds,
        tau=pooled_tau(hist),
        tau_per_prompt=sum(per_prompt) / len(per_prompt) if per_prompt else 0.0,
        acceptance=hist, accepted_at=at, seconds=seconds, prefill_seconds=prefill,
        proposed=proposed, **serving.fields(),
        context=by_context(buckets or Buckets.of(None),
                           ((round_positions(int(r["prompt_tokens"]), r["acceptance"]),
                             r["acceptance"]) for r in rows)),
        tokens_per_s=decoded / seconds if seconds > 0 else 0.0, vllm_count=vllm_count(rows),
        tau_unary=unary_tau(rows),
        mismatches=[{"index": int(r["index"]), "id": r["id"], **r["lossless"]}
                    for r in rows if r.get("lossless")])


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (one ending early counts), else None."""
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))
