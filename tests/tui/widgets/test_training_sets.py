"""A run with prompt sets (eval.prompt_sets) on the dashboard: each set's latest exact tau in the
training panel, in the held-out line's words; the held-out measures, the gap and the findings
stay the held-out evaluation's; a run without sets (an old events.jsonl too) shows none."""

from __future__ import annotations

import dataclasses

import pytest
import tui_scenarios as sc

from dflash_core.observe import events as ev
from dflash_tui.app import DFlashApp
from dflash_tui.sources.replay import ReplayController
from dflash_tui.widgets.training import eval_lines
from tui_scenarios import fold

BIG = (160, 48)


def with_sets(events: list[ev.Event]) -> list[ev.Event]:
    """The scenario's run, each evaluation followed by one result per set."""
    out = []
    for e in events:
        out.append(e)
        if isinstance(e, ev.EvalResult):
            out += [ev.EvalResult(step=e.step, tau=2.25, acceptance=[3, 1, 1], prompts=16,
                                  seconds=4.0, prompt_set="gsm8k", ts=e.ts + 1),
                    ev.EvalResult(step=e.step, tau=1.5, acceptance=[4, 1], prompts=16,
                                  seconds=3.0, prompt_set="mt-bench", ts=e.ts + 2)]
    return out


def test_state_keeps_the_held_out_evaluation_and_each_sets_latest_apart():
    plain, sets = fold(sc.training(steps=20)), fold(with_sets(sc.training(steps=20)))
    assert sets.eval == plain.eval and list(sets.eval_history) == list(plain.eval_history)
    assert sets.accepted_by_position() == plain.accepted_by_position()
    assert sets.tau_gap == plain.tau_gap
    assert sets.set_evals.names() == ["gsm8k", "mt-bench"]
    assert sets.set_evals.latest["gsm8k"].tau == 2.25
    assert list(sets.set_evals.taus["mt-bench"]) == [1.5]
    logged = [m.text for m in sets.log if m.source == "eval"]
    assert any(m.startswith("step 20 on set gsm8k, 16 prompts: tau exact 2.25 | accepted@k")
               for m in logged)
    assert not plain.set_evals


def test_the_panels_set_line_names_each_set_and_narrows_without_its_plots():
    s = fold(with_sets(sc.training(steps=20)))
    wide = [line.plain for line in eval_lines(s, 120)]
    assert wide[0].startswith("tau exact ")  # the held-out line first, as before
    assert wide[1] == "tau exact on gsm8k █ 2.25  mt-bench █ 1.50"  # one evaluation each
    narrow = eval_lines(s, 40)[1].plain
    assert narrow == "tau exact on gsm8k 2.25  mt-bench 1.50"
    assert eval_lines(s, 20)[1].plain.endswith("…")
    assert len(eval_lines(fold(sc.training(steps=20)), 120)) == len(wide) - 1


def test_sets_alone_show_their_line():
    """data.eval_prompts 0: no held-out evaluation, the sets' line only."""
    events = [e for e in with_sets(sc.training(steps=20))
              if not (isinstance(e, ev.EvalResult) and not e.prompt_set)]
    s = fold(events)
    assert s.eval is None and [line.plain[:13] for line in eval_lines(s, 120)] == [
        "tau exact on "]


@pytest.mark.anyio
async def test_the_training_panel_shows_the_sets():
    app = DFlashApp(ReplayController(with_sets(sc.training(steps=20))))
    async with app.run_test(size=BIG) as pilot:
        await pilot.pause(1.2)
        text = app.query_one("#training").text
    assert "tau exact on gsm8k █ 2.25  mt-bench █ 1.50" in text
    assert "2.87" in text  # the held-out exact tau's line stays


def test_an_old_line_without_the_field_is_a_held_out_evaluation():
    old = '{"ts":1.0,"step":3,"tau":2.5,"acceptance":[1,1],"prompts":2,"event":"EvalResult"}'
    e = ev.from_json(old)
    assert e.prompt_set == "" and dataclasses.replace(e, prompt_set="x").prompt_set == "x"
    s = fold([e])
    assert s.eval == e and not s.set_evals
