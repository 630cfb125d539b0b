"""Tau by context length in the run report (context_buckets.py): a plot with a line per latest
evaluation (the held-out one, each set) whose rounds fall in more than one bucket, each point
its bucket's tau, and a table of them; nothing of it for a run whose rounds sit in one bucket."""

from __future__ import annotations

import dataclasses

import pytest
import tui_scenarios as sc

from dflash_core.context_buckets import Buckets, by_context
from dflash_core.observe import events as ev
from dflash_tui import report
from dflash_tui.report.context import context_evals
from tests.tui.report.test_report import _data, _step, write_events

B = Buckets.of(40960)
TWO = by_context(B, [([300, 600], [2, 1]), ([2000], [0])])  # 0-1k 2.50 (2), 1-4k 1.00 (1)
LONG = by_context(B, [([300], [3]), ([2000, 5000], [1, 0])])  # 0-1k 4, 1-4k 2, 4-16k 1
ONE = by_context(B, [([300, 600], [2, 1])])


def run(held_out, long) -> list[ev.Event]:
    t = sc.T0 + 100
    return sc.start() + [
        _step(1, 2.0, t),
        ev.EvalResult(step=1, tau=2.0, acceptance=[1, 1, 1], prompts=2, context=held_out,
                      ts=t + 1),
        ev.EvalResult(step=1, tau=2.0, acceptance=[1, 1, 1, 1], prompts=2, prompt_set="long",
                      context=long, ts=t + 2)]


def test_the_plot_draws_a_line_per_evaluation_shown():
    from dflash_tui.report import plots

    data = _data(run(TWO, LONG))
    shown = context_evals(data)
    assert [name for name, _ in shown] == ["", "long"]
    p = plots.Plots(keep=True)
    plots.context_plot(p, shown, data.sets.names())
    ax = p.drawn[-1].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0-1k", "1-4k", "4-16k"]
    lines = {line.get_label(): line for line in ax.get_lines()}
    held, long = lines["held-out prompts, step 1"], lines["set long, step 1"]
    assert list(held.get_xdata()) == [0, 1] and list(held.get_ydata()) == pytest.approx(
        [2.5, 1.0])
    assert list(long.get_xdata()) == [0, 1, 2] and list(long.get_ydata()) == pytest.approx(
        [4.0, 2.0, 1.0])
    # each in its colour of the tau plot: the held-out red, the set its own
    assert (held.get_color(), long.get_color()) == (plots.EVAL_COLOR, plots.SET_COLORS[0])


def test_the_page_has_the_section_only_when_a_bucket_split_is_there(tmp_path):
    write_events(tmp_path / "events.jsonl", run(ONE, LONG))
    page = report.render_html(report.read_run(tmp_path))
    assert 'id="context"' in page and "<svg" in page
    assert "<tr><td>set long</td><td>1</td><td>0-1k 4.00 (1)  1-4k 2.00 (1)  4-16k 1.00 (1)" \
        "</td></tr>" in page
    assert "<td>held-out prompts</td>" not in page  # its rounds sit in one bucket
    # the page has the section when these are there (one render: each draws every plot)
    assert context_evals(_data(run(ONE, ONE))) == []
    old = [dataclasses.replace(e, context=[]) if isinstance(e, ev.EvalResult) else e
           for e in run(TWO, LONG)]
    assert context_evals(_data(old)) == []
