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


def test_streaming_a_long_run_stays_bounded(tmp_path):
    """60k steps (and a queue sample each, ~17 MB): series keep at most the cap, and reading
    holds no more than a few MB whatever the file's size (a 200k-step, 57 MB file measured the
    same; smaller here to keep the suite quick)."""
    path = tmp_path / "events.jsonl"
    steps = 60_000
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
    assert size > 15 * 2**20
    assert peak < 8 * 2**20, peak
    assert data.loss.count == steps and data.last_step.step == steps
    for series in (data.loss, data.tau_tf, data.samples_per_s, data.step_at, data.queues["hs"]):
        assert len(series) <= 2000
    assert len(data.evals) == 60 and data.evals.items()[-1][2] == 2.06  # evaluations exact
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
    from dflash_tui.cli import build_parser

    args = build_parser().parse_args(["--attach", "runs/x"])
    assert str(args.attach) == "runs/x"
    with pytest.raises(SystemExit):
        main(["--no-such-flag"])


def test_the_dashboard_does_not_import_matplotlib():
    code = ("import sys, dflash_tui.app, dflash_tui.cli, dflash_tui.report; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
