"""How big one checkpoint is and how much disk a run's checkpoints need.

One place for both checks: preflight counts the drafter from the config before any weights load,
the run counts the drafter it built (its disk check while training); both then use
``checkpoint_bytes``. A format-2 checkpoint (checkpoint-format.md) holds the weights in the served
dtype (model.safetensors), the float32 master weights and the optimizer's state (the shards);
JSON, headers and the RNG state add a few KB, not counted. A DSpark checkpoint's model.safetensors
also carries copies of the target's embed_tokens and lm_head in the served dtype (``frozen``:
never trained, so no master copy and no optimizer state).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_core.units import size_text

MASTER_BYTES = 4  # the replicas train in float32: the master weights
# Optimizer state per parameter entry, by optim.name: (entry of a 2-D weight matrix, any other
# entry). AdamW keeps two float32 moments of every entry; Muon one float32 momentum per matrix
# entry, with AdamW on the rest (the norms). A scalar step count per tensor is not counted.
OPTIMIZER_STATE_BYTES = {"adamw": (8, 8), "muon": (4, 8)}


def optimizer_state_bytes(name: str, params: int, matrix_params: int) -> int:
    """Bytes of the optimizer state a checkpoint holds for ``params`` parameter entries, of which
    ``matrix_params`` are in 2-D weight matrices."""
    if name not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"no checkpoint size known for optimizer {name!r}; known: "
                         f"{sorted(OPTIMIZER_STATE_BYTES)}")
    matrix, other = OPTIMIZER_STATE_BYTES[name]
    return matrix_params * matrix + (params - matrix_params) * other


def checkpoint_bytes(params: int, matrix_params: int, served_bytes: int,
                     optimizer: str = "adamw", frozen: int = 0) -> int:
    """One checkpoint on disk: served weights + float32 master weights + optimizer state, and
    ``frozen`` entries served only (DSpark's copies of the target's embedding and lm_head)."""
    return (params * served_bytes + params * MASTER_BYTES
            + optimizer_state_bytes(optimizer, params, matrix_params) + frozen * served_bytes)


def drafter_counts(cfg, hf_config: dict) -> tuple[int, int]:
    """(parameters, of which in 2-D matrices given to Muon) of the drafter the config builds on
    this target."""
    from dflash_core.models.target.shape import drafter_matrix_param_count, drafter_param_count

    return drafter_param_count(cfg, hf_config), drafter_matrix_param_count(cfg, hf_config)


def frozen_count(cfg, hf_config: dict) -> int:
    """Entries of the frozen copies the config's checkpoints serve (0 for DFlash)."""
    from dflash_core.families.registry import frozen_numel
    from dflash_core.models.target.shape import model_shape

    s = model_shape(hf_config)
    return frozen_numel(cfg, s.hidden, s.vocab)


def state_counts(state: dict, adamw_only: tuple[str, ...] = ()) -> tuple[int, int]:
    """(entries, of which in 2-D tensors Muon would take) of a drafter's state_dict: the
    modules named in ``adamw_only`` (the drafter's, e.g. DSpark's heads) stay on AdamW."""
    keep = tuple(f"{m}." for m in adamw_only)
    tensors = [(k, t) for k, t in state.items() if hasattr(t, "numel")]
    return (sum(t.numel() for _, t in tensors),
            sum(t.numel() for k, t in tensors if t.dim() == 2 and not k.startswith(keep)))


def planned_checkpoints(every: int, total_steps: int) -> int:
    """Checkpoints a run of ``total_steps`` writes: the periodic ones and the final one (the
    last periodic one when it falls on the last step)."""
    if not every:
        return 1
    return total_steps // every + (1 if total_steps % every else 0)


@dataclass(frozen=True)
class DiskNeed:
    """The disk a run's checkpoints take at their peak, beyond those already in its folder."""

    size: int  # one checkpoint, bytes
    keep: int  # checkpoint.keep (0 = all)
    slots: int  # checkpoints on disk at the peak
    planned: int  # checkpoints the run writes
    existing: int  # complete checkpoints already in the run folder (a resume's)
    best: bool  # one slot is the best checkpoint, which pruning keeps whatever its age

    @property
    def bytes(self) -> int:
        """Free space the run needs: the slots not yet filled, at least the one being written."""
        return max(1, self.slots - self.existing) * self.size

    def describe(self) -> str:
        kept = f"keep {self.keep}" if self.keep else "keep 0 (all)"
        parts = ["one being written"] if self.keep and self.planned > self.keep else []
        if self.best:
            parts.append("the best one")
        if self.existing:
            parts.append(f"{self.existing} already there")
        more = f" ({', '.join(parts)})" if parts else ""
        return f"a checkpoint is {gib(self.size)}; {kept} needs {gib(self.bytes)}{more}"


def disk_need(size: int, keep: int, planned: int, existing: int = 0,
              best: bool = False) -> DiskNeed:
    """``keep`` newest checkpoints stay and a new one is written in full before the oldest goes,
    so ``keep`` + 1 are on disk at once (never more than the run writes, ``planned``); with
    ``best`` (periodic evaluations) one more may be the best one, kept whatever its age."""
    if keep <= 0:
        slots = planned
    else:
        slots = min(planned, keep + 1)
        best = best and planned > keep
        slots += int(best)
    return DiskNeed(size, keep, slots, planned, existing, best)


def keep_that_fits(size: int, free: int, planned: int, existing: int, best: bool) -> int:
    """The largest checkpoint.keep (>= 1) whose need fits in ``free`` bytes; 0 if none."""
    fits = 0
    for keep in range(1, max(planned, 1) + 1):
        if disk_need(size, keep, planned, existing, best).bytes <= free:
            fits = keep
        else:
            break
    return fits


gib = size_text  # the name its importers know (units.size_text is the one formatter)
