"""A bad model or data file is the input's fault: reported with its kind, the file or key that
caused it and a hint, never as "[internal] ... a bug in dflash" (docs/bad-input.md).

| input                                        | kind   | names                          |
|----------------------------------------------|--------|--------------------------------|
| target config.json not JSON                  | config | target.path, the file          |
| target config.json without hidden_size       | config | target.path, the missing entry |
| target model.safetensors truncated           | config | the folder, "truncated"        |
| data token id >= the target's vocabulary     | data   | the id, the vocab, the samples |
| drafter 3 heads over the target's 2 kv heads | config | drafter.num_attention_heads    |
| drafter.num_key_value_heads 3 over 4 heads   | config | drafter.num_key_value_heads    |
| drafter.init_from not a checkpoint folder    | config | drafter.init_from              |
"""

import json
import shutil

import pytest

from dflash_core.data import write_shards
from dflash_core.pipeline.engine import Engine
from dflash_core.observe.events import Error, RunEnded, StepMetrics

from .engine_fixtures import (  # noqa: F401 - assets is a fixture
    VOCAB, assets, make_config, run_to_end, shutdown_started_engines,
)


def bad_target_json(target, root):
    (root / "config.json").write_text("{oops")


def target_without_hidden_size(target, root):
    cfg = json.loads((root / "config.json").read_text())
    del cfg["hidden_size"]
    (root / "config.json").write_text(json.dumps(cfg))


def truncated_target_weights(target, root):
    weights = root / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


CASES = {
    "target config not JSON": (bad_target_json, {}, "config", ["target.path", "config.json",
                                                               "cannot be read as JSON"]),
    "target config lacks hidden_size": (target_without_hidden_size, {}, "config",
                                        ["target.path", "'hidden_size'"]),
    "target weights truncated": (truncated_target_weights, {}, "config",
                                 ["weights in", "cannot be read"]),
    "drafter heads not a multiple of kv heads": (None, {"drafter__num_attention_heads": 3},
                                                 "config", ["drafter.num_attention_heads",
                                                            "3 attention heads and 2"]),
    "drafter kv heads do not divide heads": (None, {"drafter__num_key_value_heads": 3}, "config",
                                             ["drafter.num_key_value_heads", "4 attention heads"]),
    "init_from not a checkpoint": (None, {"drafter__init_from": "/nonexistent/ckpt"}, "config",
                                   ["drafter.init_from", "/nonexistent/ckpt"]),
}


def fatal_of(cfg) -> tuple[Error, list]:
    engine = Engine(cfg)
    rec = run_to_end(engine)
    engine.shutdown()
    assert rec.of(RunEnded)[0].status == "failed"
    (err,) = [e for e in rec.of(Error) if e.fatal]
    return err, rec.of(StepMetrics)


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_model_input_is_named_not_called_a_bug(tmp_path, assets, name):
    spoil, over, kind, fragments = CASES[name]
    target, data = assets
    if spoil is not None:
        copy = tmp_path / "target"
        shutil.copytree(target, copy)
        spoil(target, copy)
        target = copy
    err, steps = fatal_of(make_config(tmp_path, target, data, data__eval_prompts=0, **over))
    assert err.error_kind == kind, err.message
    assert "bug" not in err.hint and err.hint
    for fragment in fragments:
        assert fragment in err.message, err.message
    assert not steps


def test_token_ids_outside_the_vocabulary_are_the_datas_fault(tmp_path, assets):
    target, _ = assets
    rows = [{"input_ids": list(range(10, 60)) + [VOCAB + 50], "loss_mask": [1] * 51}
            for _ in range(16)]
    data = write_shards(rows, tmp_path / "data", samples_per_shard=8) and tmp_path / "data"
    err, steps = fatal_of(make_config(tmp_path, target, data, data__eval_prompts=0))
    assert err.error_kind == "data"
    assert f"token id {VOCAB + 50} is outside the target's vocabulary (0..{VOCAB - 1})" \
        in err.message
    assert "re-tokenize" in err.hint and not steps
