"""DSpark checkpoints: model.safetensors is the served folder vLLM and SGLang load (the trained
weights and the heads, plus the frozen copies of the target's embedding and lm_head, in the
served dtype), the training state holds none of the frozen copies, the background writer stages
them once, and a resume refuses the other objective or another block size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_core.config import ConfigError, config_from_dict
from dflash_core.models.dspark import format as dspark_format
from dflash_core.families.registry import settings as dspark_settings
from dflash_core.models.registry import new_drafter
from dflash_core.models.dspark.drafter import DSparkDrafter, DSparkSettings
from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.layout import SERVED, STATE_PATH
from dflash_core.checkpoint.async_writer import CheckpointWriter
from dflash_core.checkpoint.staging import Staging
from dflash_core.checkpoint.resume import expected_drafter_config, load_for_resume
from dflash_core.checkpoint import size as checkpoint_size

VOCAB, HIDDEN, LAYERS = 96, 32, 4
TARGET = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
              num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("target")
    Qwen3ForCausalLM(Qwen3Config(**TARGET)).save_pretrained(folder, safe_serialization=True)
    return folder


def _cfg(block_size=3, objective="dspark", **drafter):
    cfg = config_from_dict({"drafter": {"num_layers": 1, "block_size": block_size, **drafter},
                            "target": {"layer_ids": [1, 2]}})
    cfg.drafter.objective = objective
    cfg.drafter.markov_rank = 8
    return cfg


def _drafter(cfg, seed=0) -> DSparkDrafter:
    torch.manual_seed(seed)
    target = Qwen3Config(**TARGET)
    d = new_drafter("dspark", target, num_layers=1, target_layer_ids=[1, 2], block_size=0,
                    mask_token_id=VOCAB - 1, settings=dspark_settings(cfg))
    embed = nn.Embedding(VOCAB, HIDDEN)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    d.attach_target_head(embed, head)
    return d


def _opt(d):
    opt = torch.optim.AdamW(d.parameters(), lr=1e-3)
    sum(p.sum() for p in d.parameters()).backward()  # every parameter gets its moments
    opt.step()
    return opt


def _save_args(d, opt, served=True):
    return dict(drafter_state={k: v.detach() for k, v in d.state_dict().items()},
                drafter_config=dspark_format.serve_config(d), optimizer_state=opt.state_dict(),
                scheduler_state={}, trainer_state={"x": 1}, served_dtype=torch.bfloat16,
                served_extra=dspark_format.frozen_tensors(d) if served else None)


def _check_served_folder(folder: Path, d: DSparkDrafter):
    """model.safetensors + config.json as a server reads them; the training state without the
    frozen copies; the drafter loads back through the served layout."""
    served = load_file(str(folder / "model.safetensors"))
    own = set(d.state_dict())
    assert set(served) == own | set(dspark_format.FROZEN_KEYS)
    assert all(t.dtype == torch.bfloat16 for t in served.values())
    assert served["markov_head.markov_w1.weight"].shape == (VOCAB, 8)
    assert served["markov_head.markov_w2.weight"].shape == (VOCAB, 8)
    assert served["confidence_head.proj.weight"].shape == (1, HIDDEN + 8)
    assert torch.equal(served["lm_head.weight"], d.lm_head.weight.detach().bfloat16())
    assert torch.equal(served["embed_tokens.weight"], d.embed_tokens.weight.detach().bfloat16())
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in config
    assert (config["block_size"], config["markov_rank"]) == (3, 8)
    state = folder / STATE_PATH
    for shard in json.loads(state.read_text())["shards"]:
        names = set(load_file(str(state.parent / shard)))
        assert not any(n.startswith(f"{SERVED}/") or n.endswith(k)
                       for n in names for k in dspark_format.FROZEN_KEYS), names
    loaded = ckpt.load_checkpoint(folder)
    assert set(loaded.drafter_state) == own  # the masters: no frozen copy
    for k, v in d.state_dict().items():
        assert torch.equal(loaded.drafter_state[k], v)
    back = DSparkDrafter.load(folder)  # the served layout, frozen copies set aside
    head = dspark_format.load_head(folder)
    assert set(head) == set(dspark_format.FROZEN_KEYS)
    for k, v in back.state_dict().items():
        assert torch.equal(v, d.state_dict()[k].bfloat16().float())
    # the size estimate is what is on disk, to the JSON and headers
    params, matrices = checkpoint_size.state_counts(d.state_dict(), d.adamw_only)
    est = checkpoint_size.checkpoint_bytes(params, matrices, 2, "adamw",
                                           dspark_format.frozen_numel(d.config))
    data = sum(p.stat().st_size for p in folder.rglob("*.safetensors"))
    assert est <= data < est + 64 * 1024


def test_saved_in_this_thread(tmp_path):
    d = _drafter(_cfg())
    opt = _opt(d)
    path = ckpt.save_checkpoint(tmp_path, 3, keep=2, **_save_args(d, opt))
    _check_served_folder(path, d)


def test_written_in_the_background_with_the_copies_staged_once(tmp_path):
    d = _drafter(_cfg())
    opt = _opt(d)
    w = CheckpointWriter(tmp_path, 2, mode="thread")
    try:
        w.start()
        job = ckpt.make_job(1, writers=2, **_save_args(d, opt))
        assert job.static == {f"{SERVED}/{k}" for k in dspark_format.FROZEN_KEYS}
        w.save(job, [job.tensors], keep=3)
        first = w.wait(60)
        staged = dict(w.staging.tensors)
        assert w.staging.staged_static == job.static
        job2 = ckpt.make_job(2, writers=2, **_save_args(d, opt))
        w.save(job2, [job2.tensors], keep=3)
        second = w.wait(60)
    finally:
        w.close()
    assert first.error == "" and second.error == ""
    _check_served_folder(first.path, d)
    _check_served_folder(second.path, d)
    assert set(staged) >= job.static


def test_static_tensors_are_copied_once_per_arena():
    """Frozen copies never change in a run: the second stage of the same arena leaves them, a
    new arena copies them again."""
    st = Staging(shared=False)
    src = {"a": torch.ones(4), "frozen": torch.ones(3)}
    st.ensure(src)
    st.stage([src], {}, frozenset({"frozen"}))
    src["a"].fill_(2)
    src["frozen"].fill_(5)
    st.stage([src], {}, frozenset({"frozen"}))
    assert torch.equal(st.tensors["a"], torch.full((4,), 2.0))
    assert torch.equal(st.tensors["frozen"], torch.ones(3))
    st.ensure({"a": torch.ones(5), "frozen": torch.ones(3)})  # another layout: a new arena
    st.stage([{"a": torch.ones(5), "frozen": src["frozen"]}], {}, frozenset({"frozen"}))
    assert torch.equal(st.tensors["frozen"], torch.full((3,), 5.0))
    st.close()


def test_make_job_refuses_a_served_tensor_that_is_also_trained():
    with pytest.raises(TypeError, match="also a trained weight"):
        ckpt.make_job(1, drafter_state={"w": torch.ones(2)}, drafter_config={},
                      optimizer_state={}, scheduler_state={}, trainer_state={},
                      served_extra={"w": torch.ones(2)})


def _resume(run_dir, cfg, target_folder):
    published = []
    expected = expected_drafter_config(cfg, target_folder, [1, 2], VOCAB - 1)
    return load_for_resume(run_dir, expected, published.append)


def test_resume_reads_its_own_and_refuses_the_other_objective(tmp_path, target_folder):
    cfg = _cfg()
    d = _drafter(cfg)
    ckpt.save_checkpoint(tmp_path, 5, keep=2, **_save_args(d, _opt(d)))
    # what a run of this config would write is what it wrote: no shape difference
    loaded = _resume(tmp_path, cfg, target_folder)
    assert loaded.step == 5
    with pytest.raises(ConfigError) as exc:
        _resume(tmp_path, _cfg(objective="dflash"), target_folder)
    err = exc.value
    assert err.key == "drafter.objective"
    assert "holds a DSpark drafter, but drafter.objective is dflash" in str(err)
    assert "\n" not in str(err) and "drafter.objective: dspark" in err.hint


def test_resume_of_a_dflash_checkpoint_as_dspark_is_refused(tmp_path, target_folder):
    flash = config_from_dict({"drafter": {"objective": "dflash", "num_layers": 1, "block_size": 3},
                              "target": {"layer_ids": [1, 2]}})
    expected = expected_drafter_config(flash, target_folder, [1, 2], VOCAB - 1)
    ckpt.save_checkpoint(tmp_path, 2, drafter_state={"fc.weight": torch.zeros(2, 2)},
                         drafter_config=expected, optimizer_state={}, scheduler_state={},
                         trainer_state={}, keep=2)
    with pytest.raises(ConfigError, match="holds a DFlash drafter, but drafter.objective is "
                                          "dspark") as exc:
        _resume(tmp_path, _cfg(), target_folder)
    assert exc.value.key == "drafter.objective"


@pytest.mark.parametrize("change, key", [
    ({"block_size": 5}, "drafter.block_size"),
    ({"markov_rank": 16}, "drafter.markov_rank"),
    ({"conf_weight": 0.0}, "drafter.conf_weight"),
])
def test_resume_with_another_dspark_shape_is_refused(tmp_path, target_folder, change, key):
    """A config whose B (or rank, or confidence head) differs from the checkpoint's: refused,
    naming the key and both values, not loaded into another layout."""
    cfg = _cfg()
    d = _drafter(cfg)
    ckpt.save_checkpoint(tmp_path, 4, keep=2, **_save_args(d, _opt(d)))
    other = _cfg(block_size=change.get("block_size", 3))
    for k, v in change.items():
        setattr(other.drafter, k, v)
    with pytest.raises(ConfigError) as exc:
        _resume(tmp_path, other, target_folder)
    assert exc.value.key == key and "another drafter than the config describes" in str(exc.value)


def test_build_replicas_resumes_from_served_weights_without_the_frozen_copies(tmp_path):
    """A checkpoint read without master weights gives model.safetensors as the state, frozen
    copies included: the replicas load the rest and borrow the target's."""
    from types import SimpleNamespace

    from dflash_core.models.target.model import TargetModel
    from dflash_core.models.training.trainer import build_replicas

    torch.manual_seed(0)
    tm = TargetModel(Qwen3ForCausalLM(Qwen3Config(**TARGET)))
    cfg = _cfg()
    d = _drafter(cfg)
    state = dspark_format.serve_state(d)
    resume = SimpleNamespace(drafter_config=dspark_format.serve_config(d), drafter_state=state,
                             optimizer_state=torch.optim.AdamW(d.parameters()).state_dict())
    (rep,) = build_replicas(cfg.drafter, cfg.optim, tm, [torch.device("cpu")], seed=0,
                            layer_ids=[1, 2], mask_id=VOCAB - 1, resume=resume,
                            settings=dspark_settings(cfg))
    for k, v in d.state_dict().items():
        assert torch.equal(rep.drafter.state_dict()[k], v)
    assert torch.equal(rep.drafter.lm_head.weight, tm.lm_head.weight)
    assert isinstance(rep.settings, DSparkSettings)
