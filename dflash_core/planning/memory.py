"""Preflight memory plan: each device's peak, estimated from config dicts alone (no weights loaded).

The plan runs before tens of GB of weights are loaded, so a layout that cannot fit is refused with
a message naming the config key to change (the plan picks the key; memory_report.py words the
table and the message). Estimates are deliberately simple: each component is a
product of shapes and a small documented constant. They aim to be a little pessimistic, never a
large underestimate; "plan vs actual" once running shows how close they are.

Engine facts this plan models (they are decisions of target.py / drafter.py / engine.py):
- a target GPU holds the WHOLE target (layers after the last chosen one included) in
  ``target.dtype``, runs one ``data.token_budget``-token batch under inference_mode, stops after the
  last chosen layer and never computes lm_head logits; a mixture of experts holds every expert
  (its routed experts and router are their own row, "experts"), and a quantized checkpoint holds
  the bytes it is stored in where it runs as it is (FP8 block-wise on CUDA 8.9+, one weight
  dequantized at a time beside it; MXFP4 with triton kernels), else the bytes of the dtype it is
  dequantized to;
- a drafter GPU holds the drafter in fp32 with its optimizer (optim.name: AdamW's two moments
  per parameter, or Muon's one momentum per matrix entry) and the frozen borrowed embed_tokens /
  lm_head in the target dtype, receives a whole target batch of features, and runs forward +
  backward over groups of sequences of at most ``drafter.micro_block_tokens`` block tokens
  (trainer.py), under bf16 autocast on CUDA;
- queued feature batches stay on the target GPU that made them until a drafter takes them;
- drafter.recompute: each drafter layer recomputed in backward holds its input until then and
  one layer's activations at a time; "auto" is on when the drafter GPU does not fit without it;
- drafter.objective dspark: the target runs every layer and its final norm and sends its
  post-norm last hidden state with the k layer features (k+1 H-vectors per token in the features,
  the hs queue and the drafter's copy); the drafter adds the Markov and confidence heads (AdamW
  on float32 masters, under Muon too) and DSpark's loss chunk;
- on CPU both roles run in float32.

Sizes are bytes (units.GiB = 2**30).

The target's terms are in target_memory.py, the drafter's in drafter_memory.py; this module adds
them up per device with the CUDA margin, says which levers would shrink a device that does not
fit, and finds the sizes that do.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from dflash_core.config import Config, key_value, set_key_value
from dflash_core.levers import (
    FIT_LEVERS, HS_QUEUE, LOSS_CHUNK, MAX_LENGTH, MICRO_BLOCK_TOKENS, MIN_LOSS_CHUNK, NUM_ANCHORS,
    NUM_LAYERS, TOKEN_BUDGET, Lever,
)
from dflash_core.models.target.shape import model_shape
from dflash_core.planning.drafter_memory import (
    DSPARK_HEADS, OPTIMIZER_COMPONENTS, drafter_phases, drafter_pass, peak_phase,
)
from dflash_core.planning.target_memory import target_components, target_dtype
from dflash_core.planning.card_budget import ALLOCATOR_RESERVE, CUDA_CONTEXT  # noqa: F401
from dflash_core.planning.weight_bytes import full_logits_bytes


# The margins a GPU holds beyond the tensors: card_budget.py, with why.
MARGIN_NAMES = ("cuda context", "allocator reserve")


def cuda_margin(tensors: int) -> dict[str, int]:
    """The margin components for a GPU whose planned tensors total ``tensors`` bytes."""
    return {"cuda context": CUDA_CONTEXT, "allocator reserve": math.ceil(ALLOCATOR_RESERVE * tensors)}


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------

@dataclass
class PlanRow:
    device: str  # "cuda:N" or "cpu"
    role: str  # target | drafter | target+drafter
    components: dict[str, int]  # ordered name -> bytes
    # Bytes this process may use: free before loading, capped by layout.gpu_memory_gib; None =
    # unknown (not checked).
    free: int | None = None
    capacity: int | None = None  # the card's size, or the rehearsed card's limit, for display

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def fits(self) -> bool:
        return self.free is None or self.total <= self.free

    @property
    def headroom(self) -> int | None:
        """Bytes left under the usable memory at the planned peak (negative: over)."""
        return None if self.free is None else self.free - self.total

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "role": self.role, "components": dict(self.components),
                "total": self.total, "free": self.free, "fits": self.fits,
                "capacity": self.capacity, "headroom": self.headroom}


@dataclass
class Overflow:
    """Devices the plan does not fit (a group with identical role, components and free memory),
    and what would make it fit."""

    devices: list[str]
    row: PlanRow  # the first device's row
    lower: list[tuple[str, Any]]  # (config key, its value now), biggest lever first; at most 3
    separate_roles: bool  # targets and drafters share a GPU: putting them on different ones helps
    weights_too_big: bool  # the weights alone exceed the free memory
    recompute: bool = False  # a drafter GPU with drafter.recompute off: turning it on would help


@dataclass
class Plan:
    rows: list[PlanRow]
    token_budget: int
    logits_extra: int  # bytes full target logits would add on each target GPU (target dtype)
    logits_upcast_extra: int  # and the float32 copy HF's loss path makes on top of that
    overflows: list[Overflow]  # one per group of devices that does not fit, in device order
    recompute: bool = False  # the drafter's layers recomputed in backward (drafter.recompute)
    # auto turned recompute on: the largest drafter GPU's plan without it (bytes), else None
    without_recompute: int | None = None
    drafter_peak: str = ""  # the phase of a drafter pass that peaks (drafter_memory.PHASES)

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.rows)

    @property
    def key(self) -> str | None:
        """The config key to change first: the biggest lever of the first group that does not
        fit (None when the plan fits, or nothing in config.yaml would shrink it)."""
        return next((o.lower[0][0] for o in self.overflows if o.lower), None)

    def row(self, device: str) -> PlanRow:
        for r in self.rows:
            if r.device == device:
                return r
        raise KeyError(device)

    def to_event_rows(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.rows]


def _device_type(cfg: Config, free_bytes: dict[str, int] | None) -> str:
    if cfg.layout.device != "auto":
        return cfg.layout.device
    if free_bytes:
        return "cuda" if any(k.startswith("cuda") for k in free_bytes) else "cpu"
    import torch  # only to answer "auto" when the caller gave no device facts

    return "cuda" if torch.cuda.is_available() else "cpu"


def plan_memory(cfg: Config, target_hf_config: dict, free_bytes: dict[str, int] | None = None,
                total_bytes: dict[str, int] | None = None, quantized: bool | None = None) -> Plan:
    """Estimate each device's peak bytes for this config and target.

    Queued feature batches stay on the target that made them (engine.py): each target keeps at
    most its share, ceil(layout.hs_queue / targets) batches, until a drafter takes them (the hs
    queue holds each target to it: pipeline/hs_queue.py). ``quantized``: a quantized
    checkpoint's weights stay as stored (preflight knows whether transformers can run them on
    these devices); None = on CUDA yes, on the CPU no (transformers dequantizes there).
    """
    s = model_shape(target_hf_config)
    free_bytes, total_bytes = free_bytes or {}, total_bytes or {}
    dev = _device_type(cfg, free_bytes)
    on_cuda = dev == "cuda"
    lay = cfg.layout
    label = (lambda i: f"cuda:{i}") if on_cuda else (lambda i: "cpu")
    queued = math.ceil(lay.hs_queue / len(lay.targets))

    kept = on_cuda if quantized is None else quantized
    target = target_components(cfg, s, target_hf_config, on_cuda, queued, kept)

    def rows_with(recompute: bool, cfg: Config = cfg) -> tuple[list[PlanRow], str]:
        phases = drafter_phases(cfg, s, target_hf_config, on_cuda, recompute)
        peak = peak_phase(phases)
        per_device: dict[str, tuple[list[str], dict[str, int]]] = {}

        def add(device: str, role: str, comps: dict[str, int]) -> None:
            roles, acc = per_device.setdefault(device, ([], {}))
            if role not in roles:
                roles.append(role)
            for name, nbytes in comps.items():
                acc[name] = acc.get(name, 0) + nbytes

        for i in lay.targets:
            add(label(i), "target", target)
        for i in lay.drafters:
            add(label(i), "drafter", phases[peak])
        rows = []
        for device in sorted(per_device, key=device_key):
            roles, comps = per_device[device]
            comps = {k: v for k, v in comps.items() if v}
            if on_cuda:
                comps |= cuda_margin(sum(comps.values()))
            rows.append(PlanRow(device, "+".join(sorted(roles, key=("target", "drafter").index)),
                                comps, free_bytes.get(device), total_bytes.get(device)))
        return rows, peak

    def drafters_fit(rows: list[PlanRow]) -> bool:
        return all(r.fits for r in rows if "drafter" in r.role)

    mode = cfg.drafter.recompute
    rows, peak = rows_with(mode == "on")
    recompute, without = mode == "on", None
    # auto: on when one sample does not fit otherwise: even a pass of one whole sequence with
    # the smallest loss chunk does not fit without it. Fewer sequences a pass and smaller loss
    # chunks cost next to nothing, so a plan that fits so is refused naming them (fit_sizes).
    if mode == "auto" and not drafters_fit(rows):
        p = drafter_pass(cfg)
        one = copy.deepcopy(cfg)
        one.drafter.micro_block_tokens = min(cfg.drafter.micro_block_tokens,
                                             p.blocks * p.block_size)
        one.drafter.loss_chunk = min(cfg.drafter.loss_chunk, MIN_LOSS_CHUNK)
        if not drafters_fit(rows_with(False, one)[0]):
            without = max(r.total for r in rows if "drafter" in r.role)
            rows, peak = rows_with(True)
            recompute = True
    return Plan(rows=rows, token_budget=cfg.data.token_budget,
                logits_extra=full_logits_bytes(cfg.data.token_budget, s.vocab,
                                               target_dtype(cfg, on_cuda)),
                logits_upcast_extra=full_logits_bytes(cfg.data.token_budget, s.vocab, "float32"),
                overflows=[_overflow(cfg, devices, r) for devices, r in
                           device_groups(rows) if not r.fits],
                recompute=recompute, without_recompute=without, drafter_peak=peak)


def device_groups(rows: list[PlanRow]) -> list[tuple[list[str], PlanRow]]:
    """Devices with identical role, components and free memory, so 7 equal targets read once."""
    groups: list[tuple[list[str], PlanRow]] = []
    for r in rows:
        for devices, first in groups:
            if (first.role, first.components, first.free) == (r.role, r.components, r.free):
                devices.append(r.device)
                break
        else:
            groups.append(([r.device], r))
    return groups


def device_key(device: str) -> tuple[str, int]:
    """("cuda", 3) for "cuda:3": devices sort by kind, then by index."""
    kind, _, idx = device.partition(":")
    return kind, int(idx) if idx.isdigit() else -1


# Which lever shrinks which component.
_LEVERS = {
    "residual stream": TOKEN_BUDGET, "layer transient": TOKEN_BUDGET,
    "attention mask": TOKEN_BUDGET, "features": TOKEN_BUDGET,
    "hs queue": HS_QUEUE,
    "loss chunk": LOSS_CHUNK,
    **{name: NUM_LAYERS for name in OPTIMIZER_COMPONENTS.values()},
}


def _activation_lever(cfg: Config, name: str) -> Lever | None:
    """The lever that bounds a drafter term of one forward/backward: its sequences a pass, then
    (blocks) its anchors a pass and its anchors, or (context) the sample's length."""
    p = drafter_pass(cfg)
    if name == "received features":
        return TOKEN_BUDGET if p.seqs > 1 else MAX_LENGTH
    if p.per_pass > 1:
        return TOKEN_BUDGET if p.per_pass == p.seqs else MICRO_BLOCK_TOKENS
    if name != "block activations":
        return MAX_LENGTH  # one sequence's context: only a shorter sample holds less
    if MICRO_BLOCK_TOKENS.lower(cfg) is not None:
        return MICRO_BLOCK_TOKENS  # a sequence's anchors can still go in smaller passes
    return NUM_ANCHORS  # already the smallest pass


# The drafter's terms that one pass sizes (the activation lever's).
_ACTIVATIONS = ("block activations", "context", "context activations", "received features",
                "layer forward", "layer backward")


def _overflow(cfg: Config, devices: list[str], row: PlanRow) -> Overflow:
    """What to change for one overflowing group of devices, biggest lever first."""
    levers: dict[str, int] = {}
    for name, nbytes in row.components.items():
        lever = _activation_lever(cfg, name) if name in _ACTIVATIONS else _LEVERS.get(name)
        if lever is TOKEN_BUDGET and TOKEN_BUDGET.lower(cfg) is None:
            lever = MAX_LENGTH  # a batch is one longest sample already: only a shorter one helps
        if lever:
            levers[lever.key] = levers.get(lever.key, 0) + nbytes
    ranked = sorted(levers, key=levers.get, reverse=True)[:3]
    fixed = sum(row.components.get(name, 0)
                for name in ("weights", "experts", *OPTIMIZER_COMPONENTS.values(),
                             DSPARK_HEADS))
    return Overflow(
        devices=devices, row=row, lower=[(k, key_value(cfg, k)) for k in ranked],
        separate_roles=row.role == "target+drafter" and row.device.startswith("cuda"),
        weights_too_big=row.free is not None and fixed > row.free,
        recompute="drafter" in row.role and cfg.drafter.recompute == "off")


# --------------------------------------------------------------------------------------------
# Sizes that fit
# --------------------------------------------------------------------------------------------

def fit_sizes(cfg: Config, target_hf_config: dict, free_bytes: dict[str, int] | None,
              total_bytes: dict[str, int] | None = None,
              quantized: bool | None = None) -> dict[str, int] | None:
    """The largest values of levers.FIT_LEVERS (each lowered by its own rule, Lever.lower)
    with which the plan fits: {} when it already fits, None when even the smallest do not.

    With drafter.recompute auto, sizes that fit without recompute come first as long as a pass
    still holds whole sequences (fewer sequences a pass and smaller loss chunks cost next to
    nothing); when even one sequence does not fit so, the sizes that fit with the layers
    recomputed (plan_memory turns it on then, by the same rule)."""
    args = (target_hf_config, free_bytes, total_bytes, quantized)
    if cfg.drafter.recompute != "auto":
        return _lower_until_fits(cfg, *args)
    off = copy.deepcopy(cfg)
    off.drafter.recompute = "off"
    sizes = _lower_until_fits(off, *args, whole_sequences=True)
    if sizes is not None:
        return sizes
    on = copy.deepcopy(cfg)
    on.drafter.recompute = "on"
    return _lower_until_fits(on, *args)


def _lower_until_fits(cfg: Config, target_hf_config: dict, free_bytes: dict[str, int] | None,
                      total_bytes: dict[str, int] | None, quantized: bool | None,
                      whole_sequences: bool = False) -> dict[str, int] | None:
    """fit_sizes' search on one setting of drafter.recompute; ``whole_sequences``: never lower
    drafter.micro_block_tokens below one sequence's blocks."""
    trial = copy.deepcopy(cfg)
    changes: dict[str, int] = {}

    def lower(lever: Lever) -> int | None:
        new = lever.lower(trial)
        if whole_sequences and lever is MICRO_BLOCK_TOKENS and new is not None:
            p = drafter_pass(trial)
            one = p.blocks * p.block_size
            new = max(new, one) if key_value(trial, lever.key) > one else None
        return new

    while True:
        plan = plan_memory(trial, target_hf_config, free_bytes, total_bytes, quantized)
        if plan.fits:
            return changes
        step = next(((lever.key, new) for row in plan.rows if not row.fits
                     for role in row.role.split("+") for lever in FIT_LEVERS[role]
                     if (new := lower(lever)) is not None), None)
        if step is None:
            return None
        key, new = step
        set_key_value(trial, key, new)
        changes[key] = new
