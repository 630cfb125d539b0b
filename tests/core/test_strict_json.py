import json
import math

import pytest

from dflash_core import strict_json
from dflash_core.checkpoint.checksums import write_json


def _strict_load(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_null_at_any_depth_and_the_rest_is_kept():
    obj = {"loss": float("nan"), "price": float("inf"), "ok": 1.5, "n": 3,
           "rows": [{"tau": float("-inf")}, (2.0, float("nan"))], "s": "NaN"}
    back = _strict_load(strict_json.dumps(obj))
    assert back == {"loss": None, "price": None, "ok": 1.5, "n": 3,
                    "rows": [{"tau": None}, [2.0, None]], "s": "NaN"}


def test_a_checkpoint_json_with_a_non_finite_value_is_still_json(tmp_path):
    # training_state.json once carried cost.gpu_hour_price: .inf as Infinity.
    path = tmp_path / "training_state.json"
    write_json(path, {"cost": {"gpu_hour_price": math.inf}, "step": 4}, 1)
    assert _strict_load(path.read_text()) == {"cost": {"gpu_hour_price": None}, "step": 4}
    with pytest.raises(ValueError):
        _strict_load(json.dumps({"x": math.inf}))  # the reader used here does refuse Infinity
