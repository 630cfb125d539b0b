"""The demo's target and data builds report through the event stream: a BuildProgress at each
new whole percent (what the dashboard shows) and a Log line every 10% (train.log)."""

import pytest

from dflash_core import demo
from dflash_core.observe.events import BuildProgress, Log
from dflash_core.planning.preflight import demo_log_progress


def build_events(reports):
    published = []
    progress = demo_log_progress(published.append, lambda: None)("demo target")
    for fraction, message in reports:
        progress(fraction, message)
    return published


def test_a_build_publishes_its_progress_per_percent_and_a_log_line_per_ten():
    # As tiny_target reports: a start, every 10 of its 600 steps, then ready.
    reports = ([(0.0, "training the demo target (600 steps)")]
               + [(0.95 * s / 600, f"demo target step {s}/600, loss 2.10")
                  for s in range(10, 601, 10)]
               + [(1.0, "demo target ready (loss 2.00)")])
    published = build_events(reports)
    built = [e for e in published if isinstance(e, BuildProgress)]
    logs = [e for e in published if isinstance(e, Log)]
    assert all(e.what == "demo target" for e in built)
    percents = [int(100 * e.fraction) for e in built]
    assert percents == sorted(set(percents))  # each whole percent once, in order
    assert len(built) == 62  # the start, each of the 60 reports (each moves a percent), ready
    assert built[0].message == "training the demo target (600 steps)"
    assert not built[0].done and built[-1].done
    at_240 = next(e for e in built if e.message.startswith("demo target step 240/600"))
    assert at_240.fraction == pytest.approx(0.38)
    assert 10 <= len(logs) <= 12 and logs[-1].message == "demo target: 100% demo target ready " \
        "(loss 2.00)"


def test_a_stop_request_during_the_build_ends_it_before_anything_is_published():
    class Stopped(Exception):
        pass

    def stop():
        raise Stopped

    published = []
    progress = demo_log_progress(published.append, stop)("demo target")
    with pytest.raises(Stopped):
        progress(0.5, "demo target step 300/600")
    assert published == []


@pytest.mark.slow
def test_the_real_build_reports_through_it(tmp_path):
    """A short build of the tiny target (20 steps, its own cache key) into a fresh cache."""
    published = []
    demo.ensure_tiny_target(tmp_path, demo_log_progress(published.append, lambda: None)(
        "demo target"), steps=20)
    built = [e for e in published if isinstance(e, BuildProgress)]
    assert built and built[-1].done
    assert any("step 10/20" in e.message for e in built)
