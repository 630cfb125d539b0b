"""The header's best checkpoint (and the log's line on it) names the prompt set its exact tau is on when eval.best_set
names one; following the held-out prompts it says nothing more (an old events.jsonl too)."""

from __future__ import annotations

import tui_scenarios as sc

from dflash_core.observe import events as ev
from dflash_tui.state.dashboard import DashboardState
from dflash_tui.widgets.header import second_line


def folded(prompt_set: str) -> DashboardState:
    s = DashboardState()
    events = sc.training(steps=20)
    s.apply_all(events + [ev.Checkpoint(step=20, path="runs/x/checkpoints/step-20", seconds=0.0,
                                        reason="best", tau=2.87, prompt_set=prompt_set,
                                        ts=events[-1].ts)])
    return s


def best_field(prompt_set: str) -> str:
    (field,) = [t.plain for _, t in second_line(folded(prompt_set), 160)
                if t.plain.startswith("best")]
    return field


def test_best_on_a_set_names_it():
    assert best_field("gsm8k").endswith("step 20 τ 2.87 on gsm8k")
    logged = [x.text for x in folded("gsm8k").log if "best so far" in x.text]
    assert logged == ["best so far: step 20 (tau 2.87 on gsm8k), runs/x/checkpoints/step-20"]


def test_best_on_the_held_out_prompts_names_no_set():
    assert best_field("").endswith("step 20 τ 2.87")
