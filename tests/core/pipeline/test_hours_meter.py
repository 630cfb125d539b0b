"""The device-time accounting (pipeline/hours_meter.py) with an injected clock: each device's
time split among the roles on it, several nodes, a resume going on from its checkpoint's figure,
the time a crash loses, and a CPU run's host-hours."""

import pytest

from dflash_core.observe.device_hours import Figure, figure_text, short_text, table_cells
from dflash_core.persist.hours_ledger import read_held, write_held
from dflash_core.pipeline.hours_meter import PERIOD_S, HoursMeter, role_devices


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def hours(self, h: float) -> None:
        self.t += 3600.0 * h


def meter(targets, drafters, clock, **kw) -> HoursMeter:
    return HoursMeter(targets, drafters, started_at=clock(), clock=clock, **kw)


def test_separate_gpus_count_each_for_its_role():
    clock = Clock()
    m = meter(["cuda:0", "cuda:1"], ["cuda:2", "cuda:3", "cuda:4", "cuda:5"], clock)
    clock.hours(2.0)
    f = m.figure()
    assert (f.gpu_target, f.gpu_drafter) == pytest.approx((4.0, 8.0))
    assert f.host == 0 and m.devices == 6


def test_a_shared_gpu_is_split_equally_between_the_roles_on_it():
    clock = Clock()
    # GPU 0 holds a target and a drafter, GPU 1 a drafter alone
    m = meter(["cuda:0"], ["cuda:0", "cuda:1"], clock)
    clock.hours(1.0)
    f = m.figure()
    assert (f.gpu_target, f.gpu_drafter) == pytest.approx((0.5, 1.5))
    assert f.gpu == pytest.approx(2.0)  # two GPUs held an hour: never more, never less
    assert m.devices == 2


def test_several_nodes_count_every_nodes_gpus():
    clock = Clock()
    m = meter(["cuda:0"], ["cuda:1", "cuda:2"], clock, nodes=4)
    clock.hours(0.5)
    assert (m.figure().gpu_target, m.figure().gpu_drafter) == pytest.approx((2.0, 4.0))
    assert m.devices == 12


def test_a_cpu_run_counts_the_host_once_and_no_gpu_hours():
    clock = Clock()
    m = meter(["cpu", "cpu"], ["cpu", "cpu", "cpu", "cpu"], clock, price=3.0, currency="USD")
    clock.hours(3.0)
    f = m.figure()
    assert f.gpu == 0
    assert (f.host_target, f.host_drafter) == pytest.approx((1.0, 2.0))  # 2 of 6 workers
    assert f.money is None  # the price is per GPU-hour
    assert "host-hours on the CPU" in figure_text(f) and "0 GPU-hours" in figure_text(f)
    assert short_text(f) == "3 host-h (CPU)"
    assert table_cells(f) == ("0 (CPU 3 h)", "-")


def test_the_price_makes_money_of_gpu_hours():
    clock = Clock()
    m = meter(["cuda:0"], ["cuda:1"], clock, price=2.5, currency="EUR")
    clock.hours(1.5)
    f = m.figure()
    assert f.money == pytest.approx(7.5)
    assert table_cells(f) == ("3", "7.50 EUR")
    assert short_text(f) == "3 GPU-h 7.50 EUR"
    assert figure_text(f).startswith("3 GPU-hours (target 1.5, drafter 1.5), 7.50 EUR at 2.5 EUR")


def test_a_resume_goes_on_from_its_checkpoints_figure_and_says_what_a_crash_lost():
    clock = Clock()
    first = meter(["cuda:0"], ["cuda:1"], clock)
    clock.hours(1.0)
    record = first.figure().record()  # a checkpoint written after one hour
    clock.hours(0.25)  # then a crash a quarter of an hour later
    held = first.held()
    assert held == pytest.approx((2.5, 0.0))  # what the run folder's record keeps

    clock.hours(5.0)  # the node stood idle: nobody held it for the run
    second = meter(["cuda:0"], ["cuda:1"], clock, held_before=held)
    assert second.resume_from(record, step=300)
    assert second.figure().gpu == pytest.approx(2.0)  # the checkpoint's, not the idle time
    assert second.lost() == pytest.approx((0.5, 0.0))  # the crashed quarter hour on 2 GPUs
    clock.hours(1.0)
    f = second.figure()
    assert (f.gpu_target, f.gpu_drafter) == pytest.approx((2.0, 2.0))
    assert second.held() == pytest.approx((4.5, 0.0))
    assert second.event(301, "end").lost_gpu == pytest.approx(0.5)


def test_a_checkpoint_without_a_figure_starts_the_count_at_its_step():
    clock = Clock()
    m = meter(["cuda:0"], ["cuda:1"], clock)
    assert not m.resume_from(None, step=120)
    clock.hours(1.0)
    e = m.event(125)
    assert e.since_step == 120 and e.gpu_hours == pytest.approx(2.0)
    assert "counted from step 120" in figure_text(Figure.of_event(e))


def test_a_record_round_trips_and_a_bad_one_reads_as_none():
    f = Figure(1.0, 2.0, 0.0, 0.0, since_step=3, price=2.0, currency="USD")
    assert Figure.from_record(f.record()) == f
    assert Figure.from_record({"gpu_target": "many"}) is None
    assert Figure.from_record("1.0") is None


def test_periodic_events_come_at_most_once_a_period():
    clock = Clock()
    m = meter(["cuda:0"], ["cuda:1"], clock)
    assert m.due()
    m.event(0)
    clock.t += PERIOD_S - 1
    assert not m.due()
    clock.t += 1
    assert m.due()


def test_role_devices_counts_each_device_once():
    f = role_devices(["cuda:0", "cuda:1"], ["cuda:1", "cuda:2"])
    assert (f.gpu_target, f.gpu_drafter) == pytest.approx((1.5, 1.5))


def test_the_run_folder_record_reads_back_and_missing_reads_as_nothing(tmp_path):
    assert read_held(tmp_path) == (0.0, 0.0)
    write_held(tmp_path, 1.25, 0.5, step=7)
    assert read_held(tmp_path) == (1.25, 0.5)
    (tmp_path / "device_hours.json").write_text("{not json")
    assert read_held(tmp_path) == (0.0, 0.0)
