"""A checkpoint folder is servable as it is (issue 46): vLLM's and SGLang's default loaders read
every ``*.safetensors`` at a folder's top level (or the files a model.safetensors.index.json
names). Read that way, a DFlash and a DSpark step-N folder, written in this thread or by the
background writers, and the folder checkpoints/best names, give exactly the drafter's weights in
the served dtype, and not one training-state tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import Qwen3Config

from dflash_core.checkpoint import save_load as ckpt
from dflash_core.checkpoint.async_writer import CheckpointWriter
from dflash_core.checkpoint.folders import mark_best, read_best
from dflash_core.checkpoint.layout import CHECKPOINTS, CHECKSUMS, STATE_DIR
from dflash_core.checkpoint.checksums import Verified, verify
from dflash_core.models.dspark import format as dspark_format
from dflash_core.models.registry import new_drafter
from dflash_core.models.dspark.drafter import DSparkSettings

from .old_formats import to_format

VOCAB, HIDDEN = 96, 32
TARGET = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              tie_word_embeddings=False)
SERVED_DTYPE = torch.bfloat16
# What the training state names its tensors (save_load.make_job, state_tree.flatten).
TRAINING_PREFIXES = ("master/", "served/", "optimizer/", "scheduler/", "trainer/")


def served_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors a serving stack's default loader finds in ``folder``: the files its
    model.safetensors.index.json names, else every ``*.safetensors`` at the top level (no
    subfolder); a name met twice fails, as it does there."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                assert k not in found, f"{k} in two files of {folder}"
                found[k] = h.get_tensor(k)
    return found


def _drafter(objective: str):
    torch.manual_seed(0)
    target = Qwen3Config(**TARGET)
    d = new_drafter(objective, target, num_layers=1, target_layer_ids=[1, 2], block_size=4,
                    mask_token_id=VOCAB - 1,
                    settings=DSparkSettings(block_size=3, markov_rank=8))
    if objective == "dspark":
        d.attach_target_head(nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False))
    opt = torch.optim.AdamW(d.parameters(), lr=1e-3)
    sum(p.sum() for p in d.parameters()).backward()  # every parameter gets its moments
    opt.step()
    return d, opt


def _job_args(d, opt, objective: str) -> dict:
    dspark = objective == "dspark"
    return dict(drafter_state={k: v.detach() for k, v in d.state_dict().items()},
                drafter_config=dspark_format.serve_config(d) if dspark
                else d.interchange_config(),
                optimizer_state=opt.state_dict(), scheduler_state={"last_epoch": 3},
                trainer_state={"rng": ckpt.capture_rng_state()}, served_dtype=SERVED_DTYPE,
                served_extra=dspark_format.frozen_tensors(d) if dspark else None)


def _expected(d, objective: str) -> dict[str, torch.Tensor]:
    """The drafter's weights as served: its state dict (DSpark's with the target's embedding and
    lm_head copies), floats in the served dtype."""
    state = dspark_format.serve_state(d) if objective == "dspark" else d.interchange_state()
    return {k: v.to(SERVED_DTYPE) if v.is_floating_point() else v for k, v in state.items()}


def _save(tmp_path: Path, d, opt, objective: str, writer: str) -> Path:
    args = _job_args(d, opt, objective)
    if writer == "this thread":
        return ckpt.save_checkpoint(tmp_path, 3, keep=2, **args)
    w = CheckpointWriter(tmp_path, 2, mode="thread")  # two writers: two shards
    try:
        w.start()
        job = ckpt.make_job(3, writers=2, **args)
        w.save(job, [job.tensors], keep=2)
        out = w.wait(60)
    finally:
        w.close()
    assert out is not None and out.error == "", out
    return out.path


def _assert_serves(folder: Path, want: dict[str, torch.Tensor]) -> None:
    got = served_tensors(folder)
    met = sorted(k for k in got if k.startswith(TRAINING_PREFIXES))
    assert not met, f"a server reading {folder} meets training state: {met[:5]}"
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("writer", ["this thread", "background writers"])
@pytest.mark.parametrize("objective", ["dflash", "dspark"])
def test_a_step_folder_serves_exactly_the_drafter(tmp_path, objective, writer):
    d, opt = _drafter(objective)
    folder = _save(tmp_path, d, opt, objective, writer)
    assert sorted(p.name for p in folder.iterdir()) == [
        CHECKSUMS, "config.json", "model.safetensors", STATE_DIR]
    want = _expected(d, objective)
    _assert_serves(folder, want)
    assert json.loads((folder / "config.json").read_text())["architectures"] == \
        (["Qwen3DSparkModel"] if objective == "dspark" else ["DFlashDraftModel"])
    # the training state is all there, where no server looks, and resumes
    shards = sorted((folder / STATE_DIR).glob("*.safetensors"))
    assert len(shards) == (1 if writer == "this thread" else 2)
    assert verify(folder) == Verified(4, [], "")
    loaded = ckpt.load_checkpoint(folder)
    assert loaded.step == 3 and loaded.scheduler_state == {"last_epoch": 3}
    for k, v in d.state_dict().items():
        assert torch.equal(loaded.drafter_state[k], v)  # the float32 masters
    # checkpoints/best names a step folder: the one a server is pointed at
    mark_best(tmp_path, folder, 3, 2.5)
    best = tmp_path / CHECKPOINTS / read_best(tmp_path)["path"]
    assert best == folder
    _assert_serves(best, want)


def test_the_loader_here_meets_a_format_3_folder_s_training_state(tmp_path):
    # What the layout fixes: in a format-3 folder the shards lie beside model.safetensors, and a
    # top-level glob reads them; an index naming model.safetensors alone is honoured.
    d, opt = _drafter("dflash")
    folder = to_format(_save(tmp_path, d, opt, "dflash", "this thread"), 3)
    met = [k for k in served_tensors(folder) if k.startswith(TRAINING_PREFIXES)]
    assert any(k.startswith("master/") for k in met) and any(
        k.startswith("optimizer/") for k in met)
    want = _expected(d, "dflash")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in want}}))
    _assert_serves(folder, want)
