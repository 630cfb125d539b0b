"""Every target class the engine supports, as a tiny random-weight checkpoint saved to disk and
loaded back through load_target: mixtures of experts (Qwen3-MoE, Qwen3.5-MoE, gpt-oss,
DeepSeek-V3 with latent attention, GLM-4.5), a multimodal wrapper transformers loads whole
(Gemma 3), quantized checkpoints (FP8 block-wise, MXFP4) and a model of remote code."""

from __future__ import annotations

import builtins
import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5MoeForConditionalGeneration

from dflash_core.models.target.model import TargetModel
from dflash_core.models.target.config import TargetLoadError
from dflash_core.models.target.load import load_target

from .target_classes import LAYERS, MOE, TINY, VOCAB, build

# gpt-oss has no SDPA path (its attention sinks): preflight picks eager for it, as here.
ATTENTION = {"gpt_oss": "eager"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{class: (folder, the in-memory model it was saved from)}."""
    root = tmp_path_factory.mktemp("classes")
    out = {}
    for name in TINY:
        model = build(name)
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


def _ids(seed: int, shape=(2, 11)) -> torch.Tensor:
    # below the Gemma 3 image / boundary token ids
    return torch.randint(0, VOCAB - 8, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def no_terminal_prompt(monkeypatch):
    """transformers asks "Do you wish to run the custom code? [y/N]" through input(): fail."""
    def asked(*args, **kwargs):
        raise AssertionError(f"asked on the terminal: {args}")
    monkeypatch.setattr(builtins, "input", asked)


@pytest.mark.parametrize("name", sorted(TINY))
def test_each_class_loads_and_its_features_are_the_hidden_states(saved, name):
    folder, ref = saved[name]
    target = load_target(folder, attn_implementation=ATTENTION.get(name, "sdpa"))
    assert type(target.model) is type(ref)
    assert target.num_layers == LAYERS and target.vocab_size == VOCAB
    assert not any(p.requires_grad for p in target.model.parameters())
    ids = _ids(2)
    with torch.inference_mode():
        out = ref(input_ids=ids, output_hidden_states=True)
    layer_ids = [2, 0, LAYERS - 1]  # the last one: after the final norm, as HF reports it
    feats = target.features(ids, layer_ids=layer_ids)
    expected = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    assert feats.shape == (2, 11, 3 * target.hidden_size)
    assert (feats - expected).abs().max().item() < 1e-5
    logits, again = target.logits_and_features(ids, layer_ids)
    assert (logits - out.logits).abs().max().item() < 1e-4
    assert (again - feats).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", MOE)
def test_features_stop_after_the_last_chosen_layer(saved, name):
    folder, _ = saved[name]
    target = load_target(folder, attn_implementation=ATTENTION.get(name, "sdpa"))
    calls = [0] * LAYERS
    handles = [layer.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, 1))
               for i, layer in enumerate(target.layers)]
    try:
        target.features(_ids(3), layer_ids=[1])
    finally:
        for h in handles:
            h.remove()
    assert calls == [1, 1, 0, 0]


def test_multimodal_wrapper_reads_its_language_model(saved):
    """Gemma3ForConditionalGeneration: the decoder stack is model.language_model, one level
    deeper than a causal LM's; get_decoder() finds it (the loader once refused the wrapper)."""
    _, ref = saved["gemma3"]
    target = TargetModel(ref)
    assert target.decoder is ref.model.language_model
    assert target.layers is ref.model.language_model.layers
    assert target.final_norm is ref.model.language_model.norm
    assert target.embed_tokens is ref.get_input_embeddings()
    assert target.lm_head.weight is target.embed_tokens.weight  # tied, as the config says


def test_image_text_qwen35_moe_checkpoint_loads_its_text_model(tmp_path):
    """The Qwen3.5 / 3.6 MoE releases are image-text checkpoints; the target is their language
    model, built by transformers from the same files."""
    torch.manual_seed(7)
    vlm = Qwen3_5MoeForConditionalGeneration(TINY["qwen3_5_moe"]()).eval()
    vlm.save_pretrained(tmp_path)
    target = load_target(tmp_path)
    assert type(target.model).__name__ == "Qwen3_5MoeForCausalLM"
    ids = _ids(4)
    with torch.inference_mode():
        out = vlm(input_ids=ids, output_hidden_states=True)
    logits, feats = target.logits_and_features(ids, [1, 3])
    assert (logits - out.logits).abs().max().item() < 1e-4
    expected = torch.cat([out.hidden_states[2], out.hidden_states[4]], dim=-1)
    assert (feats - expected).abs().max().item() < 1e-5


def test_a_model_without_a_decoder_stack_is_refused_in_one_line():
    class NoStack(torch.nn.Module):
        config = TINY["qwen3_moe"]()

        def get_decoder(self):
            return self
    with pytest.raises(TargetLoadError, match="no stack of layers") as exc_info:
        TargetModel(NoStack())
    assert "docs/targets.md" in exc_info.value.hint


# --------------------------------------------------------------------------------------------
# Remote code
# --------------------------------------------------------------------------------------------

REMOTE_CONFIG = '''from transformers import Qwen3Config


class TinyRemoteConfig(Qwen3Config):
    model_type = "tiny_remote"
'''
REMOTE_MODEL = '''from transformers import Qwen3ForCausalLM

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteForCausalLM(Qwen3ForCausalLM):
    config_class = TinyRemoteConfig
'''


@pytest.fixture
def remote_code_target(tmp_path, hf_modules_cache):
    """A folder whose model exists only as its own Python files (auto_map), as Kimi-K2's does.
    transformers copies such files into its modules cache: the session's (hf_modules_cache)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path / "remote"
    torch.manual_seed(8)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8)).save_pretrained(folder)
    return made_remote(folder)


def made_remote(folder):
    """A saved Qwen3 folder turned into one whose model exists only as its own Python files."""
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tiny_remote", architectures=["TinyRemoteForCausalLM"], auto_map={
        "AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
        "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_tiny_remote.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_tiny_remote.py").write_text(REMOTE_MODEL)
    return folder


def test_remote_code_is_refused_naming_the_key_and_never_asked(remote_code_target):
    with pytest.raises(TargetLoadError, match="needs its own code") as exc_info:
        load_target(remote_code_target)
    assert "target.trust_remote_code" in exc_info.value.hint
    assert "auto_map" in str(exc_info.value) and "tiny_remote" in str(exc_info.value)


def test_remote_code_runs_when_the_config_trusts_it(remote_code_target):
    target = load_target(remote_code_target, trust_remote_code=True)
    assert type(target.model).__name__ == "TinyRemoteForCausalLM"
    assert target.features(_ids(5), layer_ids=[1, 2]).shape == (2, 11, 64)


@pytest.mark.parametrize("lacks", ["configuration_tiny_remote.py", "modeling_tiny_remote.py"])
def test_trusted_code_the_folder_lacks_is_named_in_each_verbs_words(remote_code_target, lacks):
    """Issue 59: transformers said "Checkout 'https://huggingface.co/<folder>/tree/main'" and the
    hint told eval's user to set target.path in config.yaml, a file eval never reads."""
    from dflash_core.models.target.config import CONFIG_WORDS, FLAG_WORDS

    (remote_code_target / lacks).unlink()
    with pytest.raises(TargetLoadError) as exc_info:
        load_target(remote_code_target, trust_remote_code=True)
    exc = exc_info.value
    assert "lacks the Python files its config.json's auto_map names" in str(exc)
    assert lacks in str(exc) and "huggingface.co" not in str(exc)
    assert exc.hint == exc.hint_in(CONFIG_WORDS)  # a run's and check's: its config key
    assert lacks in exc.hint and "set target.path in config.yaml to" in exc.hint
    flags = exc.hint_in(FLAG_WORDS)  # eval's and the data verbs': the flag
    assert "pass --target" in flags and "config.yaml" not in flags and "target.path" not in flags


def test_data_inspect_names_the_code_its_target_lacks_and_its_flag(remote_code_target):
    from dflash_core.data.shards import DataError
    from dflash_tui.verbs.data import _load_target

    (remote_code_target / "modeling_tiny_remote.py").unlink()
    with pytest.raises(DataError) as exc_info:
        _load_target(str(remote_code_target), trust_remote_code=True)
    assert "modeling_tiny_remote.py" in str(exc_info.value)
    assert "huggingface.co" not in str(exc_info.value)
    assert "pass --target" in exc_info.value.hint and "config.yaml" not in exc_info.value.hint


def test_a_known_model_type_with_an_auto_map_is_built_by_transformers(saved, tmp_path):
    """DeepSeek-V3's release ships an auto_map although transformers builds deepseek_v3 itself:
    no remote code runs and nothing is refused."""
    import shutil

    src, _ = saved["deepseek_v3"]
    folder = shutil.copytree(src, tmp_path / "dsv3")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                          "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    target = load_target(folder)  # the .py files are not even there
    assert type(target.model).__name__ == "DeepseekV3ForCausalLM"


# --------------------------------------------------------------------------------------------
# Quantized checkpoints
# --------------------------------------------------------------------------------------------

FP8_BLOCK = 128


def _fp8_blockwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale_inv per 128 x 128 block, the weight they stand for)."""
    rows, cols = w.shape
    scales = torch.empty(math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))
    quant = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rs, cs = slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK), slice(j * FP8_BLOCK,
                                                                      (j + 1) * FP8_BLOCK)
            scales[i, j] = w[rs, cs].abs().max() / 448.0
            quant[rs, cs] = (w[rs, cs] / scales[i, j]).to(torch.float8_e4m3fn)
    dequant = quant.float() * scales.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(
        FP8_BLOCK, 1)[:, :cols]
    return quant, scales, dequant


def fp8_checkpoint(folder):
    """A Qwen3-MoE checkpoint as Qwen publishes its FP8 releases: per-expert gate / up / down
    matrices and every attention projection in float8 with block-wise scale_inv, the rest bf16.
    Returns the reference model holding the weights the checkpoint stands for."""
    import transformers as tf
    from transformers import AutoModelForCausalLM

    torch.manual_seed(9)
    config = tf.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               intermediate_size=256, moe_intermediate_size=128, num_experts=4,
                               num_experts_per_tok=2, tie_word_embeddings=False)
    ref = AutoModelForCausalLM.from_config(config).eval()
    tensors = {}

    def put(name, w):
        quant, scale, dequant = _fp8_blockwise(w)
        tensors[name + ".weight"], tensors[name + ".weight_scale_inv"] = quant, scale
        return dequant

    with torch.no_grad():
        for name, p in ref.named_parameters():
            base = name.rsplit(".", 1)[0]
            if name.endswith("experts.gate_up_proj"):
                half = p.shape[1] // 2
                for e in range(p.shape[0]):
                    p[e, :half] = put(f"{base}.{e}.gate_proj", p[e, :half])
                    p[e, half:] = put(f"{base}.{e}.up_proj", p[e, half:])
            elif name.endswith("experts.down_proj"):
                for e in range(p.shape[0]):
                    p[e] = put(f"{base}.{e}.down_proj", p[e])
            elif ".self_attn." in name and name.endswith("proj.weight"):
                p.copy_(put(base, p))
            else:
                p.copy_(p.to(torch.bfloat16).float())
                tensors[name] = p.to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_dict()
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                 "activation_scheme": "dynamic",
                                 "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (folder / "config.json").write_text(json.dumps(hf))
    return ref


def test_fp8_blockwise_checkpoint_loads_as_transformers_dequantizes_it_on_the_cpu(tmp_path):
    ref = fp8_checkpoint(tmp_path)
    target = load_target(tmp_path)  # no GPU: transformers dequantizes to the run's float32
    assert target.dtype == torch.float32
    ids = _ids(10)
    with torch.inference_mode():
        hs = ref(input_ids=ids, output_hidden_states=True).hidden_states
    feats = target.features(ids, layer_ids=[0, 1])
    assert (feats - torch.cat([hs[1], hs[2]], dim=-1)).abs().max().item() < 1e-5


FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_checkpoint(folder) -> dict:
    """A gpt-oss checkpoint as OpenAI publishes it: the experts' gate_up / down in MXFP4 (two
    4-bit values per byte, low nibble first, one power-of-two scale per 32 values), the rest bf16.
    Returns the experts' weights the blocks stand for, in transformers' layout."""
    model = build("gpt_oss", seed=11)
    gen = torch.Generator().manual_seed(12)
    tensors, expected = {}, {}
    for name, p in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, n_in, n_out = p.shape  # transformers keeps them [E, in, out]
            blocks = torch.randint(0, 256, (experts, n_out, n_in // 32, 16), dtype=torch.uint8,
                                   generator=gen)
            scales = torch.randint(124, 129, (experts, n_out, n_in // 32), dtype=torch.uint8,
                                   generator=gen)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            low, high = FP4_VALUES[(blocks & 15).long()], FP4_VALUES[(blocks >> 4).long()]
            values = torch.stack([low, high], dim=-1).reshape(experts, n_out, n_in // 32, 32)
            values = values * torch.exp2(scales.float() - 127)[..., None]
            expected[name] = values.reshape(experts, n_out, n_in).transpose(1, 2)
        else:
            tensors[name] = p.to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = TINY["gpt_oss"]().to_dict()
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(hf))
    return expected


def test_mxfp4_checkpoint_loads_as_transformers_dequantizes_it_on_the_cpu(tmp_path):
    expected = mxfp4_checkpoint(tmp_path)
    target = load_target(tmp_path, attn_implementation="eager")
    state = target.model.state_dict()
    for name, weight in expected.items():
        assert torch.equal(state[name], weight), name
    assert torch.isfinite(target.features(_ids(13), layer_ids=[1, 3])).all()
