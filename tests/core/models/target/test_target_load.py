"""dflash_core.models.target.load: loading a saved target with progress, stopping a load, and
refusing a bad folder in one line; the checkpoints are those of test_target.py."""

from __future__ import annotations

import json
import shutil
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_core.models.target.config import TargetLoadError
from dflash_core.models.target.load import LoadAborted, load_target

from .test_target import COMMON, VOCAB, checkpoints  # noqa: F401 - checkpoints is a fixture


def kept(infos: list):
    """A load_target progress callback that keeps each report, its fields as attributes."""
    return lambda **fields: infos.append(SimpleNamespace(**fields))


def test_progress_reports_every_shard(checkpoints):
    folder, ref = checkpoints["qwen3_5"]
    files = sorted(folder.glob("*.safetensors"))
    infos = []
    target = load_target(folder, progress=kept(infos))
    total = sum(f.stat().st_size for f in files)
    assert all(i.bytes_total == total and i.shards_total == len(files) for i in infos)
    loaded_bytes = [i.bytes_loaded for i in infos]
    assert loaded_bytes == sorted(loaded_bytes) and loaded_bytes[0] == 0
    shards = [i.shards_loaded for i in infos]
    assert shards == sorted(shards)
    # Each shard boundary is reported, with the bytes read so far.
    assert set(range(len(files) + 1)) <= set(shards)
    for i in infos:
        done_bytes = sum(f.stat().st_size for f in files[:i.shards_loaded])
        assert i.bytes_loaded >= done_bytes
    seconds = [i.seconds for i in infos]
    assert seconds == sorted(seconds)
    assert [i.done for i in infos] == [False] * (len(infos) - 1) + [True]
    last = infos[-1]
    assert (last.bytes_loaded, last.shards_loaded) == (total, len(files))
    params = sum(p.numel() * p.element_size() for p in ref.parameters())
    assert last.memory_after == params == target.memory_bytes()
    assert all(i.memory_after == 0 for i in infos[:-1])


def test_string_dtype(checkpoints):
    folder, _ = checkpoints["qwen3"]
    target = load_target(folder, dtype="bfloat16")
    assert target.dtype == torch.bfloat16
    assert target.features(torch.randint(0, VOCAB, (1, 4)), layer_ids=[1]).dtype == torch.bfloat16


def test_stop_before_loading(checkpoints):
    folder, _ = checkpoints["qwen3_5"]
    stop = threading.Event()
    stop.set()
    infos = []
    with pytest.raises(LoadAborted):
        load_target(folder, progress=kept(infos), stop=stop)
    assert all(i.shards_loaded == 0 for i in infos)


def test_stop_during_loading(checkpoints):
    folder, _ = checkpoints["qwen3_5"]
    stop = threading.Event()
    infos = []

    def progress(**fields):
        info = SimpleNamespace(**fields)
        infos.append(info)
        if info.shards_loaded == 1:
            stop.set()  # as if the operator pressed abort while shard 1 was done

    with pytest.raises(LoadAborted):
        load_target(folder, progress=progress, stop=stop)
    assert max(i.shards_loaded for i in infos) == 1
    assert not any(i.done for i in infos)


def _assert_path_error(exc_info, folder):
    err = exc_info.value
    assert isinstance(err, RuntimeError)
    assert err.error_kind == "config"
    assert "target.path" in err.hint
    assert str(folder) in str(err)


def test_missing_folder(tmp_path):
    folder = tmp_path / "nope"
    with pytest.raises(TargetLoadError) as exc_info:
        load_target(folder)
    _assert_path_error(exc_info, folder)


def test_folder_without_config(checkpoints, tmp_path):
    src, _ = checkpoints["qwen3"]
    shutil.copy(src / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(TargetLoadError, match="config.json") as exc_info:
        load_target(tmp_path)
    _assert_path_error(exc_info, tmp_path)


def test_folder_without_safetensors(checkpoints, tmp_path):
    src, ref = checkpoints["qwen3"]
    shutil.copy(src / "config.json", tmp_path / "config.json")
    torch.save(ref.state_dict(), tmp_path / "pytorch_model.bin")  # pickled weights: refused
    with pytest.raises(TargetLoadError, match="safetensors") as exc_info:
        load_target(tmp_path)
    _assert_path_error(exc_info, tmp_path)


def test_index_naming_a_missing_shard(checkpoints, tmp_path):
    src, _ = checkpoints["qwen3_5"]
    folder = tmp_path / "ckpt"
    shutil.copytree(src, folder)
    victim = sorted(folder.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(TargetLoadError, match=victim.name) as exc_info:
        load_target(folder)
    _assert_path_error(exc_info, folder)


def test_checkpoint_missing_a_weight(checkpoints, tmp_path):
    src, _ = checkpoints["qwen3"]
    folder = tmp_path / "ckpt"
    shutil.copytree(src, folder)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.2.mlp.down_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TargetLoadError, match="down_proj"):
        load_target(folder)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(TargetLoadError) as exc_info:
        load_target(tmp_path)
    assert exc_info.value.error_kind == "config"


def test_two_threads_loading_targets_at_once_leave_weight_tying_on(tmp_path, monkeypatch):
    """Two target workers load at the same moment. transformers builds each model inside context
    managers that patch PreTrainedModel.tie_weights (and torch.linspace) process-wide; two builds
    overlapping in time put back each other's patch, leaving tying off for good (and a tied
    lm_head untied). Here the builds are made to overlap, and the thread that started second is
    made to finish second, which leaks the patch unless load_target builds one at a time."""
    from transformers import PreTrainedModel

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**{**COMMON, "tie_word_embeddings": True})).save_pretrained(
        tmp_path / "tied", safe_serialization=True)
    tie_weights, linspace = PreTrainedModel.tie_weights, torch.linspace
    meet = threading.Barrier(2, timeout=1.0)
    arrivals: list[str] = []
    init = Qwen3ForCausalLM.__init__

    def overlapping_init(self, config):
        arrivals.append(threading.current_thread().name)
        try:
            meet.wait()  # both builds inside transformers' patches at once, if they can be
        except threading.BrokenBarrierError:
            pass  # built alone (one at a time): nobody to meet
        if arrivals.index(threading.current_thread().name) == 1:
            time.sleep(0.3)  # the later starter finishes later: it puts back the first one's patch
        init(self, config)
    monkeypatch.setattr(Qwen3ForCausalLM, "__init__", overlapping_init)
    models, errors = {}, []

    def load(name):
        try:
            models[name] = load_target(tmp_path / "tied")
        except Exception as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)
    threads = [threading.Thread(target=load, args=(f"t{k}",), name=f"t{k}") for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert PreTrainedModel.tie_weights is tie_weights and torch.linspace is linspace
    for m in models.values():
        assert m.lm_head.weight is m.embed_tokens.weight  # tied, as the config says
