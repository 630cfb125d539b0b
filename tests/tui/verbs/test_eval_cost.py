"""`dflash-tui eval`'s cost rows: a run's checkpoint shows the device time it recorded (money
with a price, the run folder's config.yaml pricing it when the checkpoint has none), a
downloaded drafter "-"; the results JSON has them too."""

import json
import shutil

from dflash_core.observe.device_hours import Figure
from dflash_tui.cli import main
from tests.core.eval.conftest import (  # noqa: F401  (fixtures)
    demo_eval, demo_hf_config, module_thread, one_thread,
)


def run_checkpoint(src, run, step, figure: Figure, price_in_config: float = 0.0):
    """``src``'s drafter as a run's checkpoint folder that recorded ``figure``."""
    folder = run / "checkpoints" / f"step-{step}"
    shutil.copytree(src, folder)
    (folder / "training_state.json").write_text(json.dumps(
        {"format": 3, "step": step, "trainer": {"epoch": 0, "device_hours": figure.record()}}))
    (run / "config.yaml").write_text(f"cost:\n  gpu_hour_price: {price_in_config}\n"
                                     "  currency: EUR\n")
    return folder


def _args(demo_eval, out, drafters):
    args = ["eval", "--target", str(demo_eval["target"]), "--device", "cpu", "--out", str(out),
            "--max-new-tokens", "8", "--batch", "2", "--limit", "2",
            "--prompts", f"plain={demo_eval['sets']['plain']}"]
    for d in drafters:
        args += ["--drafter", str(d)]
    return args


def rows(out: str, name: str) -> list[list[str]]:
    return [line.split("  ") for line in out.splitlines() if line.startswith(name)]


def test_a_run_checkpoint_shows_its_cost_and_a_downloaded_drafter_a_dash(demo_eval, tmp_path,
                                                                           capsys):
    gpu = run_checkpoint(demo_eval["drafters"][0], tmp_path / "runs" / "q8b", 300,
                         Figure(gpu_target=1.5, gpu_drafter=4.5, price=2.0, currency="USD"))
    cpu = run_checkpoint(demo_eval["drafters"][0], tmp_path / "runs" / "demo", 100,
                         Figure(host_target=0.01, host_drafter=0.01))
    downloaded = demo_eval["drafters"][1]
    out = tmp_path / "out"
    assert main(_args(demo_eval, out, [gpu, cpu, downloaded])) == 0
    cap = capsys.readouterr().out
    head = next(line for line in cap.splitlines() if line.strip().startswith("plain"))
    assert head.split() == ["plain", "q8b/step-300", "demo/step-100", "d2"]
    hours = [c.strip() for c in rows(cap, "GPU-hours")[0] if c.strip()]
    cost = [c.strip() for c in rows(cap, "cost")[0] if c.strip()]
    assert hours == ["GPU-hours", "-", "6", "0 (CPU 0.02 h)", "-"]
    assert cost == ["cost", "-", "12.00 USD", "-", "-"]
    assert "q8b/step-300: 6 GPU-hours (target 1.5, drafter 4.5), 12.00 USD" in cap
    drafters = json.loads((out / "results.json").read_text())["drafters"]
    assert drafters["q8b/step-300"]["device_hours"]["gpu_drafter"] == 4.5
    assert drafters["q8b/step-300"]["cost"] == 12.0
    assert drafters["demo/step-100"]["device_hours"]["host_target"] == 0.01
    assert drafters["demo/step-100"]["cost"] is None
    assert drafters["d2"]["device_hours"] is None and drafters["d2"]["cost"] is None


def test_a_price_set_after_the_run_prices_its_checkpoints(demo_eval, tmp_path, capsys):
    ck = run_checkpoint(demo_eval["drafters"][0], tmp_path / "runs" / "late", 50,
                        Figure(gpu_target=1.0, gpu_drafter=1.0), price_in_config=3.0)
    assert main(_args(demo_eval, tmp_path / "out", [ck])) == 0
    cost = [c.strip() for c in rows(capsys.readouterr().out, "cost")[0] if c.strip()]
    assert cost == ["cost", "-", "6.00 EUR"]


def test_gpu_hour_price_prices_every_run_checkpoint_at_one_price(demo_eval, tmp_path, capsys):
    # two runs that recorded different prices (2 USD; none, 3 EUR in its config) compared at 1.5
    a = run_checkpoint(demo_eval["drafters"][0], tmp_path / "runs" / "a", 300,
                       Figure(gpu_target=1.5, gpu_drafter=4.5, price=2.0, currency="USD"))
    b = run_checkpoint(demo_eval["drafters"][0], tmp_path / "runs" / "b", 50,
                       Figure(gpu_target=1.0, gpu_drafter=1.0), price_in_config=3.0)
    out = tmp_path / "out"
    args = _args(demo_eval, out, [a, b, demo_eval["drafters"][1]])
    assert main(args + ["--gpu-hour-price", "1.5", "--currency", "CHF"]) == 0
    cost = [c.strip() for c in rows(capsys.readouterr().out, "cost")[0] if c.strip()]
    assert cost == ["cost", "-", "9.00 CHF", "3.00 CHF", "-"]
    drafters = json.loads((out / "results.json").read_text())["drafters"]
    assert drafters["a/step-300"]["cost"] == 9.0 and drafters["b/step-50"]["cost"] == 3.0
    # a price is no decoding setting: the same folder continues, at the recorded prices again
    assert main(args) == 0
    cost = [c.strip() for c in rows(capsys.readouterr().out, "cost")[0] if c.strip()]
    assert cost == ["cost", "-", "12.00 USD", "6.00 EUR", "-"]


def test_a_negative_gpu_hour_price_is_refused(demo_eval, tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as exc:
        main(_args(demo_eval, tmp_path / "out", [demo_eval["drafters"][0]])
             + ["--gpu-hour-price", "-1"])
    assert exc.value.code == 2
    assert "--gpu-hour-price: must be >= 0, got -1" in capsys.readouterr().err
