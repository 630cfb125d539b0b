"""A target's config.json is input (docs/bad-input.md): every field the memory plan, preflight
or the loader reads is checked where the file is first read, and a bad one is one ConfigError
(target.path) naming the file and the field, never an internal error deep in the plan."""

import copy
import json
from pathlib import Path

import pytest

from dflash_core.config import Config, ConfigError
from dflash_core.models.target.config import TargetLoadError, load_target_config
from dflash_core.planning.target_checks import resolve_target

from ..models.target.target_classes import DEEPSEEK_V3

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}_config.json").read_text())


BASES = {"dense": lambda: fixture("qwen3_8b"), "moe": lambda: fixture("qwen3_30b_a3b"),
         "gpt_oss": lambda: fixture("gpt_oss_20b"), "hybrid": lambda: fixture("qwen3_6_27b"),
         "mla": lambda: copy.deepcopy(DEEPSEEK_V3)}
FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}


def setting(field: str, value):
    """A change to a config dict: ``field`` (dotted for nested objects) set to ``value``, or
    removed when value is DROP."""
    def change(d: dict) -> None:
        *outer, last = field.split(".")
        for key in outer:
            d = d.setdefault(key, {})
        if value is DROP:
            d.pop(last, None)
        else:
            d[last] = value
    return change


DROP = object()

# name: (base, changes, the field the line names, words of the rule)
CASES = {
    "moe_intermediate_size negative": ("moe", [setting("moe_intermediate_size", -768)],
                                       "moe_intermediate_size -768", "whole number > 0"),
    "fp8 weight_block_size [0, 128]": (
        "dense", [setting("quantization_config", dict(FP8, weight_block_size=[0, 128]))],
        "quantization_config.weight_block_size [0, 128]", "each entry a whole number > 0"),
    "fp8 weight_block_size one number": (
        "dense", [setting("quantization_config", dict(FP8, weight_block_size=128))],
        "quantization_config.weight_block_size 128", "[rows, columns]"),
    "quantization_config a string": ("dense", [setting("quantization_config", "fp8")],
                                     'quantization_config "fp8"', "must be an object"),
    "quantization_config without quant_method": (
        "dense", [setting("quantization_config", {"weight_block_size": [128, 128]})],
        "'quantization_config.quant_method' is missing", "fp8"),
    "num_hidden_layers 0": ("dense", [setting("num_hidden_layers", 0)], "num_hidden_layers 0",
                            "whole number > 0"),
    "num_hidden_layers a string": ("dense", [setting("num_hidden_layers", "32")],
                                   'num_hidden_layers "32"', "whole number > 0"),
    "num_hidden_layers a float": ("dense", [setting("num_hidden_layers", 36.5)],
                                  "num_hidden_layers 36.5", "whole number > 0"),
    "hidden_size -1": ("dense", [setting("hidden_size", -1)], "hidden_size -1",
                       "whole number > 0"),
    "hidden_size missing": ("dense", [setting("hidden_size", DROP)], "'hidden_size' is missing",
                            "whole number > 0"),
    "num_attention_heads 0": ("dense", [setting("num_attention_heads", 0)],
                              "num_attention_heads 0", "whole number > 0"),
    "hidden_size not a multiple of heads without head_dim": (
        "dense", [setting("head_dim", DROP), setting("num_attention_heads", 30),
                  setting("num_key_value_heads", 10)],
        "hidden_size 4096", "multiple of num_attention_heads (30)"),
    "num_key_value_heads not dividing heads": ("dense", [setting("num_key_value_heads", 5)],
                                               "num_key_value_heads 5", "must divide"),
    "head_dim 0": ("dense", [setting("head_dim", 0)], "head_dim 0", "whole number > 0"),
    "vocab_size 0": ("dense", [setting("vocab_size", 0)], "vocab_size 0", "whole number > 0"),
    "vocab_size true": ("dense", [setting("vocab_size", True)], "vocab_size true",
                        "whole number > 0"),
    "intermediate_size true": ("dense", [setting("intermediate_size", True)],
                               "intermediate_size true", "whole number > 0"),
    "num_experts -2": ("moe", [setting("num_experts", -2)], "num_experts -2",
                       "whole number >= 0"),
    "num_local_experts a string": ("gpt_oss", [setting("num_local_experts", "32")],
                                   'num_local_experts "32"', "whole number >= 0"),
    "num_experts_per_tok above num_experts": ("moe", [setting("num_experts_per_tok", 200)],
                                              "num_experts_per_tok 200", "1 to the 128 experts"),
    "decoder_sparse_step 0": ("moe", [setting("decoder_sparse_step", 0)],
                              "decoder_sparse_step 0", "whole number > 0"),
    "mlp_only_layers past the layers": ("moe", [setting("mlp_only_layers", [48])],
                                        "mlp_only_layers [48]", "layer ids 0..47"),
    "torch_dtype nonsense": ("dense", [setting("torch_dtype", "bfloat17")],
                             'torch_dtype "bfloat17"', "must name a dtype"),
    "rope_scaling a string": ("dense", [setting("rope_scaling", "yarn")],
                              'rope_scaling "yarn"', "must be an object"),
    "rope_theta NaN": ("dense", [setting("rope_theta", float("nan"))], "rope_theta NaN",
                       "number > 0"),
    "rms_norm_eps negative": ("dense", [setting("rms_norm_eps", -1e-6)], "rms_norm_eps -1e-06",
                              "number > 0"),
    "attention_bias a string": ("dense", [setting("attention_bias", "false")],
                                'attention_bias "false"', "true or false"),
    "layer_types not a list": ("gpt_oss", [setting("layer_types", "full_attention")],
                               'layer_types "full_attention"', "must be a list"),
    "layer_types an unknown kind": (
        "gpt_oss", [setting("layer_types", ["full_attention"] * 23 + ["quantum_attention"])],
        'layer_types[23] "quantum_attention"', "layer kind"),
    "layer_types one short": ("gpt_oss", [setting("layer_types", ["full_attention"] * 23)],
                              "layer_types: 23 kinds for num_hidden_layers 24", "one per layer"),
    "eos_token_id past the vocabulary": ("dense", [setting("eos_token_id", 151936)],
                                         "eos_token_id 151936", "0..151935"),
    "kv_lora_rank negative": ("mla", [setting("kv_lora_rank", -512)], "kv_lora_rank -512",
                              "whole number >= 0"),
    "mla without v_head_dim": ("mla", [setting("v_head_dim", DROP)], "'v_head_dim' is missing",
                               "multi-head latent attention"),
    "text_config a list": ("hybrid", [setting("text_config", [1, 2])], "text_config [1, 2]",
                           "must be an object"),
    "text_config.num_hidden_layers 0": ("hybrid", [setting("text_config.num_hidden_layers", 0)],
                                        "text_config.num_hidden_layers 0", "whole number > 0"),
    "text_config.linear_num_value_heads missing": (
        "hybrid", [setting("text_config.linear_num_value_heads", DROP)],
        "'text_config.linear_num_value_heads' is missing", "Gated DeltaNet"),
    "text_config.rope_parameters.rope_theta 0": (
        "hybrid", [setting("text_config.rope_parameters.rope_theta", 0)],
        "text_config.rope_parameters.rope_theta 0", "number > 0"),
    "vision_config.patch_size 0": ("hybrid", [setting("vision_config.patch_size", 0)],
                                   "vision_config.patch_size 0", "whole number > 0"),
}


def target_folder(tmp_path: Path, hf_config: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config))  # NaN as JSON's NaN, as Python
    return folder


def preflight_target(folder: Path, tmp_path: Path):
    """What preflight runs on the target folder (planning/preflight.py: resolve_target)."""
    cfg = Config()
    cfg.target.path = str(folder)
    cfg.layout.device = "cpu"
    return resolve_target(cfg, tmp_path, lambda what: None)


@pytest.mark.parametrize("name", list(CASES))
def test_a_nonsense_field_is_one_line_naming_the_file_and_the_field(tmp_path, name):
    base, changes, field, rule = CASES[name]
    hf_config = BASES[base]()
    for change in changes:
        change(hf_config)
    folder = target_folder(tmp_path, hf_config)
    with pytest.raises(ConfigError) as caught:
        preflight_target(folder, tmp_path)
    err = caught.value
    assert err.key == "target.path"
    line = str(err)
    assert "\n" not in line
    assert f"{folder / 'config.json'}: {field}" in line, line
    assert rule in line, line
    assert "config.json" in err.hint and "download" in err.hint
    # The loader (eval, check, the target stage) reads the file through the same check.
    with pytest.raises(TargetLoadError) as loaded:
        load_target_config(folder)
    assert f"{folder / 'config.json'}: {field}" in str(loaded.value)


@pytest.mark.parametrize("base", [b for b in BASES if b != "mla"])
def test_the_real_configs_pass_untouched(tmp_path, base):
    folder = target_folder(tmp_path, BASES[base]())
    _, hf_config, layer_ids, _ = preflight_target(folder, tmp_path)
    assert hf_config == BASES[base]() and layer_ids


def test_a_real_fp8_config_passes(tmp_path):
    folder = target_folder(tmp_path, dict(fixture("qwen3_8b"), quantization_config=FP8))
    preflight_target(folder, tmp_path)
