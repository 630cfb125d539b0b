"""cost.*: a price per GPU-hour, off by default; a negative price is one line, exit 2."""

import pytest

from dflash_core.config import ConfigError, config_from_dict
from dflash_tui.cli import main


def test_the_price_is_off_by_default_and_taken_when_given():
    assert config_from_dict({}).cost.gpu_hour_price == 0.0
    cfg = config_from_dict({"cost": {"gpu_hour_price": 2.5, "currency": "EUR"}})
    assert (cfg.cost.gpu_hour_price, cfg.cost.currency) == (2.5, "EUR")


@pytest.mark.parametrize("price, said", [(-1, "must be >= 0"), (-0.01, "must be >= 0"),
                                         (float("nan"), "expected a finite number"),
                                         (float("inf"), "expected a finite number")])
def test_a_negative_or_not_finite_price_is_refused_naming_the_key(price, said):
    with pytest.raises(ConfigError) as got:
        config_from_dict({"cost": {"gpu_hour_price": price}})
    assert str(got.value).startswith(f"cost.gpu_hour_price: {said}, got ")
    assert "\n" not in str(got.value)


@pytest.mark.parametrize("how", ["config", "--set"])
def test_a_negative_price_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, how):
    out = tmp_path / "runs"
    if how == "config":
        path = tmp_path / "c.yaml"
        path.write_text(f"run:\n  output_dir: {out}\ncost:\n  gpu_hour_price: -3\n")
        argv = ["run", "--headless", "--config", str(path)]
    else:
        argv = ["demo", "--headless", "--device", "cpu", "--output-dir", str(out),
                "--set", "cost.gpu_hour_price=-3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("config error: cost.gpu_hour_price: must be >= 0, got -3.0")
    assert lines[1].startswith("hint: set cost.gpu_hour_price to a value >= 0")
    assert "Traceback" not in err and not out.exists()
