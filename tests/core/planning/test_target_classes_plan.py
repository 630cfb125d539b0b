"""The memory plan and preflight for the target classes beyond dense ones: experts and routers
counted to the byte of the loaded model, a Qwen3-30B-A3B shape against its measured peak, the
real bytes of FP8 and MXFP4 checkpoints and whether they stay quantized on the devices, the
attention implementation a class can run, and remote code."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_core.config import ConfigError, config_from_dict
from dflash_core.models.target.shape import param_count
from dflash_core.planning.memory import plan_memory
from dflash_core.planning.weight_bytes import MXFP4_BYTES, target_weight_bytes, target_weight_parts
from dflash_core.planning.attention_choice import choose_attention
from dflash_core.planning.quantized_check import quantized_weights
from dflash_core.planning.target_checks import check_target_code, resolve_target
from dflash_core.units import GiB

from ..models.target.target_classes import GPT_OSS_20B, MOE, QWEN3_30B_A3B, TINY, build
from ..models.target.test_target_classes import fp8_checkpoint, mxfp4_checkpoint

# These targets' vocabularies are tiny: DSpark's rank-256 Markov head needs more ids than that.
DFLASH = {"objective": "dflash"}
ROUTED = re.compile(r"\.mlp\.(experts\.|gate\.weight|router\.)")  # not shared_experts


def cpu_cfg(**target):
    return config_from_dict({"layout": {"device": "cpu"}, "drafter": DFLASH, "target": target,
                             "data": {"token_budget": 256, "max_length": 64}})


@pytest.mark.parametrize("name", sorted(TINY))
def test_the_plan_counts_the_loaded_models_weights_and_experts_to_the_byte(name):
    """The CPU plan's weights and experts rows against the parameters of the model transformers
    builds (float32 on the CPU): routed experts and routers in "experts", the rest (attention,
    dense and shared MLPs, norms, a wrapper's vision tower) in "weights"."""
    model = build(name)
    hf_config = TINY[name]().to_dict()
    row = plan_memory(cpu_cfg(layer_ids=[1, 2]), hf_config).rows[0].components
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ROUTED.search(n))
    everything = sum(p.numel() * 4 for p in model.parameters())
    assert row.get("experts", 0) == experts and (experts > 0) == (name in MOE)
    assert row["weights"] == everything - experts


def test_a_qwen3_30b_a3b_shape_plans_its_measured_peak():
    """On one H200 (transformers 5.17, grouped_mm experts, random bf16) a plain forward of the
    Qwen3-30B-A3B-shaped decoder body over 16 x 2048 tokens peaked at 61.5 GiB. The plan's
    weights, experts, residual stream, layer transient and mask are that forward: within a few
    percent of it, and above it once the allocator's share is counted."""
    cfg = config_from_dict({"layout": {"device": "cuda", "targets": [0], "drafters": [1]},
                            "data": {"token_budget": 16 * 2048, "max_length": 2048},
                            "target": {"layer_ids": [1, 12, 24, 36, 47]}})
    row = plan_memory(cfg, QWEN3_30B_A3B).rows[0].components
    body = sum(row[k] for k in ("weights", "experts", "residual stream", "layer transient",
                                "attention mask"))
    assert body / GiB == pytest.approx(61.5, rel=0.03)
    assert (body + row["allocator reserve"]) / GiB > 61.5
    # the experts are nearly all of it: 48 layers x 128 experts x 3 x 2048 x 768 in bf16, and
    # 48 routers of 128 x 2048 counted in float32
    assert row["experts"] == 48 * (128 * 3 * 2048 * 768 * 2 + 128 * 2048 * 4)
    # The layer transient is the MoE layer's: 8 (token, expert) pairs per token, each holding
    # the gathered input, down output, weighted and reordered copies (4 x 2048) at the peak,
    # and the router's logits, float32 softmax and top-k for 128 experts.
    tokens = 16 * 2048
    assert row["layer transient"] == tokens * 8 * 4 * 2048 * 2 + tokens * 128 * (2 + 8)


def test_gpt_oss_eager_attention_holds_three_copies_of_the_scores():
    cfg = config_from_dict({"layout": {"device": "cuda", "targets": [0], "drafters": [1]},
                            "data": {"token_budget": 16 * 2048, "max_length": 2048},
                            "target": {"attn_implementation": "eager"}})
    eager = plan_memory(cfg, GPT_OSS_20B).rows[0].components["layer transient"]
    cfg.target.attn_implementation = "flex_attention"
    flex = plan_memory(cfg, GPT_OSS_20B).rows[0].components["layer transient"]
    tokens = 16 * 2048
    scores = tokens * 2048 * 64 * 3 * 2  # tokens x S x heads x 3 copies x bf16
    q = 64 * 64  # the attention layer's own tensors: 12 x q + H per token (memory.py)
    assert eager == tokens * (12 * q + 2880) * 2 + scores
    assert eager > 4 * flex  # flex: the MoE layer's transient, well below the scores


# --------------------------------------------------------------------------------------------
# Quantized checkpoints
# --------------------------------------------------------------------------------------------

def stored_bytes(folder) -> int:
    """The tensors' bytes in a folder's safetensors files (headers left out)."""
    itemsize = {"F8_E4M3": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4}
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                total += math.prod(t.get_shape()) * itemsize[t.get_dtype()]
    return total


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_quantized_weights_are_planned_as_the_checkpoint_stores_them(tmp_path, kind):
    """Kept as stored, the plan's weights are the checkpoint's tensors (FP8 weights and their
    block scales, MXFP4 blocks and scales, the rest bf16), give or take the router the plan
    counts in float32; dequantized, they are the parameters in the run's dtype."""
    (fp8_checkpoint if kind == "fp8" else mxfp4_checkpoint)(tmp_path)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    stored = stored_bytes(tmp_path)
    planned = target_weight_bytes(hf_config, "bfloat16", quantized=True)
    assert stored <= planned <= 1.03 * stored
    assert target_weight_bytes(hf_config, "float32") > 2.5 * stored


def test_mxfp4_experts_of_gpt_oss_20b_at_full_size():
    hf_config = dict(GPT_OSS_20B, quantization_config={"quant_method": "mxfp4"})
    parts = target_weight_parts(hf_config, "bfloat16", quantized=True)
    expert_params = 24 * 32 * (2 * 2880 * 2880 + 2880 * 2880)
    biases = 24 * 32 * (2 * 2880 + 2880)
    router = 24 * (32 * 2880 + 32)  # with its bias, counted in float32
    assert parts["experts"] == int(expert_params * MXFP4_BYTES) + biases * 2 + router * 4
    # ~12.8 GiB in all, against 39 GiB dequantized to bf16
    assert sum(parts.values()) / GiB == pytest.approx(12.8, abs=0.1)
    assert target_weight_bytes(hf_config, "bfloat16") / GiB == pytest.approx(39.0, abs=0.1)


FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}


def test_fp8_on_the_cpu_is_said_to_be_dequantized_and_planned_in_float32():
    hf_config = dict(QWEN3_30B_A3B, quantization_config=FP8)
    kept, line = quantized_weights(cpu_cfg(), hf_config, [torch.device("cpu")])
    assert kept is False
    assert "cannot run here (the target runs on the CPU)" in line
    assert "dequantizes them to float32" in line
    assert f"{target_weight_bytes(hf_config, 'float32') / GiB:.1f} GiB" in line
    row = plan_memory(cpu_cfg(), hf_config, quantized=kept).rows[0].components
    assert row["weights"] + row["experts"] == target_weight_bytes(hf_config, "float32")


QWEN3_8B = json.loads((Path(__file__).parents[2] / "fixtures" / "qwen3_8b_config.json")
                      .read_text())


def cuda_cfg():
    return config_from_dict({"layout": {"device": "cuda"}})


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA GPU of a compute capability the test sets, with or without the kernels package
    (transformers' FP8 kernels come through it)."""
    from dflash_core.models.target import fp8

    state = {"capability": (9, 0), "kernels": False}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: state["capability"])
    monkeypatch.setattr(fp8, "kernels_installed", lambda: state["kernels"])
    return state


@pytest.mark.parametrize("capability, kept", [((9, 0), True), ((8, 9), True), ((8, 0), False)])
def test_fp8_on_a_gpu_stays_quantized_from_compute_capability_8_9(gpu, capability, kept):
    gpu["capability"] = capability
    hf_config = dict(QWEN3_8B, quantization_config=FP8)
    got, line = quantized_weights(cuda_cfg(), hf_config, [torch.device("cuda:0")])
    assert got is kept
    stored = target_weight_bytes(hf_config, "bfloat16", quantized=True)
    plain = target_weight_bytes(hf_config, "bfloat16")
    if kept:
        assert line.startswith("target: FP8 block-wise weights") and "stay as stored" in line
        assert f"{stored / GiB:.1f} GiB ({plain / GiB:.1f} GiB in bfloat16)" in line
        # no kernels package: the engine's FP8 linear runs them, and the line says so
        assert "run by the engine's FP8 linear" in line and "need the kernels package" in line
    else:
        assert "compute capability 8.0, fp8 needs 8.9+" in line
        assert f"dequantizes them to bfloat16 as it loads, {plain / GiB:.1f} GiB instead of " \
               f"{stored / GiB:.1f} GiB" in line


def test_fp8_with_the_kernels_package_names_transformers_kernels_first(gpu):
    gpu["kernels"] = True
    _, line = quantized_weights(cuda_cfg(), dict(QWEN3_8B, quantization_config=FP8),
                                [torch.device("cuda:0")])
    assert "run by transformers' FP8 kernels where they load, else the engine's FP8 linear" in line


@pytest.mark.parametrize("kernels", [True, False])
def test_fp8_routed_experts_stay_fp8_only_with_transformers_kernels(gpu, kernels):
    """Routed experts in FP8 run on transformers' kernels alone (the engine's FP8 linear is for
    linear layers): without the kernels package the whole target is dequantized, and said."""
    gpu["kernels"] = kernels
    hf_config = dict(QWEN3_30B_A3B, quantization_config=FP8)
    got, line = quantized_weights(cuda_cfg(), hf_config, [torch.device("cuda:0")])
    assert got is kernels
    if not kernels:
        assert "routed experts run only on transformers' FP8 kernels" in line
        assert "the kernels package (not installed)" in line
        row = plan_memory(cuda_cfg(), hf_config, quantized=got).rows[0].components
        assert row["weights"] + row["experts"] == target_weight_bytes(hf_config, "bfloat16")
        assert "FP8 weight dequantized" not in row


def test_fp8_plan_of_the_8b_shape_against_its_hand_count():
    """Qwen3-8B in FP8 block-wise: every attention and MLP matrix 1 byte per value and a float32
    scale per 128 x 128 block; embeddings, lm_head (untied) and norms bf16. Counted here from the
    shape by hand."""
    H, I, layers, vocab, kv = 4096, 12288, 36, 151936, 8 * 128
    matrices = [(H, H), (kv, H), (kv, H), (H, H), (I, H), (I, H), (H, I)]  # q k v o gate up down
    values = layers * sum(r * c for r, c in matrices)
    scales = layers * sum(math.ceil(r / 128) * math.ceil(c / 128) for r, c in matrices)
    rest = 2 * vocab * H + layers * (2 * H + 2 * 128) + H  # embed, lm_head, norms (q/k norms)
    hf_config = dict(QWEN3_8B, quantization_config=FP8)
    assert target_weight_bytes(hf_config, "bfloat16", quantized=True) == \
        values + 4 * scales + 2 * rest
    assert target_weight_bytes(hf_config, "bfloat16") == 2 * values + 2 * rest
    # 8.8 GiB against 15.3 GiB: the weights nearly halve
    assert (values + 4 * scales + 2 * rest) / GiB == pytest.approx(8.79, abs=0.01)
    # kept FP8, the plan holds one weight dequantized beside them: the largest (gate / up /
    # down, 12288 x 4096) in float32 and in bf16
    cfg = cuda_cfg()
    kept = plan_memory(cfg, hf_config, quantized=True).rows[0].components
    assert kept["FP8 weight dequantized"] == I * H * (4 + 2)
    assert kept["weights"] == values + 4 * scales + 2 * rest
    plain = plan_memory(cfg, hf_config, quantized=False).rows[0].components
    assert "FP8 weight dequantized" not in plain and plain["weights"] == 2 * values + 2 * rest


@pytest.mark.parametrize("installed, kept, says", [
    ({"triton": "3.3.1", "kernels": "0.12.0"}, False, "triton >= 3.4 is not installed"),
    ({"triton": "3.4.0"}, False, "the kernels package is not installed"),
    ({"triton": "3.5.1", "kernels": "0.12.0"}, True, "stay as stored: 12.8 GiB"),
])
def test_mxfp4_stays_quantized_only_with_triton_kernels(monkeypatch, installed, kept, says):
    import importlib.metadata

    def version(package):
        if package not in installed:
            raise importlib.metadata.PackageNotFoundError(package)
        return installed[package]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(importlib.metadata, "version", version)
    hf_config = dict(GPT_OSS_20B, quantization_config={"quant_method": "mxfp4"})
    cfg = config_from_dict({"layout": {"device": "cuda"}})
    got, line = quantized_weights(cfg, hf_config, [torch.device("cuda:0")])
    assert got is kept and says in line
    if not kept:
        assert "dequantizes them to bfloat16 as it loads, 39.0 GiB instead of 12.8 GiB" in line


def test_plain_weights_say_nothing():
    assert quantized_weights(cpu_cfg(), QWEN3_30B_A3B, [torch.device("cpu")]) == (None, None)


# --------------------------------------------------------------------------------------------
# Attention implementation, remote code
# --------------------------------------------------------------------------------------------

def test_gpt_oss_with_sdpa_gets_eager_and_says_so_once():
    cfg, said = cpu_cfg(), []
    choose_attention(cfg, TINY["gpt_oss"]().to_dict(), said.append)
    assert cfg.target.attn_implementation == "eager"
    assert len(said) == 1 and "GptOssForCausalLM cannot run sdpa" in said[0]
    assert "flex_attention" in said[0]  # the other one that runs it


@pytest.mark.parametrize("name, wanted, cause", [
    ("gpt_oss", "flash_attention_2", "drops its attention sinks"),
    ("qwen3_5_moe_text", "flex_attention", "cannot run 'flex_attention'"),
])
def test_an_attention_the_class_cannot_run_is_refused_with_those_it_can(name, wanted, cause):
    cfg = cpu_cfg(attn_implementation=wanted)
    with pytest.raises(ConfigError, match=cause) as exc_info:
        choose_attention(cfg, TINY[name]().to_dict(), lambda m: None)
    assert exc_info.value.key == "target.attn_implementation"
    assert "eager" in exc_info.value.hint


def test_flash_attention_2_on_the_cpu_is_refused():
    cfg = cpu_cfg(attn_implementation="flash_attention_2")
    with pytest.raises(ConfigError, match="needs CUDA and the flash_attn package"):
        choose_attention(cfg, TINY["qwen3_moe"]().to_dict(), lambda m: None)


def test_what_a_class_can_run_is_kept_as_asked():
    for name, wanted in (("qwen3_moe", "sdpa"), ("gpt_oss", "eager"), ("deepseek_v3", "eager"),
                         ("gemma3", "flex_attention")):
        cfg, said = cpu_cfg(attn_implementation=wanted), []
        choose_attention(cfg, TINY[name]().to_dict(), said.append)
        assert cfg.target.attn_implementation == wanted and said == []


REMOTE = {"model_type": "kimi_k2", "auto_map": {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}


def test_remote_code_is_refused_at_preflight_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as exc_info:
        check_target_code(cpu_cfg(), REMOTE, tmp_path)
    err = exc_info.value
    assert err.key == "target.trust_remote_code"
    assert "needs its own code" in err.message and "kimi_k2" in err.message
    assert "set target.trust_remote_code: true" in err.hint
    # trusted, but the folder lacks the code its auto_map names (issue 59): target.path's fault,
    # in config.yaml's words (eval says --target)
    with pytest.raises(ConfigError) as exc_info:
        check_target_code(cpu_cfg(trust_remote_code=True), REMOTE, tmp_path)
    assert exc_info.value.key == "target.path"
    assert "configuration_deepseek.py, modeling_deepseek.py" in exc_info.value.message
    assert "set target.path in config.yaml to a complete copy" in exc_info.value.hint
    for name in ("configuration_deepseek.py", "modeling_deepseek.py"):
        (tmp_path / name).write_text("")
    check_target_code(cpu_cfg(trust_remote_code=True), REMOTE, tmp_path)  # allowed: no error
    # a model type transformers builds itself needs no trust, auto_map or not
    check_target_code(cpu_cfg(), dict(REMOTE, model_type="deepseek_v3"), tmp_path)


def test_the_memory_plan_reads_a_remote_code_config_by_its_keys():
    """Kimi-K2 is DeepSeek-V3's architecture under a model type of its own: read by its keys,
    it is counted as transformers counts the same keys as deepseek_v3."""
    from ..models.target.target_classes import DEEPSEEK_V3
    from ..models.target.test_model_shape import hf_param_count

    kimi = dict(DEEPSEEK_V3, **REMOTE, n_routed_experts=384, num_attention_heads=64,
                num_key_value_heads=64, first_k_dense_replace=1, vocab_size=163840)
    as_deepseek = {k: v for k, v in kimi.items() if k != "auto_map"} | {
        "model_type": "deepseek_v3"}
    assert param_count(kimi) == hf_param_count(as_deepseek)
    assert param_count(kimi) == pytest.approx(1e12, rel=0.05)  # Kimi-K2: "1T total"
    parts = target_weight_parts(kimi, "bfloat16")
    assert parts["experts"] > 0.95 * sum(parts.values())


def test_preflight_resolves_the_attention_before_the_plan(tmp_path):
    """resolve_target settles the attention on the config the run goes on with (the plan and the
    target stage read it after)."""
    folder = tmp_path / "oss"
    build("gpt_oss").save_pretrained(folder)
    cfg = config_from_dict({"layout": {"device": "cpu"}, "drafter": DFLASH,
                            "target": {"path": str(folder), "layer_ids": [1, 2]}})
    said = []
    _, hf_config, layer_ids, _ = resolve_target(cfg, tmp_path, None, say=said.append)
    assert cfg.target.attn_implementation == "eager" and layer_ids == [1, 2] and len(said) == 1


def test_features_that_include_the_last_layer_are_accepted_with_the_reason_said(tmp_path):
    # transformers' last hidden state is after the final norm; vLLM and SGLang capture it before.
    folder = tmp_path / "oss"
    build("gpt_oss").save_pretrained(folder)
    n = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    cfg = config_from_dict({"layout": {"device": "cpu"}, "drafter": DFLASH, "target": {
        "path": str(folder), "layer_ids": [0, n - 1], "attn_implementation": "eager"}})
    said = []
    _, _, layer_ids, _ = resolve_target(cfg, tmp_path, None, say=said.append)
    assert layer_ids == [0, n - 1]
    (line,) = said
    assert f"includes layer {n - 1}, the target's last" in line and "before the norm" in line
    cfg.target.layer_ids = [0, n - 2]
    said.clear()
    resolve_target(cfg, tmp_path, None, say=said.append)
    assert said == []


def _shallow_target(folder, layers: int):
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("layers, features, want", [(2, 1, [0]), (3, 1, [1]), (6, 2, [1, 3])])
def test_the_default_layers_stay_below_the_last_and_say_nothing(tmp_path, layers, features, want):
    folder = _shallow_target(tmp_path / "t", layers)
    cfg = config_from_dict({"layout": {"device": "cpu"}, "drafter": DFLASH, "target": {
        "path": str(folder), "num_features": features}})
    said = []
    _, _, layer_ids, _ = resolve_target(cfg, tmp_path, None, say=said.append)
    assert layer_ids == want and said == []


@pytest.mark.parametrize("layers, features, hint", [
    (3, 5, "list target.layer_ids below its last layer (0..1), or set target.num_features: 1 "
           "(the middle layer)"),
    (1, 1, "set target.layer_ids: [0], its only layer (accepted with a warning)")])
def test_a_target_too_shallow_for_the_default_is_one_config_line(tmp_path, layers, features,
                                                                 hint):
    """Before: a bare ValueError out of preflight for 3 layers, and the last layer chosen by
    default (with the warning against it) for 1 or 2."""
    folder = _shallow_target(tmp_path / "t", layers)
    cfg = config_from_dict({"layout": {"device": "cpu"}, "drafter": DFLASH, "target": {
        "path": str(folder), "num_features": features}})
    with pytest.raises(ConfigError) as got:
        resolve_target(cfg, tmp_path, None, say=lambda line: None)
    assert got.value.key == "target.layer_ids" and "\n" not in str(got.value)
    assert str(got.value).startswith("target.layer_ids: empty, and a target ")
    assert got.value.hint == hint
