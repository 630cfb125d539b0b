"""Tau by context length on the training panel (context_buckets.py): a line for the latest
held-out evaluation and one for each set whose rounds fall in more than one bucket of context;
none while every evaluation's rounds sit in one (its tau is the evaluation's own), none for an
older events.jsonl."""

from __future__ import annotations

import dataclasses

import pytest
import tui_scenarios as sc

from dflash_core.context_buckets import Buckets, by_context
from dflash_core.observe import events as ev
from dflash_tui.app import DFlashApp
from dflash_tui.sources.replay import ReplayController
from dflash_tui.widgets.training import eval_lines
from tui_scenarios import fold

B = Buckets.of(40960)
TWO = by_context(B, [([300, 600], [2, 1]), ([2000], [0])])  # 0-1k 2.50 (2), 1-4k 1.00 (1)
ONE = by_context(B, [([300, 600], [2, 1])])


def with_context(events, held_out, long=None):
    """The scenario's run, its evaluations carrying ``held_out`` buckets; with ``long``, each
    followed by a long set's result carrying those."""
    out = []
    for e in events:
        if isinstance(e, ev.EvalResult):
            out.append(dataclasses.replace(e, context=held_out))
            if long is not None:
                out.append(ev.EvalResult(step=e.step, tau=1.8, acceptance=[3, 1], prompts=4,
                                         prompt_set="long", context=long, ts=e.ts + 1))
        else:
            out.append(e)
    return out


def _context_lines(s, width=120):
    return [t.plain for t in eval_lines(s, width) if "by context" in t.plain]


def test_a_line_only_when_more_than_one_bucket_has_rounds():
    run = sc.training(steps=20)
    assert _context_lines(fold(run)) == []  # an older run: no buckets at all
    assert _context_lines(fold(with_context(run, ONE, ONE))) == []
    assert _context_lines(fold(with_context(run, TWO))) == [
        "tau by context  0-1k 2.50 (2)  1-4k 1.00 (1)"]
    assert _context_lines(fold(with_context(run, ONE, TWO))) == [
        "tau by context on long  0-1k 2.50 (2)  1-4k 1.00 (1)"]
    both = eval_lines(fold(with_context(run, TWO, TWO)), 120)
    texts = [t.plain for t in both]
    assert texts[0].startswith("tau exact ")  # the held-out line stays first
    assert texts[2:4] == ["tau by context  0-1k 2.50 (2)  1-4k 1.00 (1)",
                          "tau by context on long  0-1k 2.50 (2)  1-4k 1.00 (1)"]
    assert all(len(t.plain) <= 30 for t in eval_lines(fold(with_context(run, TWO)), 30))


def test_sets_alone_show_their_context_line():
    events = [e for e in with_context(sc.training(steps=20), ONE, TWO)
              if not (isinstance(e, ev.EvalResult) and not e.prompt_set)]
    assert _context_lines(fold(events)) == [
        "tau by context on long  0-1k 2.50 (2)  1-4k 1.00 (1)"]


@pytest.mark.anyio
async def test_the_training_panel_shows_the_line():
    app = DFlashApp(ReplayController(with_context(sc.training(steps=20), TWO)))
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause(1.2)
        text = app.query_one("#training").text
    assert "tau by context  0-1k 2.50 (2)  1-4k 1.00 (1)" in text
