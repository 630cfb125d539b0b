"""The split of a target copy over several GPUs, and what preflight refuses (one line each)."""

import dataclasses

import pytest

from dflash_core.config import ConfigError, config_from_dict
from dflash_core.models.target.shape import model_shape
from dflash_core.target_group import split as split_mod
from dflash_core.target_group.split import (
    SHARDED, SHARED, GroupSplit, check_split, check_transformers, copies,
)

from ..models.target.target_classes import TINY


def shape(name):
    return model_shape(TINY[name]().to_dict())


def test_each_mode_asks_transformers_for_its_split():
    assert GroupSplit(4, SHARDED, True).distributed(moe=True) == {
        "tp_size": 1, "fsdp_size": 4, "ep_size": 4}
    assert GroupSplit(4, SHARDED, True).distributed(moe=False) == {"tp_size": 1, "fsdp_size": 4}
    assert GroupSplit(2, SHARED, True).distributed(moe=True) == {"tp_size": 2, "ep_size": 2}
    assert GroupSplit(2, SHARED, True).distributed(moe=False) == {"tp_size": 2}
    # a sharded copy is k batch streams, a shared one a single stream
    assert GroupSplit(4, SHARDED, True).producers == 4
    assert GroupSplit(4, SHARED, True).producers == 1
    assert copies(list(range(8)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def layout(**target):
    return {"layout": {"device": "cuda", "targets": [0, 1, 2, 3], "drafters": [4]},
            "target": target}


@pytest.mark.parametrize("target, drafters, fragment", [
    ({"gpus_per_copy": 8}, [4], "a copy of 8 GPUs is larger than the 4 GPU(s)"),
    ({"gpus_per_copy": 3}, [4], "layout.targets lists 4 GPUs, not a whole number of copies of 3"),
])
def test_a_group_that_does_not_fit_the_gpus_listed_is_refused(target, drafters, fragment):
    data = layout(**target)
    data["layout"]["drafters"] = drafters
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert fragment in str(err.value) and err.value.hint


def test_one_gpu_per_copy_is_the_default_and_needs_nothing():
    cfg = config_from_dict({})
    assert cfg.target.gpus_per_copy == 1 and cfg.target.parallel == SHARDED


@pytest.mark.parametrize("split, name, key, fragment", [
    (GroupSplit(2, SHARED, False), "qwen3_moe", "target.expert_parallel",
     "tensor parallel alone leaves all 8 experts"),
    (GroupSplit(3, SHARDED, True), "qwen3_moe", "target.gpus_per_copy",
     "8 experts do not split evenly over 3 GPUs"),
    (GroupSplit(8, SHARED, True), "qwen3_moe", "target.gpus_per_copy",
     "the target's 4 attention heads do not divide by 8"),
])
def test_splits_transformers_cannot_make_are_refused(split, name, key, fragment):
    with pytest.raises(ConfigError) as err:
        check_split(split, shape(name), quant=None)
    assert err.value.key == key and fragment in err.value.message and err.value.hint
    assert "\n" not in str(err.value)


def test_a_quantized_target_other_than_fp8_in_a_group_is_refused():
    with pytest.raises(ConfigError) as err:
        check_split(GroupSplit(2, SHARDED, True), shape("gpt_oss"), quant="mxfp4")
    assert "quantized with mxfp4" in err.value.message and "FP8 block-wise" in err.value.hint
    check_split(GroupSplit(2, SHARDED, True), shape("qwen3_moe"), quant="fp8")


def test_splits_that_divide_pass():
    check_split(GroupSplit(2, SHARDED, True), shape("qwen3_moe"), quant=None)
    check_split(GroupSplit(2, SHARED, True), shape("deepseek_v3"), quant=None)
    check_transformers(GroupSplit(2, SHARED, True), True, "qwen3_moe")


def test_a_transformers_without_expert_parallel_is_named(monkeypatch):
    """transformers 5.17/5.18 have no ep_size: the split that needs it names the version."""
    from transformers.distributed import DistributedConfig

    old = dataclasses.make_dataclass("DistributedConfig", [
        (f.name, f.type, dataclasses.field(default=f.default))
        for f in dataclasses.fields(DistributedConfig) if f.name != "ep_size"])
    monkeypatch.setattr("transformers.distributed.DistributedConfig", old)
    with pytest.raises(ConfigError) as err:
        check_transformers(GroupSplit(2, SHARDED, True), True, "qwen3_moe")
    assert "lacks ['ep_size']" in err.value.message and "transformers>=" in err.value.hint
    check_transformers(GroupSplit(2, SHARDED, True), False, "qwen3")  # dense: FSDP alone


def test_shared_mode_needs_the_class_tensor_parallel_plan(monkeypatch):
    from transformers import Qwen3Config
    monkeypatch.setattr(Qwen3Config, "base_model_tp_plan", None)
    with pytest.raises(ConfigError, match="no tensor-parallel plan for qwen3"):
        check_transformers(GroupSplit(2, SHARED, True), False, "qwen3")
    assert split_mod.SHARDED == "sharded"
