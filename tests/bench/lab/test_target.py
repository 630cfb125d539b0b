"""bench/lab/target.py: the target trained on the corpus, saved as a transformers folder, the same
for the same seed, cached; and the conversations it writes (conversations.py)."""

import json

import pytest
import torch

from bench.lab.conversations import greedy_batch
from bench.lab.corpus import collect
from bench.lab.errors import LabError
from bench.lab.scales import scale_named
from bench.lab.target import META_NAME, PROBE_TEXT, ensure_target

MICRO = scale_named("tiny").replace(
    packages=("labfake_pkg", "labfake_single"), heldout_per_mille=200, chat_per_mille=200,
    vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, intermediate_size=64, max_position_embeddings=128,
    train_steps=6, train_batch=2, train_seq=32, train_warmup=2, heldout_windows=2)


def _corpus(scale=MICRO):
    return collect(scale.packages, heldout_per_mille=scale.heldout_per_mille,
                   chat_per_mille=scale.chat_per_mille, max_file_bytes=scale.max_file_bytes)


def test_the_target_is_a_transformers_folder_the_same_for_a_seed_and_cached(fake_site, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    corpus = _corpus()
    lines = []
    folder, record = ensure_target(tmp_path / "a", MICRO, corpus, 3, "cpu", lines.append)
    assert record["heldout_loss"] > 0 and record["parameters"] > 0
    assert record["mask_token_id"] == record["vocab_size"] - 1 and record["eos_token_id"] == 0
    assert record["corpus"]["files"]["heldout"] > 0
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == "qwen3" and model.config.vocab_size == len(tok)
    assert tok.apply_chat_template([{"role": "user", "content": "x = 1"}], tokenize=False,
                                   add_generation_prompt=True) == "x = 1"
    with torch.no_grad():  # the saved weights are the trained ones
        probe = model(input_ids=torch.tensor([tok(PROBE_TEXT)["input_ids"]])).logits[0, -1, :16]
    assert probe.tolist() == pytest.approx(record["probe_logits"], abs=1e-5)
    # the same seed elsewhere: the same weights and tokenizer, bit for bit
    other, _ = ensure_target(tmp_path / "b", MICRO, corpus, 3, "cpu", lines.append)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (other / name).read_bytes() == (folder / name).read_bytes()
    seed4, _ = ensure_target(tmp_path / "c", MICRO, corpus, 4, "cpu", lines.append)
    assert (seed4 / "model.safetensors").read_bytes() != (folder / "model.safetensors").read_bytes()
    # a second call reuses the folder; another recipe there is refused, the folder kept
    stamp = (folder / META_NAME).stat().st_mtime_ns
    ensure_target(tmp_path / "a", MICRO, corpus, 3, "cpu", lines.append)
    assert (folder / META_NAME).stat().st_mtime_ns == stamp
    with pytest.raises(LabError, match="other settings") as err:
        ensure_target(tmp_path / "a", MICRO.replace(train_steps=7), corpus, 3, "cpu", lines.append)
    assert "another --dir" in err.value.hint
    assert json.loads((folder / META_NAME).read_text())["steps"] == 6


def test_the_target_is_a_folder_a_server_loads_and_an_older_one_gains_its_architecture(
        fake_site, tmp_path):
    from transformers import AutoTokenizer

    from dflash_core.models.target.servable import serving_gaps

    folder, _ = ensure_target(tmp_path / "a", MICRO, _corpus(), 3, "cpu", lambda line: None)
    config = folder / "config.json"
    assert json.loads(config.read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert serving_gaps(folder) == []
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert tok.mask_token == "<|MASK|>" and tok.mask_token_id == len(tok) - 1
    # a folder built before its config named the architecture: the next call names it
    old = json.loads(config.read_text())
    del old["architectures"]
    config.write_text(json.dumps(old))
    lines = []
    ensure_target(tmp_path / "a", MICRO, _corpus(), 3, "cpu", lines.append)
    assert json.loads(config.read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert any("names its architecture now" in line for line in lines)


def test_batched_generation_with_left_padding_equals_each_prompt_alone(fake_site, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, record = ensure_target(tmp_path / "t", MICRO, _corpus(), 0, "cpu", lambda m: None)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[5, 17, 40, 9, 33, 60, 71], [12, 7], [90, 91, 92, 93]]
    together = greedy_batch(model, prompts, 6, record["eos_token_id"], "cpu")
    alone = [greedy_batch(model, [p], 6, record["eos_token_id"], "cpu")[0] for p in prompts]
    assert together == alone
    assert all(len(a) <= 6 and record["eos_token_id"] not in a for a in together)


def test_a_build_that_would_pass_its_time_cap_stops_naming_the_steps_that_fit(fake_site,
                                                                               tmp_path):
    capped = MICRO.replace(train_minutes_cap=1e-6)
    with pytest.raises(LabError, match="past train_minutes_cap") as err:
        ensure_target(tmp_path, capped, _corpus(), 0, "cpu", lambda m: None)
    assert "--set train_steps=0" in err.value.hint  # nothing fits a cap of 60 microseconds
    assert not (tmp_path / "target").exists()  # no half-built target left behind
    assert (tmp_path / "tokens" / "lab_tokens.json").is_file()  # the tokenizer is kept
