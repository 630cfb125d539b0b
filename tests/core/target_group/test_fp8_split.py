"""An FP8 block-wise target split by tensor parallel: the widths transformers' plan splits, each
a whole number of 128 x 128 blocks per GPU, or the split refused in one line naming the layer,
the width, the block and the size, with a size that would do (published shapes of DeepSeek-V3,
GLM-4.6, Kimi-K2); sharded splits cut no block; a run refuses it at preflight, exit 2."""

import pytest

from dflash_core.config import ConfigError
from dflash_core.models.target.shape import model_shape
from dflash_core.target_group import fp8_split
from dflash_core.target_group.fp8_split import (
    SplitDim, check_fp8_split, fp8_block, tensor_parallel_splits,
)
from dflash_core.target_group.split import SHARDED, SHARED, GroupSplit

from ..engine_fixtures import assets, make_config, write_config  # noqa: F401
from ..models.target.fp8_twin import FP8_CONFIG, TINY_QWEN3, write_fp8_twin
from ..models.target.target_classes import DEEPSEEK_V3, GLM_4_5
from ..pipeline.test_headless import Headless

DEEPSEEK_V3_FP8 = dict(DEEPSEEK_V3, quantization_config=FP8_CONFIG)
GLM_4_6_FP8 = dict(GLM_4_5, quantization_config=FP8_CONFIG)  # GLM-4.6 keeps GLM-4.5's shape
KIMI_K2_FP8 = dict(DEEPSEEK_V3_FP8, vocab_size=163840, num_attention_heads=64,
                   num_key_value_heads=64, n_routed_experts=384, first_k_dense_replace=1,
                   n_group=1, topk_group=1)
QWEN3_FP8 = dict(TINY_QWEN3, model_type="qwen3", quantization_config=FP8_CONFIG)


def check(hf_config, k, mode=SHARED):
    check_fp8_split(GroupSplit(k, mode, True), model_shape(hf_config), hf_config)


def test_the_splits_are_read_from_transformers_plan():
    """DeepSeek-V3 over 8: the query and key/value up-projections, the dense and shared MLPs
    split; the latent down-projections and the lm_head (bf16) do not count."""
    splits = {(s.layer, s.dim): s for s in tensor_parallel_splits(
        DEEPSEEK_V3_FP8, {"tp_size": 8, "ep_size": 8})}
    assert splits[("model.layers.*.self_attn.q_b_proj", "output")].width == 128 * 192
    assert splits[("model.layers.*.self_attn.kv_b_proj", "output")].width == 128 * 256
    assert splits[("model.layers.*.self_attn.o_proj", "input")].width == 128 * 128
    assert splits[("model.layers.*.mlp.down_proj", "input")].width == 18432
    assert splits[("model.layers.*.mlp.shared_experts.up_proj", "output")].width == 2048
    names = {layer for layer, _ in splits}
    assert not any("kv_a_proj" in n or "q_a_proj" in n or "lm_head" in n or "experts.gate_up"
                   in n for n in names)
    assert SplitDim("x", "output", 1536).whole_blocks(4, 128)
    assert not SplitDim("x", "output", 1536).whole_blocks(8, 128)  # 192 rows each
    assert fp8_block(DEEPSEEK_V3_FP8) == (128, 128) and fp8_block(DEEPSEEK_V3) is None


@pytest.mark.parametrize("config, k", [(DEEPSEEK_V3_FP8, 8), (KIMI_K2_FP8, 8),
                                       (GLM_4_6_FP8, 4), (GLM_4_6_FP8, 2)])
def test_published_fp8_shapes_that_split_whole_blocks_pass(config, k):
    check(config, k)


def test_a_split_that_cuts_a_block_is_refused_naming_it_and_a_size_that_would_not():
    """GLM-4.6 over 8: its shared expert's 1536 rows are 192 a GPU (vLLM refuses the same)."""
    with pytest.raises(ConfigError) as err:
        check(GLM_4_6_FP8, 8)
    e = err.value
    assert e.key == "target.gpus_per_copy" and "\n" not in str(e)
    assert ("tensor parallel over 8 GPUs splits model.layers.*.mlp.shared_experts.gate_proj's "
            "1536 output rows into 192 per GPU, not a multiple of the FP8 checkpoint's "
            "128 x 128 blocks (and 2 more layers)") == e.message
    assert "target.parallel: sharded" in e.hint and "target.gpus_per_copy: 4" in e.hint


def test_no_size_is_offered_where_none_splits_heads_and_blocks_alike(monkeypatch):
    """A tiny Qwen3 of 2 key/value heads 64 wide: over 2 GPUs each holds 64 of k_proj's 128
    rows; no other size splits its heads and its blocks alike, so only sharded is offered."""
    with pytest.raises(ConfigError) as err:
        check(QWEN3_FP8, 2)
    assert "splits model.layers.*.self_attn.k_proj's 128 output rows into 64 per GPU" \
        in err.value.message and "gpus_per_copy" not in err.value.hint
    # a split of the input (a rowwise layer's) is named by its columns, a packed one's parts
    monkeypatch.setattr(fp8_split, "tensor_parallel_splits", lambda *a: [
        SplitDim("model.layers.*.mlp.gate_up_proj", "output", 1024, parts=2),
        SplitDim("model.layers.*.mlp.down_proj", "input", 640)])
    with pytest.raises(ConfigError) as err:
        check(QWEN3_FP8, 4)  # each half of gate_up over 4: 128 rows, whole
    assert err.value.message.endswith(
        "splits model.layers.*.mlp.down_proj's 640 input columns into 160 per GPU, not a "
        "multiple of the FP8 checkpoint's 128 x 128 blocks")
    with pytest.raises(ConfigError, match=r"gate_up_proj's 1024 output rows \(2 packed parts\) "
                                          r"into 64 per GPU, .* \(and 1 more layer\)$"):
        check(QWEN3_FP8, 8)


def test_sharded_splits_and_plain_weights_are_not_checked(monkeypatch):
    def read(*a):
        raise AssertionError("the plan was read")
    monkeypatch.setattr(fp8_split, "tensor_parallel_splits", read)
    check(GLM_4_6_FP8, 8, SHARDED)
    check(GLM_4_5, 8, SHARED)
    check(GLM_4_6_FP8, 1, SHARED)


def test_a_run_refuses_the_split_at_preflight_in_one_line(assets, tmp_path):  # noqa: F811
    _, data = assets
    fp8, _ = write_fp8_twin(tmp_path)
    cfg = make_config(tmp_path, fp8, data, layout__targets=[0, 1], target__gpus_per_copy=2,
                      target__parallel="shared", target__layer_ids=[0, 1])
    rc, out, err = Headless(write_config(tmp_path / "config.yaml", cfg)).finish(90)
    assert rc == 2, out + err
    assert "k_proj's 128 output rows into 64 per GPU" in out and "Traceback" not in out + err
    assert "target.parallel: sharded" in out
