"""The report of a run with prompt sets (eval.prompt_sets): one exact-tau line per set on the tau
plot, under its evaluations' steps; the sets in the summary and in their tables; the held-out
evaluation (its table, its acceptance section) as a run without sets has it."""

from __future__ import annotations

import dataclasses

import pytest
import tui_scenarios as sc

from dflash_core.observe import events as ev
from dflash_tui import report
from tests.tui.report.test_report import _data, _figure_of, _step, write_events


def run_with_sets() -> list[ev.Event]:
    events = sc.start()
    t = sc.T0 + 100
    for s in range(1, 121):
        t += 2.0
        events.append(_step(s, 2.0, t))
        if s % 40 == 0:
            events += [
                ev.EvalResult(step=s, tau=2.0 + s / 100, acceptance=[3, 2, 1], prompts=8,
                              tau_tf_target=2.5, ts=t + 5),
                ev.EvalResult(step=s, tau=1.5 + s / 200, acceptance=[4, 1], prompts=16,
                              seconds=12.5, prompt_set="gsm8k", ts=t + 8),
                ev.EvalResult(step=s, tau=1.25, acceptance=[5, 1], prompts=32, seconds=20.0,
                              prompt_set="mt-bench", ts=t + 12)]
    return events


def test_each_set_has_its_series_and_the_held_out_ones_are_unchanged():
    events = run_with_sets()
    data = _data(events)
    held_out = _data([e for e in events if not getattr(e, "prompt_set", "")])
    assert data.evals.items() == held_out.evals.items()
    assert data.last_eval == held_out.last_eval and data.last_eval.prompt_set == ""
    assert data.sets.names() == ["gsm8k", "mt-bench"]
    assert [(st, tau) for _, st, tau in data.sets.points("gsm8k")] == [
        (40, pytest.approx(1.7)), (80, pytest.approx(1.9)), (120, pytest.approx(2.1))]
    assert data.sets.best("gsm8k") == (pytest.approx(2.1), 120)
    assert not held_out.sets


def test_the_tau_plot_draws_one_line_per_set_under_its_steps():
    from dflash_tui.report import plots

    data = _data(run_with_sets())
    ax = _figure_of(plots.tau_plot, data).axes[0]
    clock = plots.Clock(data.t0, data.last_ts)
    at_step = plots.step_positions(data, clock)
    lines = {line.get_label(): line for line in ax.get_lines()}
    for name, taus in (("gsm8k", [1.7, 1.9, 2.1]), ("mt-bench", [1.25] * 3)):
        line = lines[f"exact tau on {name}"]
        assert list(line.get_ydata()) == pytest.approx(taus)
        assert list(line.get_xdata()) == pytest.approx([at_step(s) for s in (40, 80, 120)])
    assert lines["exact tau on gsm8k"].get_color() != lines["exact tau on mt-bench"].get_color()
    assert "exact tau (evaluation, at its step)" in lines  # the held-out line stays


def test_the_page_lists_the_sets_and_keeps_acceptance_held_out(tmp_path):
    events = run_with_sets()
    write_events(tmp_path / "events.jsonl", events)
    page = report.render_html(report.read_run(tmp_path))
    assert ("<th>latest exact tau on the sets</th><td>gsm8k 2.1000 (16 prompts) at step 120, "
            "mt-bench 1.2500 (32 prompts) at step 120</td>") in page
    assert ("<tr><td>gsm8k</td><td>16</td><td>2.1000 at step 120</td><td>2.1000 at step 120"
            "</td><td>12.5</td><td>3</td></tr>") in page
    assert "<tr><td>80</td><td>1.9000</td><td>1.2500</td></tr>" in page  # the sets by step
    # the acceptance section is the held-out evaluation's: its tau, its histogram
    assert "<td>tau exact</td><td>3.20</td>" in page and "<td>tf target</td><td>2.50</td>" in page
    plain = report.render_html(_data([e for e in events if not getattr(e, "prompt_set", "")]))
    assert "on the sets" not in plain and "exact tau on each set" not in plain


def test_an_old_events_file_without_the_field_reads_as_held_out(tmp_path):
    e = ev.EvalResult(step=5, tau=2.5, acceptance=[1, 1], prompts=2, ts=sc.T0 + 50)
    d = dataclasses.asdict(e)
    del d["prompt_set"]
    line = ev.from_dict({**d, "event": "EvalResult"})
    data = _data(sc.start() + [line])
    assert data.last_eval == e and not data.sets
