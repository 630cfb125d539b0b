"""What is wrong when a memorised drafter is not accepted: probes of the trained drafter, and the
rules that turn the evidence into a verdict with its fix.

The probes ask the trained drafter questions whose healthy answers are known exactly:
- **leak**: the training forward of a block with the whole sample as context must equal the same
  forward with the context cut just before the block's anchor (a block sees only the context
  before its anchor). A difference means training shows a block something serving never has.
- **train vs decode**: the training forward of a block (context cut before its anchor) and
  ``draft`` (what decoding calls) get the same features and the same anchor token: their
  proposals must be equal. A difference means decoding builds the block otherwise (the mask
  token, the positions).
- **features**: the features trained on must be the outputs of ``target.layer_ids`` as serving
  reads them (transformers' ``hidden_states[i + 1]``); for DSpark also the post-norm last hidden
  state sent with them (transformers' last ``hidden_states`` entry).
Decoding itself adds the acceptance per block slot, each proposal's correctness on its own, and
its correctness one position later or earlier (shifted labels). A DSpark drafter's own faults
(slot 0 not predicting, the Markov head fed the wrong token) come from
``models/dspark/probes.py``; its proposals here are the chain's, judged with the chain's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_core.check.decode import DecodeResult
from dflash_core.context_buckets import context_line

PASS_SHARE = 0.9  # exact tau must reach this share of its ceiling (near-full blocks)
REFERENCE_GAP = 0.05  # the reference's share may trail ours by at most this
LEAK_TOL = 1e-3  # relative difference of hidden states that is more than rounding
PROBE_ANCHORS = 8


@dataclass
class Probes:
    leak: float  # max relative difference, full context vs context cut before the anchor
    leak_changed: float  # share of the probed blocks whose proposals changed with it
    decode_differs: float  # share of probed blocks whose draft() proposal differs from training
    decode_gap: float  # max relative difference of draft()'s hidden states and training's
    # per layer id: relative difference of trained vs serving (hidden_states[i + 1]) features
    features: dict[int, float] | None = None
    anchors: list[int] = field(default_factory=list)
    # DSpark: relative difference of the trained post-norm last hidden state and transformers'
    last_hidden: float | None = None
    # DSpark: models/dspark/probes.DSparkProbes of the trained drafter (its own faults)
    dspark: object | None = None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


@torch.no_grad()
def probe(drafter, input_ids: torch.Tensor, features: torch.Tensor, prompt_len: int,
          length: int) -> Probes:
    """Probes on one trained sample (row 0 of the batch): ``PROBE_ANCHORS`` anchors spread over
    its response."""
    dev = next(drafter.parameters()).device
    B = drafter.block_size
    chain = drafter.anchor_predicts  # DSpark: every slot predicts
    ids = input_ids[:1, :length].to(dev)
    ctx = features[:1, :length].to(dev)
    last = length - 2  # an anchor needs a label after it
    span = max(1, last - prompt_len)
    anchors = sorted({prompt_len + (i * span) // PROBE_ANCHORS for i in range(PROBE_ANCHORS)})
    leak, changed, differs, gap = 0.0, 0, 0, 0.0
    seen: list[torch.Tensor] = []
    # draft() is what decoding calls; its hidden states are caught on the way out of forward.
    hook = drafter.register_forward_hook(lambda m, args, out: seen.append(out))
    try:
        for a in anchors:
            anc = torch.tensor([[a]], device=dev)
            blk, pos = drafter.block_inputs(ids, anc)
            emb = drafter.embed_tokens(blk).float()
            full = drafter(ctx, emb, pos, anc)
            cut = drafter(ctx[:, :a], emb, pos, anc)
            leak = max(leak, _rel(full, cut))
            if chain:
                # the Markov inputs of training: the anchor, then the tokens after it
                prev = ids[0, (a + torch.arange(B, device=dev)).clamp(max=length - 1)]
                p_full, p_cut = (_markov_preds(drafter, h, prev) for h in (full, cut))
            elif hasattr(drafter, "block_choice"):  # DFlash2: its selector's walk
                p_full, p_cut = (drafter.block_choice(h, int(ids[0, a])) for h in (full, cut))
            else:
                head = drafter.lm_head.weight
                p_full = (full[0, 1:].to(head.dtype) @ head.T).argmax(-1)
                p_cut = (cut[0, 1:].to(head.dtype) @ head.T).argmax(-1)
            changed += int(not torch.equal(p_full, p_cut))
            seen.clear()
            proposed = drafter.draft(ctx[:, :a], int(ids[0, a])).to(p_cut.device).reshape(-1)
            if chain:
                # what training gives with the chain's own tokens as the Markov inputs
                p_cut = _markov_preds(drafter, cut, torch.cat([ids[0, a: a + 1], proposed[:-1]]))
            differs += int(not torch.equal(proposed[: len(p_cut)], p_cut))
            if seen:
                gap = max(gap, _rel(seen[-1].reshape(cut.shape), cut))
    finally:
        hook.remove()
    n = len(anchors)
    return Probes(leak, changed / n, differs / n, gap, anchors=anchors)


def _markov_preds(drafter, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """A DSpark block's argmax per slot with ``prev`` [B] as the Markov inputs."""
    from dflash_core.models.dspark.loss import teacher_forced_preds

    return teacher_forced_preds(drafter, hidden, prev.reshape(1, 1, -1)).reshape(-1)


@torch.no_grad()
def feature_gap(target, input_ids: torch.Tensor, layer_ids: list[int], trained: torch.Tensor,
                length: int, last_hidden: bool = False) -> tuple[dict[int, float], float | None]:
    """Per layer id: relative difference of the trained features and transformers'
    ``hidden_states[i + 1]`` of the same tokens (what the reference and serving read); with
    ``last_hidden`` (DSpark: the trained features end with the post-norm last hidden state) also
    that state's against transformers' last ``hidden_states`` entry, else None."""
    with torch.inference_mode():
        out = target.model(input_ids=input_ids[:1, :length].to(target.device),
                           output_hidden_states=True, use_cache=False)
    H = trained.shape[-1] // (len(layer_ids) + int(last_hidden))
    got = trained[:1, :length].to(out.hidden_states[0].device)
    gaps = {i: _rel(got[..., k * H:(k + 1) * H], out.hidden_states[i + 1])
            for k, i in enumerate(layer_ids)}
    return gaps, (_rel(got[..., -H:], out.hidden_states[-1]) if last_hidden else None)


@dataclass
class Finding:
    what: str  # the diagnosis
    fix: str
    evidence: str


@dataclass
class Verdict:
    passed: bool
    findings: list[Finding]
    summary: str


def _slots(values: list[float]) -> str:
    return " ".join("-" if v != v else f"{v:.2f}" for v in values)


def evidence_lines(ours: DecodeResult, ref: DecodeResult | None, tau_tf: float,
                   ceiling_tf: float, probes: Probes) -> list[str]:
    lines = [f"teacher-forced tau on the trained samples {tau_tf:.2f} of {ceiling_tf:.2f}"]
    for d in (ours, ref):
        if d is None:
            continue
        lines.append(f"{d.name}: exact tau {d.tau:.2f} of {d.ceiling:.2f} "
                     f"({d.share:.0%} of full blocks)")
        lines.append(f"  accepted per drafted token 1..{d.drafts}: {_slots(d.accepted_at())}")
        lines.append(f"  right per slot (whatever came before): {_slots(d.correct_at())}")
        lines.append(f"  equal to the token one later:           {_slots(d.correct_at(1))}")
        ctx = context_line(d.by_context())  # '' unless more than one bucket has rounds
        if ctx:
            lines.append(f"  {ctx}")
        if d.diverged:
            lines.append(f"  decoding left the trained text at response tokens {d.diverged} "
                         "(target numerics); rounds after that are not counted")
    lines.append(f"probes at anchors {probes.anchors}: context at/after the anchor changes the "
                 f"training forward by {probes.leak:.1e} (proposals of {probes.leak_changed:.0%} "
                 f"of blocks); draft() differs from the training forward by {probes.decode_gap:.1e} "
                 f"(proposals of {probes.decode_differs:.0%} of blocks)")
    if probes.features is not None:
        gaps = ", ".join(f"{i}: {g:.1e}" for i, g in probes.features.items())
        lines.append(f"trained features vs transformers' hidden_states[i + 1], per layer id: "
                     f"{gaps}")
    if probes.last_hidden is not None:
        lines.append(f"trained post-norm last hidden state vs transformers' last hidden_states "
                     f"entry: {probes.last_hidden:.1e}")
    if probes.dspark is not None:
        lines.append(probes.dspark.describe())
    return lines


def _mean(v: list[float]) -> float:
    v = [x for x in v if x == x]
    return sum(v) / len(v) if v else 0.0


def diagnose(ours: DecodeResult, ref: DecodeResult | None, *, memorised: bool, tau_tf: float,
             ceiling_tf: float, probes: Probes, steps: int, trained_mask_id: int,
             reference_mask_id: int | None = None, target_layers: int = 0) -> Verdict:
    """The verdict: passed when the memorised drafter's exact tau (and the reference's) reach
    ``PASS_SHARE`` of full blocks; otherwise the findings, most specific first."""
    ev = "; ".join(evidence_lines(ours, ref, tau_tf, ceiling_tf, probes))
    found: list[Finding] = []
    if not memorised:
        found.append(Finding(
            f"the drafter did not memorise the samples in {steps} steps (teacher-forced tau "
            f"{tau_tf:.2f} of {ceiling_tf:.2f}), so the check cannot judge decoding",
            "raise --max-steps or optim.lr; a loss that does not fall at all points at the "
            "labels (loss mask) or the features", ev))
    ok_ours = ours.share >= PASS_SHARE
    ok_ref = ref is None or (ref.share >= PASS_SHARE and ref.share >= ours.share - REFERENCE_GAP)
    # The probes are exact: a leak or a decode that differs from training fails the check even
    # when these memorised samples are still accepted (memorising does not need the leak; a
    # drafter trained on real data learns to lean on it, and then serving cannot follow).
    dspark = probes.dspark.fault_fixes() if probes.dspark is not None else []
    last_off = probes.last_hidden is not None and probes.last_hidden > LEAK_TOL
    consistent = (probes.leak <= LEAK_TOL and probes.decode_gap <= LEAK_TOL
                  and not any(g > LEAK_TOL for g in (probes.features or {}).values())
                  and not dspark and not last_off)
    if memorised and ok_ours and ok_ref and consistent:
        return Verdict(True, [], "passed: the memorised drafter is accepted in near-full blocks"
                       + ("" if ref is None else f", by this engine and by {ref.name}")
                       + ", and training and decoding compute the same function")
    for what, fix in dspark:  # DSpark's own faults: the most specific evidence there is
        found.append(Finding(what, fix, ev))
    if last_off:
        found.append(Finding(
            "the target's post-norm last hidden state the drafter trained against is not "
            f"transformers' last hidden_states entry ({probes.last_hidden:.1e}): the target "
            "distribution of DSpark's loss is not the target's",
            "the features must end with the final norm's output (TargetModel.features with "
            "with_last_hidden=True)", ev))
    if probes.leak > LEAK_TOL:
        found.append(Finding(
            "a training-time leak: a block sees target features at or after its anchor in "
            "training, which decoding never has (the feature at the anchor already encodes the "
            "next token)",
            "the block attention must let block a see context positions < anchor_a only "
            "(block_attention.py: make_block_mask / chunked_block_attention)", ev))
    later, right = _mean(ours.correct_at(1)), _mean(ours.correct_at())
    earlier = _mean(ours.correct_at(-1))
    if memorised and not ok_ours and max(later, earlier) > max(0.5, 2 * right):
        way = "one position later" if later >= earlier else "one position earlier"
        found.append(Finding(
            f"labels shifted by one: the drafter proposes the token {way} than the target "
            f"writes there ({max(later, earlier):.0%} of proposals, {right:.0%} right)",
            "block slot k must be labelled with the token at anchor + k (objective.block_labels)"
            "; check that the data's input_ids and loss_mask are aligned (no next-token shift "
            "of labels or mask, the chat template's response start)", ev))
    if probes.decode_gap > LEAK_TOL:
        acc = ours.accepted_at()
        first_only = acc and acc[0] >= PASS_SHARE and _mean(acc[1:]) < 0.5
        found.append(Finding(
            "decoding builds the block differently from training: on the same features and "
            f"anchor token, draft() computes other hidden states ({probes.decode_gap:.1e}) than "
            "the training forward, i.e. another mask token or other block positions"
            + (" (slot 1 accepted, later slots not: the mask token)" if first_only else ""),
            f"decode with the mask token trained with (drafter.mask_token_id, {trained_mask_id}; "
            "config.json dflash_config.mask_token_id) and block positions anchor..anchor+B-1", ev))
    off = {i: g for i, g in (probes.features or {}).items() if g > LEAK_TOL}
    if off:
        last = target_layers - 1
        why = (f"layer {last} is the target's last layer: transformers returns it after the "
               f"final norm (hidden_states[{last + 1}]), which the reference reads, and the "
               "features trained on are not that"
               if last in off else "the features trained on are not those layers' outputs as "
               "the reference reads them (hidden_states[i + 1]), e.g. off by one")
        found.append(Finding(
            f"target.layer_ids {sorted(off)}: {why}",
            "the feature of layer i must be HF's hidden_states[i + 1], the last layer's after "
            "the final norm (TargetModel.features in models/target/model.py)", ev))
    if ref is not None and not ok_ref and ok_ours and not off:
        if False:
            pass
        elif reference_mask_id is not None and reference_mask_id != trained_mask_id:
            found.append(Finding(
                f"the checkpoint's mask token {reference_mask_id} is not the one trained with "
                f"({trained_mask_id})", "fix dflash_config.mask_token_id in config.json", ev))
        else:
            found.append(Finding(
                f"{ref.name} decodes the saved checkpoint worse than this engine: the "
                "interchange format (config.json, weights) and the drafter disagree",
                "compare drafter.py with the reference's DFlashDraftModel (norms, positions, "
                "attention)", ev))
    if not found:
        acc = ours.accepted_at()
        found.append(Finding(
            "the memorised drafter is not accepted in near-full blocks, and no probe names a "
            "cause" + (" (slot 1 accepted, later slots not: look at the mask token)"
                       if acc and acc[0] >= PASS_SHARE and _mean(acc[1:]) < 0.5 else ""),
            "compare the features (target.layer_ids), drafter.mask_token_id and the labels "
            "between training and serving", ev))
    return Verdict(False, found, "failed: " + found[0].what)
