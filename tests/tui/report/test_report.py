"""``dflash-tui report``: the run's events.jsonl becomes one self-contained HTML page."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tracemalloc

import pytest

from dflash_core.observe import events as ev
from dflash_tui import report
from dflash_tui.cli import main

import tui_scenarios as sc

CONFIG = {"run": {"name": "qwen36-dflash", "max_steps": 6000},
          "data": {"token_budget": 65536, "paths": ["shards/train-*.parquet"]},
          "drafter": {"block_size": 16, "layers": 5}}


def with_config(events: list[ev.Event], config=CONFIG, name: str | None = None) -> list[ev.Event]:
    out = []
    for e in events:
        if isinstance(e, ev.RunStarted):
            e = dataclasses.replace(e, config=config, run_name=name or e.run_name)
        out.append(e)
    return out


def write_events(path, events, tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for e in events:
            f.write(e.to_json() + "\n")
        f.write(tail)


def assert_self_contained(page: str) -> None:
    assert page.count("<html") == 1
    for loads in ("<script", "<link", "<iframe", "<img", "@import", " src="):
        assert loads not in page.lower(), loads
    assert not re.search(r"url\((?!#)", page)  # only the SVGs' own clip paths: url(#id)
    ids = re.findall(r'\sid="([^"]+)"', page)
    assert len(ids) == len(set(ids))  # several SVGs on one page: no id defined twice
    assert not re.search(r"""(href|src)\s*=\s*["']?\s*(https?:)?//""", page)
    assert not re.search(r"https?://", page)  # not even the SVG namespace URLs


def test_failed_run(tmp_path):
    run_dir = tmp_path / "qwen36-dflash"
    write_events(run_dir / "events.jsonl", with_config(sc.failed()))
    out = report.write_report(run_dir)
    assert out == run_dir / "report.html"
    assert sorted(p.name for p in run_dir.iterdir()) == ["events.jsonl", "report.html"]
    page = out.read_text(encoding="utf-8")
    assert_self_contained(page)
    assert page.count("<svg") >= 6  # loss, tau, samples/s, queues, memory, timeline, acceptance
    assert "qwen36-dflash" in page
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 29.61 GiB" in page
    assert "lower data.token_budget in config.yaml" in page  # the hint
    assert "target-3" in page
    assert "failed" in page
    assert "2.8700" in page  # the exact tau of the evaluation
    assert "token_budget: 65536" in page and "block_size: 16" in page  # the resolved config
    assert "shards/train-*.parquet" in page
    assert "prefetch-0" in page and "hs (capacity 8)" in page  # queue legends
    assert "GPU 7" in page  # per-GPU memory plots


def test_acceptance_and_exact_tau_values(tmp_path):
    events = sc.training(steps=30)
    t = events[-1].ts
    events += [ev.EvalResult(step=40, tau=3.14159, acceptance=[5, 7, 11, 13, 17], prompts=16,
                             ts=t + 10),
               ev.EvalResult(step=50, tau=3.5, acceptance=[2, 3, 4, 19, 23, 29], prompts=16,
                             tau_tf_target=3.75, tau_tf_target_all=4.5, tau_tf_heldout=4.25,
                             tau_tf_train=6.125, agreement=0.4, agreement_positions=512,
                             findings=["data", "overfit"], ts=t + 20)]
    write_events(tmp_path / "events.jsonl", events)
    data = report.read_run(tmp_path)
    assert [(s, tau) for _, s, tau, _ in data.evals.items()] == [(30, 2.87), (40, 3.14159),
                                                                  (50, 3.5)]
    assert data.last_eval.acceptance == [2, 3, 4, 19, 23, 29]
    page = report.render_html(data)
    assert "3.1416" in page and "2.8700" in page and "3.5000" in page
    # the acceptance table is the latest evaluation's
    assert "<td>29</td>" in page and "<td>17</td>" not in page
    # the measures of acceptance, in the words of every view
    for label, value in (("tau exact", "3.50"), ("tf target", "3.75"), ("tf held-out", "4.25"),
                         ("tf train", "6.12"), ("labels = target", "40.0% of 512"),
                         ("findings", "data, overfit")):
        assert f"<td>{label}</td><td>{value}</td>" in page, label
    assert "<td>tf target (every position)</td><td>4.50</td>" in page


def test_last_of_two_runs_and_a_torn_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    first = with_config(sc.failed(), {"run": {"name": "first-try"}}, name="first-try")
    second = with_config(sc.node_2_6(), {"run": {"name": "second-try"}}, name="second-try")
    torn = ev.StepMetrics(step=21, epoch=0, loss=1.0, lr=1e-4, grad_norm=1.0, tokens_per_s=1.0,
                          samples_per_s=1.0, tau_tf=2.0, ts=second[-1].ts + 1).to_json()
    write_events(path, first)
    write_events(path, second, tail=torn[: len(torn) // 2])  # the writer was killed mid-line
    data = report.read_run(tmp_path)
    assert data.run_name == "second-try"
    assert data.unreadable == 1
    assert data.errors.count == 0  # the first run's OOM is not this run's
    assert data.last_step.step == 20
    assert data.loss.count == 20
    assert sorted(data.gpus) == list(range(8))
    page = report.render_html(data)
    assert_self_contained(page)
    assert "second-try" in page and "first-try" not in page
    assert "Tried to allocate" not in page
    assert "1 unreadable lines skipped" in page
    assert "still running" in page  # no end recorded


def test_stalls_cleared_and_not(tmp_path):
    events = sc.training(steps=10)
    t = events[-1].ts
    events += [
        ev.Stall(worker="drafter-0", phase="running", seconds=120, where="compiling: flex",
                 stack="...", ts=t + 1),
        ev.Stall(worker="drafter-0", phase="running", seconds=0, where="", stack="", cleared=True,
                 ts=t + 30),
        ev.Stall(worker="target-5", phase="running", seconds=300, where="nccl wait",
                 stack="...", ts=t + 40),
        ev.Error(error_kind="io", source="wandb", message="wandb <upload> failed", fatal=False,
                 ts=t + 41),
    ]
    write_events(tmp_path / "events.jsonl", events)
    data = report.read_run(tmp_path)
    assert [(s.worker, c is not None) for s, c in data.stalls.items()] == [
        ("drafter-0", True), ("target-5", False)]
    page = report.render_html(data)
    assert "NOT CLEARED" in page and "after 0m 29s" in page
    assert "nccl wait" in page
    assert "wandb &lt;upload&gt; failed" in page  # escaped, not markup


def test_series_keeps_at_most_cap():
    mean = report.Series(cap=100)
    exact = report.Series(cap=100, mean=False)
    for i in range(100_003):
        mean.add(float(i), float(i))
        exact.add(float(i), float(i))
    for s in (mean, exact):
        xs, ys = s.points()
        assert 50 <= len(xs) <= 100 and len(xs) == len(ys) == len(s)
        assert xs == sorted(xs)
        assert s.count == 100_003
    assert set(exact.points()[1]) <= set(range(100_003))  # exact values, never averaged
    assert exact.points()[0][0] == 0.0
    # the mean keeps the whole run's shape: the last point is near the end
    assert mean.points()[0][-1] > 99_000
    nan = report.Series(cap=10)
    nan.add(0.0, float("nan"))
    assert nan.nonfinite == 1 and len(nan) == 0


@pytest.mark.parametrize("steps", [15_000, pytest.param(60_000, marks=pytest.mark.slow)])
def test_streaming_a_long_run_stays_bounded(tmp_path, steps):
    """60k steps (and a queue sample each, ~17 MB; 15k in the quick suite): series keep at most
    the cap, and reading holds no more than a few MB whatever the file's size (a 200k-step, 57
    MB file measured the same)."""
    path = tmp_path / "events.jsonl"
    start = sc.start()
    with open(path, "w", encoding="utf-8") as f:
        for e in start:
            f.write(e.to_json() + "\n")
        t0 = sc.T0 + 10
        # lines as the JSONL sink writes them (to_json), with the fields of each step filled in
        queue = ev.QueueDepth(name="hs", depth=0, capacity=8, ts=t0).to_dict()
        step = ev.StepMetrics(step=0, epoch=0, loss=0.0, lr=1e-4, grad_norm=1.0, tokens_per_s=1.0,
                              samples_per_s=3.0, tau_tf=2.0, ts=t0).to_dict()
        evaluation = ev.EvalResult(step=0, tau=0.0, acceptance=[1, 2], prompts=4,
                                   ts=t0).to_dict()
        for s in range(1, steps + 1):
            t = t0 + s * 2.0
            f.write(json.dumps(dict(queue, depth=s % 9, ts=t), separators=(",", ":")) + "\n")
            f.write(json.dumps(dict(step, step=s, loss=10.0 / s, ts=t), separators=(",", ":"))
                    + "\n")
            if s % 1000 == 0:
                f.write(json.dumps(dict(evaluation, step=s, tau=2.0 + s / 1e6, ts=t),
                                   separators=(",", ":")) + "\n")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        data = report.read_run(tmp_path, cap=2000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size > steps * 260  # ~290 bytes a step
    assert peak < 8 * 2**20, peak
    assert data.loss.count == steps and data.last_step.step == steps
    for series in (data.loss, data.tau_tf, data.samples_per_s, data.step_at, data.queues["hs"]):
        assert len(series) <= 2000
    assert len(data.evals) == steps // 1000  # evaluations exact
    assert data.evals.items()[-1][2] == 2.0 + steps / 1e6
    page = report.render_html(data)
    assert_self_contained(page)
    assert len(page) < 1_500_000
    assert "thinned to at most 2000 points" in page


def test_cli_report(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "qwen36-dflash"
    write_events(run_dir / "events.jsonl", with_config(sc.aborted()))
    assert main(["report", str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "aborted" in page and "qwen36-dflash" in page
    assert "report.html" in capsys.readouterr().out
    other = tmp_path / "elsewhere.html"
    assert main(["report", str(run_dir), "--out", str(other)]) == 0
    assert other.read_text(encoding="utf-8").count("<svg") >= 5


def test_cli_report_without_events(tmp_path, capsys):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "events.jsonl does not exist" in err
    assert not (empty / "report.html").exists()


def test_cli_flags_still_parse():
    from dflash_tui.cli import parse_args

    args = parse_args(["--attach", "runs/x"])
    assert args.verb == "attach" and str(args.run_dir) == "runs/x"
    with pytest.raises(SystemExit):
        main(["--no-such-flag"])


def test_the_dashboard_does_not_import_matplotlib():
    code = ("import sys, dflash_tui.app, dflash_tui.cli, dflash_tui.report; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_report_reads_only_the_kinds_it_folds():
    # the page's events; host samples, worker phases and logs are passed over unparsed
    assert report.RunData.kinds() == {
        "RunStarted", "StateChanged", "StepMetrics", "EvalResult", "GpuSample", "QueueDepth",
        "MemoryPlan", "Checkpoint", "Error", "Stall", "RunEnded", "DeviceHours"}


# -- what the page says is true (log-scale loss, step axis, integer depths, CPU plan, endings) --
def _data(events) -> "report.RunData":
    data = report.RunData()
    for e in events:
        data.feed(e)
    return data


def _figure_of(draw, data):
    from dflash_tui.report import plots

    p = plots.Plots(keep=True)
    t0 = data.t0 or 0.0
    draw(p, data, plots.Clock(t0, data.last_ts or t0))
    return p.drawn[-1]


def _step(s, loss, ts):
    return ev.StepMetrics(step=s, epoch=0, loss=loss, lr=1e-4, grad_norm=1.0, tokens_per_s=1.0,
                          samples_per_s=3.0, tau_tf=2.0, ts=ts)


def test_a_loss_that_falls_far_is_on_a_log_scale():
    from dflash_tui.report import plots

    falls = _data(sc.start() + [_step(s, 39.0 if s == 1 else 1.0 + 1.5 / s, sc.T0 + 10 + s)
                                for s in range(1, 200)])
    flat = _data(sc.start() + [_step(s, 2.0 + 0.1 * (s % 3), sc.T0 + 10 + s) for s in range(1, 50)])

    def loss(p, data, clock):
        return plots.line_plot(p, data, clock, data.loss, "loss", "loss", "tab:blue", log=True)

    ax = _figure_of(loss, falls).axes[0]
    assert ax.get_yscale() == "log"
    assert "(log scale)" in ax.get_title(loc="left")
    lo, hi = ax.get_ylim()
    shown = [t for t in ax.get_yticks() if lo <= t <= hi]
    assert {1.0, 2.0, 5.0, 10.0, 20.0} <= set(shown)  # the useful range has labels of its own
    assert _figure_of(loss, flat).axes[0].get_yscale() == "linear"  # nothing to spread out
    page = report.render_html(falls)
    assert "training loss per step (log scale)" in page


def test_the_step_axis_names_each_evaluation_under_its_point():
    from dflash_tui.report import plots

    events = sc.start()
    t = sc.T0 + 100
    for s in range(1, 301):
        t += 2.0 if s < 100 else 3.0  # steps come at two speeds: time and step are not linear
        events.append(_step(s, 2.0, t))
        if s % 50 == 0:  # each evaluation ends a while after its step
            events.append(ev.EvalResult(step=s, tau=2.0, acceptance=[1], prompts=4, ts=t + 40))
    data = _data(events)
    clock = plots.Clock(data.t0, data.last_ts)
    at_step = plots.step_positions(data, clock)
    for s in (50, 150, 300):  # the x at which the run reached step s
        reached = next(e.ts for e in events if isinstance(e, ev.StepMetrics) and e.step == s)
        assert at_step(s) == pytest.approx(clock([reached])[0])

    fig = _figure_of(plots.tau_plot, data)
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    ticks = plots.step_ticks(data, at_step, lo, hi)
    assert {s for _, s, is_eval in ticks if is_eval} == {50, 100, 150, 200, 250, 300}
    xs = [x for x, _, _ in ticks]
    assert xs == sorted(xs) and [s for _, s, _ in ticks] == sorted(s for _, s, _ in ticks)
    assert min(b - a for a, b in zip(xs, xs[1:])) >= plots.MIN_TICK_GAP * (hi - lo)
    # the red exact-tau points stand where their steps are named
    points = next(line for line in ax.get_lines() if line.get_marker() == "o")
    assert list(points.get_xdata()) == pytest.approx([at_step(s) for s in range(50, 301, 50)])
    (top,) = ax.child_axes  # the secondary step axis
    labels = {lab.get_text(): lab.get_color() for lab in top.get_xticklabels()}
    assert labels["150"] == plots.EVAL_COLOR

    # many evaluations close together: thinned, the latest kept, never crowding the edge
    dense = _data(sc.start() + [e for s in range(1, 401) for e in (
        _step(s, 2.0, sc.T0 + 100 + s),
        ev.EvalResult(step=s, tau=2.0, acceptance=[1], prompts=4, ts=sc.T0 + 100 + s))])
    clock = plots.Clock(dense.t0, dense.last_ts)
    at_step = plots.step_positions(dense, clock)
    lo, hi = at_step(1), at_step(400)
    ticks = plots.step_ticks(dense, at_step, lo, hi)
    assert 5 <= len(ticks) <= 1 / plots.MIN_TICK_GAP + 1
    assert ticks[-1][1] == 400
    xs = [x for x, _, _ in ticks]
    assert min(b - a for a, b in zip(xs, xs[1:])) >= plots.MIN_TICK_GAP * (hi - lo) - 1e-9


def test_queue_depths_and_histogram_counts_have_integer_ticks():
    from dflash_tui.report import plots

    events = sc.start() + [ev.QueueDepth(name="prefetch-0", depth=3 + (s % 2), capacity=4,
                                         ts=sc.T0 + 10 + s) for s in range(40)]
    data = _data(events)
    axes = _figure_of(plots.queue_plot, data).axes
    assert axes
    for ax in axes:
        lo, hi = ax.get_ylim()
        shown = [t for t in ax.get_yticks() if lo <= t <= hi]
        assert len(shown) >= 2 and all(float(t).is_integer() for t in shown), shown
    p = plots.Plots(keep=True)
    plots.acceptance_plot(p, ev.EvalResult(step=1, tau=1.0, acceptance=[3, 1, 2], prompts=1))
    ax = p.drawn[-1].axes[0]
    lo, hi = ax.get_ylim()
    assert all(float(t).is_integer() for t in ax.get_yticks() if lo <= t <= hi)


def test_a_cpu_plan_is_not_said_to_fit_a_card():
    cpu = ev.MemoryPlan(rows=[{"device": "cpu", "role": "target+drafter", "components": {},
                               "total": 132_732_416, "free": None, "fits": True}], ts=sc.T0 + 1)
    page = report.render_html(_data(sc.start()[:1] + [cpu]))
    plan = page[page.index("Memory plan"):page.index('id="errors"')]
    assert "<td>not checked</td>" in plan
    assert "<td>0.0</td>" not in plan and "True" not in plan
    assert "On the CPU the plan is not checked against a card" in plan
    gpu = report.render_html(_data(sc.start()))  # the fixture's plan: 71 of 139 GiB free, fits
    plan = gpu[gpu.index("Memory plan"):gpu.index('id="errors"')]
    assert "<td>yes</td>" in plan and "not checked" not in plan


def test_a_finished_run_says_it_has_no_errors_and_an_ended_one_how_it_ended():
    trained = sc.training(steps=10)
    t = trained[-1].ts
    finished = trained + [
        ev.StateChanged(state="finished", previous="training", ts=t + 1),
        ev.RunEnded(status="finished", step=10, seconds=t + 1 - sc.T0, ts=t + 1)]
    page = report.render_html(_data(finished))
    assert "No errors or stalls in this run.</p>" in page
    assert "in this run yet" not in page
    assert "Finished at step 10 of 6000 after 2m 21s." in page

    page = report.render_html(_data(with_config(sc.aborted())))
    assert "Aborted at step 60" in page and ": operator." in page
    assert "No errors or stalls were recorded. Aborted at step 60" in page
    page = report.render_html(_data(with_config(sc.failed())))
    assert "Failed at step 60" in page and "target-3: out of memory." in page

    running = report.render_html(_data(trained))  # no end yet: it may still have some
    assert "No errors or stalls in this run yet." in running
    assert "Finished at" not in running


def test_the_summary_names_the_training_recipe(tmp_path):
    recipes = {"dflash-adamw": ({"loss": "dflash", "gamma": 7}, {"name": "adamw", "lr": 6e-4},
                                "loss dflash (gamma 7); optimizer adamw (lr 0.0006)"),
               "dpace-muon": ({"loss": "dpace", "dpace_alpha": 0.5},
                              {"name": "muon", "lr": 6e-4, "muon_lr": 0},
                              "loss dpace (alpha 0.5; its loss figures are D-PACE-weighted")}
    for name, (drafter, optim, said) in recipes.items():
        run_dir = tmp_path / name
        write_events(run_dir / "events.jsonl",
                     with_config(sc.training(steps=5), {"drafter": drafter, "optim": optim}))
        page = report.write_report(run_dir).read_text(encoding="utf-8")
        row = re.search(r"<tr><th>training recipe</th><td>(.*?)</td></tr>", page).group(1)
        assert said in row, row
    assert "optimizer muon (muon_lr 0.0006, AdamW lr 0.0006 on the norms)" in row
    from dflash_core.config import recipe_text
    assert recipe_text({}) == "" and recipe_text({"optim": 3}) == ""
