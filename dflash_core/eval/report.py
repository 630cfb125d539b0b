"""What one evaluation found, set by set (the runner fills it, the verb prints it), and its
results.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import dflash_core.eval.results as rs
from dflash_core.eval.summary import Summary


@dataclass
class SetReport:
    name: str
    prompts: int
    plain: Summary
    drafters: dict[str, Summary]


@dataclass
class EvalReport:
    folder: Path
    settings: dict
    labels: list[str]
    per_round: dict[str, int]  # label -> drafts a round proposes
    sets: list[SetReport] = field(default_factory=list)
    # label -> the device time to it (a run's checkpoint); None: not known (a downloaded one)
    hours: dict = field(default_factory=dict)
    served: object = None  # served.ServedReport of --engine vllm; None: this engine alone

    @property
    def mismatches(self) -> list[tuple[str, str, dict]]:
        """(set, drafter, mismatch) of every prompt whose greedy output left the target's where
        the target's choice was clear: the lossless check's failures."""
        return [(s.name, label, m) for s in self.sets for label, d in s.drafters.items()
                for m in d.mismatches if not m.get("near_tie")]

    @property
    def near_ties(self) -> list[tuple[str, str, dict]]:
        """(set, drafter, mismatch) of the prompts that parted at a near tie of the target."""
        return [(s.name, label, m) for s in self.sets for label, d in s.drafters.items()
                for m in d.mismatches if m.get("near_tie")]


def report_json(rep: EvalReport, ev) -> dict:
    """results.json of an evaluation (``ev``: the runner's Evaluation, its drafters and sets)."""
    return {
        "written_by": rs.WRITTEN_BY,  # a results.json the user wrote is never replaced
        "settings": rep.settings,
        "target": str(ev.folder),
        "drafters": {s.label: {"path": str(s.path), "objective": s.objective,
                               "block_size": s.block_size,
                               "dtype": ev.drafter_dtypes[s.label],  # decoded in
                               "run": str(s.run_folder) if s.run_folder else None,
                               # what it cost to train (None: not known)
                               "device_hours": s.hours.record() if s.hours else None,
                               "cost": s.hours.money if s.hours else None}
                     for s in ev.specs},
        "sets": {s.name: {"prompts": s.prompts, "file": str(p.path), "plain": s.plain.as_dict(),
                          "drafters": {k: v.as_dict() for k, v in s.drafters.items()}}
                 for s, p in zip(rep.sets, ev.sets)},
        # --engine vllm: vLLM's version, runner and dtype, and its decodings (served.py)
        "served": rep.served.record() if rep.served is not None else None,
    }
