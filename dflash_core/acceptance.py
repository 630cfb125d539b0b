"""What an evaluation measures of acceptance, what each gap between the measures means, and the
words every view uses for them (docs/algorithm.md, Acceptance): the one place for the rules.

Four taus, all on blocks of the drafter's size, at each evaluation:

- (a) ``exact``: exact speculative decoding of the held-out prompts (what serving gets);
- (b) ``target``: teacher-forced on the target's own greedy continuation of those prompts (the
  very text (a) verified), the drafter pass being training's own, with a block at each anchor
  decoding used (where a round began): there it scores what the round accepted, unless
  training's drafter sees what decoding's does not. (Averaged over every position instead, it
  runs well above (a): decoding's rounds begin where the last draft failed, the hard places;
  measured on the healthy demo, +0.9 to +1.8 at step 100. That, not memorisation, is why the
  old alarm, teacher-forced tau of training against exact, fired on a healthy run.) The mean
  over every position, ``tau_tf_target_all``, is what (c) is compared with;
- (c) ``heldout``: teacher-forced on held-out samples of the training data (never trained on),
  labels the data's tokens;
- (d) ``train``: teacher-forced on the training batches, a mean over the recent steps.

And the data/target agreement (agreement.py): the share of trained labels that equal the target's
greedy next token, measured once, at the first evaluation.

The gaps, each with its own meaning and message:

- (b) - (a) > ``eval.tau_gap_warn``: training and decoding disagree (a leak across blocks, a
  position or mask error): the only mismatch alarm. (a) and (b) score the same text with the same
  weights, so only what the drafter sees differs.
- agreement < ``eval.agreement_warn``: the data is not the target's own text; the likely cause
  and its fix follow where the responses came from (``data_cause``, from the prepared data's
  provenance): written by another model (regenerate them with the target), regenerated as text
  (the text round trip: a server that returns token ids), or with token ids (another cause).
  The agreement measures that directly, so it settles it: when it was measured and is above the
  threshold, a gap |(b, every position) - (c)| raises nothing (the labels are the target's; such
  a gap came from evaluation prompts of another kind than the data, e.g. cut inside a turn).
  Only when the agreement was not measured does a gap past ``eval.data_gap_warn`` raise the data
  finding, worded as a suspicion with the way to measure it.
- (d) - (c) > ``eval.overfit_gap``: over-fitting (too few samples for the epochs); information.

And exact decoding's rounds counted as the serving stacks count them (``serving_counts``), beside
tau, which is vLLM's "mean acceptance length" and SGLang's ``spec_accept_length`` (both with the
bonus token): accepted drafts per round without the bonus (tau - 1), the acceptance rate per draft
position (vLLM's per-position acceptance rate) and the share of proposed drafts accepted (vLLM's
draft acceptance rate, SGLang's ``spec_accept_rate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# command named by the data message (built as the "data regenerate" verb)
REGENERATE_COMMAND = "dflash-tui data regenerate"


@dataclass(frozen=True)
class Measure:
    key: str  # EvalResult field
    label: str  # the words on the dashboard, in train.log, in the report
    wandb: str  # W&B key
    meaning: str  # one line for the report and the docs


MEASURES = (
    Measure("tau", "tau exact", "eval/tau",
            "(a) exact speculative decoding of the held-out prompts"),
    Measure("tau_tf_target", "tf target", "eval/tau_tf_target",
            "(b) teacher-forced on the target's own decoding of those prompts"),
    Measure("tau_tf_heldout", "tf held-out", "eval/tau_tf_heldout",
            "(c) teacher-forced on held-out samples of the training data"),
    Measure("tau_tf_train", "tf train", "eval/tau_tf_train",
            "(d) teacher-forced in training, mean over the recent steps"),
)
# DFlash2: (a) with each slot's unary argmax instead of its selector (EvalResult.tau_unary)
UNARY = Measure("tau_unary", "tau unary argmax", "eval/tau_unary",
                "(a) with each slot's unary argmax in place of DFlash2's selector walk: tau "
                "exact minus it is what the selector gains")
AGREEMENT = Measure("agreement", "labels = target", "eval/agreement",
                    "share of trained labels equal to the target's greedy next token")
ACCEPTED = Measure("accepted", "accepted@k", "eval/accepted_at",
                   "share of exact-decoding rounds that accepted block position k (1 ..)")
MISSING = -1.0  # the value of a measure not taken (an EvalResult of an older run, no data)
# Serving's counts (``serving_counts``), named as vLLM and SGLang name them; the key is the
# EvalResult's and results.json's field.
WITHOUT_BONUS = Measure(
    "accept_length_without_bonus", "accept length w/o bonus", "eval/accept_length_without_bonus",
    "accepted drafts per round, the bonus token left out: tau - 1 (vLLM: num_accepted_tokens / "
    "num_drafts; SGLang: spec_num_correct_drafts / spec_verify_ct)")
PER_POSITION = Measure(
    "acceptance_rate_per_position", "per-position acceptance rate",
    "eval/acceptance_rate_per_position",
    "per draft position k = 1 ..: rounds whose draft k was accepted / rounds that proposed a "
    "draft k (vLLM's per-position acceptance rate, num_accepted_tokens_per_pos / num_drafts)")
DRAFT_RATE = Measure(
    "draft_acceptance_rate", "draft acceptance rate", "eval/draft_acceptance_rate",
    "accepted drafts / proposed drafts (vLLM's draft acceptance rate, SGLang's spec_accept_rate)")
SERVING = (WITHOUT_BONUS, PER_POSITION, DRAFT_RATE)


@dataclass(frozen=True)
class Finding:
    kind: str  # "mismatch" | "data" | "overfit"
    level: str  # "warning" | "info": the Log level it is published with
    message: str


def pooled_tau(hist: Sequence[int]) -> float:
    """Tokens gained per round over all rounds of all prompts, from the histogram of drafts
    accepted per round (hist[k]: rounds that accepted k); 0 without a round."""
    rounds = sum(hist)
    return sum((k + 1) * n for k, n in enumerate(hist)) / rounds if rounds else 0.0


def accepted_at(histogram: Sequence[int]) -> list[float]:
    """Per block position k = 1..B-1: the share of rounds that accepted k or more drafted tokens
    (``histogram[j]`` = rounds that accepted exactly j)."""
    rounds = sum(histogram)
    if not rounds:
        return []
    return [sum(histogram[k:]) / rounds for k in range(1, len(histogram))]


@dataclass(frozen=True)
class ServingCounts:
    """Exact decoding's rounds in the serving stacks' terms (SERVING names each)."""

    rounds: int  # verification rounds (vLLM's num_drafts, SGLang's spec_verify_ct)
    accepted: int  # drafts accepted, all rounds (vLLM's num_accepted_tokens)
    proposed: int  # drafts proposed, all rounds (vLLM's num_draft_tokens)
    tau: float  # with the bonus: vLLM's mean acceptance length, SGLang's spec_accept_length
    accept_length_without_bonus: float  # tau - 1
    acceptance_rate_per_position: list[float]  # [k - 1]: position k's rate
    draft_acceptance_rate: float

    def fields(self) -> dict:
        """The EvalResult's and results.json's fields (SERVING's keys)."""
        return {m.key: getattr(self, m.key) for m in SERVING}


def serving_counts(hist: Sequence[int], proposed: Sequence[int] | None = None) -> ServingCounts:
    """Serving's counts from the histogram of drafts accepted per round (``hist[k]``: rounds
    that accepted k) and of drafts proposed per round (``proposed[j]``: rounds that proposed j;
    None: every round proposed len(hist) - 1, as a server always drafts its
    num_speculative_tokens). A round that accepted draft k had proposed it, so position k's rate
    is the rounds that accepted k or more over those that proposed k or more; positions no round
    proposed are left out."""
    rounds = sum(hist)
    if proposed is None or not any(proposed):
        proposed = [0] * max(0, len(hist) - 1) + [rounds]
    accepted = sum(k * n for k, n in enumerate(hist))
    drafted = sum(j * n for j, n in enumerate(proposed))
    rates = []
    for k in range(1, len(proposed)):
        reached = sum(proposed[k:])
        if not reached:
            break
        rates.append(sum(hist[k:]) / reached)
    return ServingCounts(rounds, accepted, drafted, pooled_tau(hist),
                         accepted / rounds if rounds else 0.0, rates,
                         accepted / drafted if drafted else 0.0)


def histogram(counts: Sequence[int], size: int = 0) -> list[int]:
    """``h[k]``: how many of ``counts`` equal k (at least ``size`` long)."""
    h = [0] * max(size, 1 + max(counts, default=-1))
    for c in counts:
        h[c] += 1
    return h


def serving_fields(hist: Sequence[int], proposed: Sequence[int]) -> dict:
    """An EvalResult's serving fields: the proposals' histogram and SERVING's counts."""
    return {"proposed": list(proposed), **serving_counts(hist, proposed).fields()}


def serving_of(ev) -> ServingCounts | None:
    """An EvalResult's serving counts; None for one recorded before it kept the drafts proposed
    per round (its lines and keys stay as they were)."""
    proposed = getattr(ev, "proposed", None)
    return serving_counts(ev.acceptance, proposed) if proposed else None


def serving_line(sc: ServingCounts) -> str:
    """'accept length w/o bonus 1.70 | per-position acceptance rate 0.81 0.63 | draft
    acceptance rate 0.45'."""
    rates = " ".join(f"{r:.2f}" for r in sc.acceptance_rate_per_position) or "-"
    return (f"{WITHOUT_BONUS.label} {sc.accept_length_without_bonus:.2f} | {PER_POSITION.label} "
            f"{rates} | {DRAFT_RATE.label} {sc.draft_acceptance_rate:.2f}")


def serving_wandb(sc: ServingCounts, prefix: str = "eval/") -> dict[str, float]:
    """W&B values: eval/accept_length_without_bonus, eval/draft_acceptance_rate,
    eval/acceptance_rate_per_position/<k> (k = 1 ..); a set's under eval/<set>/."""
    def key(m: Measure) -> str:
        return m.wandb.replace("eval/", prefix, 1)
    out = {key(WITHOUT_BONUS): sc.accept_length_without_bonus,
           key(DRAFT_RATE): sc.draft_acceptance_rate}
    out.update({f"{key(PER_POSITION)}/{k}": r
                for k, r in enumerate(sc.acceptance_rate_per_position, start=1)})
    return out


def serving_rows(sc: ServingCounts) -> list[list[str]]:
    """[label, value, meaning] rows for the run report's acceptance table."""
    return [[WITHOUT_BONUS.label, f"{sc.accept_length_without_bonus:.2f}", WITHOUT_BONUS.meaning],
            [PER_POSITION.label, " ".join(f"{r:.2f}" for r in sc.acceptance_rate_per_position)
             or "-", PER_POSITION.meaning],
            [DRAFT_RATE.label, f"{sc.draft_acceptance_rate:.2f}", DRAFT_RATE.meaning]]


def _have(x: float | None) -> bool:
    return x is not None and x >= 0


# What a text round trip changes of the target's tokens (data/round_trip.py has the measure)
ROUND_TRIP_CHANGES = ("a leading space the server stripped, merges that differ where the answer "
                      "meets the template's text, bytes the server decoded otherwise")
# Below this agreement the round trip is not all of it: it changes a few tokens per answer
# (measured: 0.77-0.80 on answers `transformers serve` stripped, 0.94 on the demo's), while
# answers another model wrote agree at 0.14-0.20 (a BPE target; the byte-level demo 0.67).
ROUND_TRIP_FLOOR = 0.5
# SGLang's OpenAI API returns text only (docs/data.md): not named here
TOKEN_ID_SERVERS = ("a server that returns the answers' token ids (vLLM >= 0.10 with "
                    "return_token_ids; regenerate's probe says whether a server does)")
INSPECT_COMMAND = "dflash-tui data inspect DATA --target TARGET"


def data_cause(provenance: dict | None, agreement: float | None = None, *,
               inspected: bool = False) -> tuple[str, str]:
    """(the likely cause, what helps) of labels that are not the target's, from where the data's
    responses came from: the prepared data's provenance (data/provenance.py; None: an older
    prepare, or data made otherwise, for which the cause is the usual one). ``agreement``: the
    share measured (None: not measured); ``inspected``: said by ``data inspect`` itself, which
    then does not point at itself."""
    p = provenance if isinstance(provenance, dict) else {}
    rec = p.get("regeneration") if isinstance(p.get("regeneration"), dict) else {}

    def count(d: dict, key: str) -> int:
        v = d.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0

    rows, regen = count(p, "rows"), count(p, "regenerated_rows")
    if not regen:
        return ("the responses were written by another model (or with another chat template)",
                f"regenerate them with the target ({REGENERATE_COMMAND})")
    models = p.get("models") if isinstance(p.get("models"), dict) else {}
    by = f" by {', '.join(repr(str(m)) for m in models)}" if models else ""
    if rows > regen:
        return (f"only {regen} of the {rows} rows were regenerated{by}; the others' responses "
                "were written by another model",
                f"regenerate every row of the source with the target ({REGENERATE_COMMAND})")
    temp = rec.get("temperature")
    sampled = (f"; they were sampled at temperature {temp:g}, and sampled tokens are not all "
               "the target's greedy ones (regenerate with --temperature 0)"
               if isinstance(temp, (int, float)) and temp > 0 else "")
    other = ("the server may run other weights under that name, or the data was prepared with "
             "another chat template than the one the server applied")
    measure = "" if inspected else f"; {INSPECT_COMMAND} shows the samples and measures it"
    text, ids = count(p, "answers_as_text"), count(p, "answers_as_token_ids")
    if text:
        via = (f" through {', '.join(str(u) for u in rec['endpoints'])}"
               if isinstance(rec.get("endpoints"), list) and rec["endpoints"] else "")
        cause = (f"the responses were regenerated{by}{via} already, but {text} of {text + ids} "
                 "answers came back as text only and prepare re-tokenized them: the text round "
                 f"trip can change the target's tokens ({ROUND_TRIP_CHANGES})")
        rt = rec.get("round_trip")
        if isinstance(rt, dict) and count(rt, "positions"):
            cause += (f"; regenerate's probe measured {rt.get('agree')} of {rt['positions']} "
                      f"returned tokens the target's own on sample {rt.get('sample')}")
            diff = rt.get("first_difference")
            if isinstance(diff, list) and len(diff) == 3:
                cause += (f" (at answer token {diff[0]} the text gives {diff[1]!r}, the target "
                          f"writes {diff[2]!r})")
        if agreement is not None and 0 <= agreement < ROUND_TRIP_FLOOR:
            cause += (f"; but a round trip changes a few tokens per answer, not "
                      f"{1 - agreement:.0%} of them: {other}")
        return (cause + sampled,
                f"regenerating through the same server changes nothing: use {TOKEN_ID_SERVERS}"
                + ("" if inspected else f", or measure the round trip on the prepared data "
                   f"({INSPECT_COMMAND})"))
    return (f"the responses were regenerated{by} with the server's token ids, so no text round "
            f"trip changed them: {other}{sampled}",
            f"check the server's model and template (data prepare --chat-template){measure}")


def findings(step: int, exact: float, target: float | None, heldout: float | None,
             train: float | None, agreement: float | None, eval_cfg,
             target_all: float | None = None, provenance: dict | None = None) -> list[Finding]:
    """The findings of one evaluation (at most one of each kind); ``eval_cfg``: config.EvalConfig.
    ``target``: (b) at decoding's anchors; ``target_all``: (b) at every position (what (c)
    measures on the data; default ``target``). A measure not taken (None or negative) takes part
    in no rule. ``provenance``: where the data's responses came from (the prepared data's
    manifest): the data finding names its likely cause (``data_cause``)."""
    target_all = target if target_all is None else target_all
    out: list[Finding] = []
    if _have(target) and target - exact > eval_cfg.tau_gap_warn:
        out.append(Finding("mismatch", "warning", (
            f"step {step}: training and decoding disagree: exact tau {exact:.2f} is "
            f"{target - exact:.2f} below the teacher-forced tau on the same text {target:.2f} "
            f"(eval.tau_gap_warn {eval_cfg.tau_gap_warn:g}): in training the drafter sees what "
            "decoding does not show it (a leak across blocks, a position or mask error); check "
            "drafter.mask_token_id, target.layer_ids and the block attention mask")))
    gap = (_have(target_all) and _have(heldout)
           and abs(target_all - heldout) > eval_cfg.data_gap_warn)
    gap_words = (f"teacher-forced tau on held-out data {heldout:.2f} against {target_all:.2f} "
                 f"on the target's own text (eval.data_gap_warn {eval_cfg.data_gap_warn:g})"
                 if gap else "")
    if _have(agreement) and agreement < eval_cfg.agreement_warn:
        why = [f"only {agreement:.0%} of the trained labels are the target's greedy next token "
               f"(eval.agreement_warn {eval_cfg.agreement_warn:.0%})"] + [gap_words] * gap
        cause, fix = data_cause(provenance, agreement)
        out.append(Finding("data", "warning", (
            f"step {step}: the data is not the target's own text: " + "; ".join(why) + ". "
            f"{cause[0].upper()}{cause[1:]}: {fix}")))
    elif gap and not _have(agreement):
        # The agreement, which would settle it, was not measured: a suspicion, and how to check.
        cause, fix = data_cause(provenance)
        out.append(Finding("data", "warning", (
            f"step {step}: the data may not be the target's own text: {gap_words}. Measure "
            "the share of trained labels that are the target's greedy next token (eval."
            f"agreement_samples > 0, or {INSPECT_COMMAND}); if it is low, the likely cause: "
            f"{cause}: {fix}")))
    if _have(train) and _have(heldout) and train - heldout > eval_cfg.overfit_gap:
        out.append(Finding("overfit", "info", (
            f"step {step}: over-fitting: teacher-forced tau in training {train:.2f} is "
            f"{train - heldout:.2f} above held-out data {heldout:.2f} (eval.overfit_gap "
            f"{eval_cfg.overfit_gap:g}): the drafter memorises its samples; more data or fewer "
            "optim.epochs")))
    return out


def _fmt(x: float | None) -> str:
    return f"{x:.2f}" if _have(x) else "-"


def evaluated_on(ev) -> str:
    """What an EvalResult decoded: '8 prompts' (held-out), 'set gsm8k, 16 prompts' (a set of
    eval.prompt_sets)."""
    name = getattr(ev, "prompt_set", "")
    return f"set {name}, {ev.prompts} prompts" if name else f"{ev.prompts} prompts"


def summary_fields(ev) -> list[tuple[str, str]]:
    """(label, value) of an EvalResult's measures, in MEASURES order, then the agreement: what
    the dashboard, train.log and the report show, in the same words. A prompt set's result has
    exact tau alone (the others are measured on held-out data only)."""
    measures = MEASURES[:1] if getattr(ev, "prompt_set", "") else MEASURES
    rows = [(m.label, _fmt(getattr(ev, m.key, None))) for m in measures]
    unary = getattr(ev, UNARY.key, MISSING)
    if _have(unary):
        rows.insert(1, (UNARY.label, _fmt(unary)))
    share = getattr(ev, "agreement", MISSING)
    if _have(share):
        rows.append((AGREEMENT.label, f"{share:.0%}"))
    return rows


def summary_line(ev) -> str:
    """One line: 'tau exact 2.70 | tf target 2.90 | ... | accepted@k 80% 61% ...'."""
    parts = [f"{label} {value}" for label, value in summary_fields(ev)]
    rates = accepted_at(ev.acceptance)
    if rates:
        parts.append(f"{ACCEPTED.label} " + " ".join(f"{r:.0%}" for r in rates))
    return " | ".join(parts)


def set_wandb(ev) -> dict:
    """W&B of a prompt set's EvalResult, the held-out keys under the set's name:
    eval/<set>/tau, eval/<set>/accepted_at_<k> (k = 1 ..), eval/<set>/prompts."""
    def key(held_out: str) -> str:
        return held_out.replace("eval/", f"eval/{ev.prompt_set}/", 1)
    data = {key("eval/prompts"): ev.prompts, key(MEASURES[0].wandb): ev.tau}
    data.update({f"{key(ACCEPTED.wandb)}_{k}": r
                 for k, r in enumerate(accepted_at(ev.acceptance), start=1)})
    sc = serving_of(ev)
    if sc is not None:
        data.update(serving_wandb(sc, f"eval/{ev.prompt_set}/"))
    return data


def report_rows(ev) -> list[list[str]]:
    """[label, value, meaning] per measure of an EvalResult, then the agreement and the
    acceptance per block position, and the findings raised: the run report's acceptance table."""
    rows = [[m.label, _fmt(getattr(ev, m.key, None)), m.meaning] for m in MEASURES]
    every = getattr(ev, "tau_tf_target_all", MISSING)
    if _have(every):
        rows.insert(2, [f"{MEASURES[1].label} (every position)", _fmt(every),
                        "(b) with a block at every position, not only where rounds began"])
    share = getattr(ev, "agreement", MISSING)
    n = getattr(ev, "agreement_positions", 0)
    rows.append([AGREEMENT.label, f"{share:.1%} of {n}" if _have(share) and n else "-",
                 AGREEMENT.meaning])
    rates = accepted_at(ev.acceptance)
    rows.append([ACCEPTED.label, " ".join(f"{r:.0%}" for r in rates) or "-", ACCEPTED.meaning])
    sc = serving_of(ev)
    rows += serving_rows(sc) if sc is not None else []
    rows.append(["findings", ", ".join(getattr(ev, "findings", [])) or "none",
                 "mismatch, data, overfit: see the log's eval lines"])
    return rows


# -- DSpark: the confidence head's calibration and what a verifier using it would gain --------
# (models/dspark/calibration.Calibration; measured on the exact-decoding rounds of the evaluation)

CONFIDENCE = Measure("expected", "confidence@k", "eval/confidence_at",
                     "per draft slot k (0 ..): mean confidence where the slot was reached / "
                     "share of those accepted")
ECE = Measure("ece", "ECE", "eval/ece",
              "expected calibration error of the confidence head, all reached slots")
BUDGET = Measure("budgets", "tau@k", "eval/tau_budget",
                 "tau verifying k drafts per round: the first k / the k most likely to survive "
                 "(confidence-ordered, as an adaptive verifier)")


def calibration_fields(cal) -> list[tuple[str, str]]:
    """(label, value) of a Calibration: confidence vs acceptance per slot, ECE, tau per budget."""
    if not cal.rounds or not cal.expected:
        return []
    slots = " ".join(f"{e:.0%}/{o:.0%}" for e, o in zip(cal.expected, cal.observed))
    rows = [(CONFIDENCE.label, slots), (ECE.label, f"{cal.ece:.1%}")]
    rows += [(f"tau@{b.drafts}", f"{b.fixed:.2f}/{b.adaptive:.2f}") for b in cal.budgets]
    return rows


def calibration_line(cal) -> str:
    """One line: 'confidence@k 91%/88% 80%/71% ... | ECE 4.2% | tau@2 2.61/2.70 | ...'."""
    return " | ".join(f"{label} {value}" for label, value in calibration_fields(cal))


def calibration_rows(cal) -> list[list[str]]:
    """[label, value, meaning] rows for the run report's acceptance table."""
    meaning = {CONFIDENCE.label: CONFIDENCE.meaning, ECE.label: ECE.meaning}
    return [[label, value, meaning.get(label, BUDGET.meaning)]
            for label, value in calibration_fields(cal)]


def calibration_wandb(cal) -> dict[str, float]:
    """W&B values of a Calibration, under the keys of the measures above."""
    out: dict[str, float] = {}
    if not cal.rounds:
        return out
    for j, (e, o) in enumerate(zip(cal.expected, cal.observed)):
        out[f"{CONFIDENCE.wandb}/{j}"] = e
        out[f"eval/accepted_if_reached_at/{j}"] = o
    out[ECE.wandb] = cal.ece
    for b in cal.budgets:
        out[f"{BUDGET.wandb}/{b.drafts}/first"] = b.fixed
        out[f"{BUDGET.wandb}/{b.drafts}/adaptive"] = b.adaptive
    return out
