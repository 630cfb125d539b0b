"""Drafters, prompt files and small chat targets for the benchmark evaluation's tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_core.data.byte_vocab import MASK_ID
from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
from dflash_core.models.dspark.drafter import DSparkDrafter, DSparkSettings, build_dspark_config

# Layers of the demo target these drafters read: its last one included, so evaluation's reading
# of it (after the final norm, as the reference's) stays covered; the demo itself trains on
# demo.DEMO_LAYER_IDS, below the last.
DEMO_LAYERS = [1, 2, 3]
# The template's own thinking switch, as Qwen3's: off writes an empty reasoning block.
THINK_TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
    "'<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}")


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: tiny matrices, and a busy 2-core machine (no spinning)."""
    from dflash_core.demo import torch_threads

    with torch_threads(1):
        yield


def save_dflash(folder: Path, target_config, seed: int, layers=DEMO_LAYERS, block: int = 4,
                mask: int = MASK_ID) -> Path:
    cfg = build_drafter_config(target_config, num_layers=1, target_layer_ids=list(layers),
                               block_size=block, mask_token_id=mask)
    torch.manual_seed(seed)
    DFlashDrafter(cfg).save(folder)
    return folder


def save_dspark(folder: Path, target_config, seed: int, layers=DEMO_LAYERS, block: int = 3,
                mask: int = MASK_ID) -> Path:
    cfg = build_dspark_config(target_config, num_layers=1, target_layer_ids=list(layers),
                              mask_token_id=mask,
                              settings=DSparkSettings(block_size=block, markov_rank=8))
    torch.manual_seed(seed)
    d = DSparkDrafter(cfg)
    # the served folder carries copies of the target's embedding and lm_head; any of the right
    # shape will do here, an evaluation attaches the target's own
    V, H = cfg.vocab_size, cfg.hidden_size
    d.attach_target_head(torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False))
    d.save(folder, dtype=None)
    return folder


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# Prompts in the style of the demo target's text (Python's help topics)
DEMO_TEXTS = [
    "The value of an expression is ", "Built-in functions and the return ",
    "If the object is a class, the ", "A sequence of statements that ",
    "The following identifiers are used as ", "Exceptions are raised when ",
    "The method is called with the ", "For a list of the objects, ",
    "Attribute references are ", "This is the default behaviour of the ",
]


@pytest.fixture(scope="session")
def demo_hf_config(demo_target):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(demo_target)


@pytest.fixture(scope="module")
def module_thread():
    """One thread for a module's fixtures too (they are set up before the function's)."""
    from dflash_core.demo import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def demo_eval(tmp_path_factory, demo_target, demo_hf_config, module_thread):
    """Two DFlash drafters of the demo target and two prompt sets (messages and prompt)."""
    root = tmp_path_factory.mktemp("demo-eval")
    texts = DEMO_TEXTS
    sets = {
        "chat": write_jsonl(root / "chat.jsonl", [
            {"id": f"c{k}", "messages": [{"role": "user", "content": t}]}
            for k, t in enumerate(texts[:5])]),
        "plain": write_jsonl(root / "plain.jsonl", [{"prompt": t} for t in texts[5:]]),
    }
    drafters = [save_dflash(root / "d1", demo_hf_config, 1),
                save_dflash(root / "d2", demo_hf_config, 2, block=6)]
    return {"root": root, "sets": sets, "drafters": drafters, "target": demo_target}


def chat_target(folder: Path, template: str = THINK_TEMPLATE, hybrid: bool = False) -> Path:
    """A tiny Qwen3 (or Qwen3.5, attention and Gated DeltaNet) with random weights, saved with
    a byte-level BPE tokenizer and ``template``: a target with a real chat template."""
    from transformers import AutoTokenizer

    from tests.core.data.chat_fixtures import train_bpe

    train_bpe(folder, template)
    tok = AutoTokenizer.from_pretrained(str(folder))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=512, eos_token_id=end,
                  pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    if hybrid:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            **common, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4))
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model.save_pretrained(str(folder))
    return folder
