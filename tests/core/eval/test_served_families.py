"""Which family vLLM serves where (eval --engine vllm): refused before anything loads, one line
naming why, for the families its CPU build cannot run."""

from types import SimpleNamespace

import pytest
import torch

from dflash_core.eval import served
from dflash_core.eval.errors import EvalInputError


def spec(objective: str):
    return SimpleNamespace(objective=objective, label=f"{objective}-drafter", path="x",
                           block_size=8)


@pytest.mark.parametrize("objective, fragment", [
    ("dspark", "V1 model runner does not support dspark"),
    ("dflash2", "V1 model runner refuses DFlash candidate-head drafts"),
])
def test_families_vllm_cannot_run_on_the_cpu_are_named(objective, fragment):
    with pytest.raises(EvalInputError) as err:
        served.check_servable([spec("dflash"), spec(objective)], torch.device("cpu"))
    assert fragment in str(err.value) and f"{objective}-drafter" in str(err.value)
    assert "GPU node" in err.value.hint and "\n" not in str(err.value)


def test_on_a_gpu_each_family_gets_its_method_and_count():
    served.check_servable([spec("dflash"), spec("dspark"), spec("dflash2")],
                          torch.device("cuda", 0))  # no refusal: vLLM's GPU runner serves them
    assert served.speculative_config(spec("dflash2"))["method"] == "dflash"
    assert served.speculative_config(spec("dflash2"))["num_speculative_tokens"] == 7  # B - 1
    assert served.speculative_config(spec("dspark"))["num_speculative_tokens"] == 8  # B
