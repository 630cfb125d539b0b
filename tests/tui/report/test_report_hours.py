"""The report's cost: exact tau against GPU-hours (each evaluation at the figure taken as it
began), the device time to the best checkpoint and to the end, and files without it."""

from __future__ import annotations

import pytest

from dflash_core.observe import events as ev
from dflash_tui import report
from dflash_tui.report import hours, plots

import tui_scenarios as sc


def _hours(step, h, reason, t, price=0.0, **kw):
    """A figure of 8 GPUs: a quarter target, the rest drafter."""
    return ev.DeviceHours(step=step, gpu_target=h / 4, gpu_drafter=3 * h / 4, devices=8,
                          price=price, currency="USD", reason=reason, ts=sc.T0 + t, **kw)


def costed_run(price: float = 2.0) -> list[ev.Event]:
    out = sc.training(steps=30)
    t = out[-1].ts - sc.T0
    out += [
        _hours(10, 1.0, "periodic", t + 1, price),
        _hours(10, 2.0, "eval", t + 2, price),
        ev.EvalResult(step=10, tau=2.0, acceptance=[1, 1], prompts=8, ts=sc.T0 + t + 3),
        ev.Checkpoint(step=10, path="runs/x/checkpoints/step-10", seconds=0.0, reason="best",
                      tau=2.0, ts=sc.T0 + t + 3),
        _hours(20, 4.0, "eval", t + 4, price),
        ev.EvalResult(step=20, tau=3.0, acceptance=[1, 2], prompts=8, ts=sc.T0 + t + 5),
        ev.EvalResult(step=20, tau=2.5, acceptance=[1, 2], prompts=8, prompt_set="gsm8k",
                      ts=sc.T0 + t + 6),
        _hours(30, 6.0, "end", t + 7, price, lost_gpu=0.5),
        ev.StateChanged(state="finished", previous="training", ts=sc.T0 + t + 8),
        ev.RunEnded(status="finished", step=30, seconds=t + 8, ts=sc.T0 + t + 8),
    ]
    return out


def _data(events) -> report.RunData:
    data = report.RunData()
    for e in events:
        data.feed(e)
    return data


def test_each_evaluation_stands_at_the_figure_taken_as_it_began():
    data = _data(costed_run())
    pts = [(name, step, tau, h.gpu_hours) for name, step, tau, h in data.hours.points.items()]
    assert pts == [("held-out", 10, 2.0, 2.0), ("held-out", 20, 3.0, 4.0), ("gsm8k", 20, 2.5, 4.0)]
    ck, fig = data.hours.best
    assert ck.step == 10 and fig.gpu_hours == 2.0
    assert data.hours.last.reason == "end"


def test_the_plot_draws_exact_tau_against_gpu_hours_and_marks_the_best():
    data = _data(costed_run())
    p = plots.Plots(keep=True)
    hours.tau_hours_plot(p, data.hours)
    ax = p.drawn[-1].axes[0]
    assert ax.get_xlabel() == "GPU-hours" and ax.get_ylabel() == "exact tau"
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
             for line in ax.get_lines()}
    assert lines["exact tau, held-out"] == ([2.0, 4.0], [2.0, 3.0])
    assert lines["exact tau, gsm8k"] == ([4.0], [2.5])
    assert lines["best checkpoint (step 10)"] == ([2.0], [2.0])


def test_the_page_says_the_cost_to_the_best_checkpoint_and_to_the_end():
    page = report.render_html(_data(costed_run(price=2.0)))
    assert 'href="#cost"' in page and '<h2 id="cost">' in page
    assert ("To the best checkpoint (step 10, exact tau 2.0000, runs/x/checkpoints/step-10): "
            "2 GPU-hours (target 0.5, drafter 1.5), 4.00 USD at 2 USD/GPU-hour.") in page
    assert ("To the end (step 30): 6 GPU-hours (target 1.5, drafter 4.5), 12.00 USD at 2 "
            "USD/GPU-hour; 0.5 GPU-hours more held by earlier segments no checkpoint kept.") in page
    assert page.count("exact tau against the device time") == 1  # the plot's title


def test_without_a_price_only_hours_and_a_running_run_says_so_far():
    events = costed_run(price=0.0)[:-3]  # no end figure, no end: still running
    page = report.render_html(_data(events))
    assert "So far (step 20): 4 GPU-hours (target 1, drafter 3)." in page
    assert "USD" not in page.split('<h2 id="cost">')[1].split("<h2")[0]


def test_a_cpu_run_plots_host_hours():
    events = sc.training(steps=10) + [
        ev.DeviceHours(step=10, host_target=0.01, host_drafter=0.01, devices=1, reason="eval",
                       ts=sc.T0 + 500),
        ev.EvalResult(step=10, tau=1.5, acceptance=[1], prompts=2, ts=sc.T0 + 501)]
    data = _data(events)
    p = plots.Plots(keep=True)
    hours.tau_hours_plot(p, data.hours)
    assert p.drawn[-1].axes[0].get_xlabel().startswith("host-hours")
    assert "0.02 host-hours on the CPU (target 0.01, drafter 0.01; 0 GPU-hours)" in \
        report.render_html(data)


def test_an_events_file_written_before_device_hours_replays(tmp_path):
    # an older run's file: no DeviceHours lines at all
    report_dir = tmp_path / "old"
    report_dir.mkdir()
    with open(report_dir / "events.jsonl", "w", encoding="utf-8") as f:
        for e in sc.failed():
            f.write(e.to_json() + "\n")
    page = report.write_report(report_dir).read_text(encoding="utf-8")
    assert "No device time recorded" in page
    assert "2.8700" in page  # the rest of the page as before


@pytest.mark.parametrize("reason", ["periodic", "checkpoint"])
def test_a_figure_not_taken_at_an_evaluation_pairs_with_none(reason):
    events = sc.training(steps=5) + [
        _hours(5, 1.0, reason, 400),
        ev.EvalResult(step=5, tau=1.5, acceptance=[1], prompts=2, ts=sc.T0 + 401)]
    assert len(_data(events).hours.points) == 0
