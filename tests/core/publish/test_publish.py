"""dflash_core.publish: a run's checkpoint as a clean folder for a model hub (issue 46 item 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_core.checkpoint.layout import SERVED_FILES
from dflash_core.publish.folder import PublishError, publish
from dflash_core.publish.card import MARK

from .run_fixture import DSPARK_B, DFLASH_B, TARGET, make_run


def _card(out: Path) -> tuple[dict, str]:
    text = (out / "README.md").read_text()
    _, front, body = text.split("---\n", 2)
    return yaml.safe_load(front), body


def _same_bytes(a: Path, b: Path) -> None:
    for name in SERVED_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_dflash_run_publishes_its_best_checkpoint(tmp_path):
    run = make_run(tmp_path, "dflash", steps=(3, 6), best=3)
    out = tmp_path / "hub" / "drafter"
    lines = []
    done = publish(run, out, note=lines.append)
    assert done.checkpoint == run / "checkpoints" / "step-3" and not done.replaced
    assert "checkpoints/best names step-3" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", *SERVED_FILES]
    _same_bytes(done.checkpoint, out)
    front, body = _card(out)
    assert front["base_model"] == TARGET and front["pipeline_tag"] == "text-generation"
    assert front["library_name"] and {"dflash", "speculative-decoding"} <= set(front["tags"])
    for fact in (f"`{TARGET}`", "| objective | DFlash |", f"| block size B | {DFLASH_B} |",
                 "| drafts per round | 3 (B - 1) |", "[1, 2] of the target's 4 layers",
                 "| mask token id | 95 | config.json `dflash_config.mask_token_id` |",
                 "| steps trained | 3 | training_state.json step",
                 "`/data/chat`, 64 samples in 2 shards, data id 8ffe6d6c0ecc",
                 "1.75 GPU-hours (target 0.5, drafter 1.25), 3.50 USD",
                 "| held-out prompts of the training data | 2.3000 | 8 |",
                 "| gsm8k | 1.8000 | 5 |", "`checkpoints/best` names this checkpoint: exact "
                 "tau 2.3000"):
        assert fact in body, fact
    assert "2.6000" not in body  # step 6's evaluation is another checkpoint's
    spec = {"method": "dflash", "model": str(out), "num_speculative_tokens": DFLASH_B - 1}
    assert f"--speculative-config '{json.dumps(spec)}'" in body
    assert f"vllm serve {TARGET}" in body
    assert "--speculative-algorithm DFLASH" in body
    assert f"--speculative-draft-model-path {out}" in body
    assert f"--speculative-num-draft-tokens {DFLASH_B}" in body
    assert "public" in body and body.rstrip().splitlines()[-1].startswith(MARK)


def test_a_dspark_step_folder_gets_dspark_s_serving_lines(tmp_path):
    run = make_run(tmp_path, "dspark", steps=(3,), best=None)
    step = run / "checkpoints" / "step-3"
    out = tmp_path / "dspark-out"
    done = publish(step, out)
    _same_bytes(step, out)
    front, body = _card(out)
    assert {"dspark", "speculative-decoding"} <= set(front["tags"])
    assert "| objective | DSpark |" in body and f"| block size B | {DSPARK_B} |" in body
    assert f"{DSPARK_B} (B: the anchor slot predicts too)" in body
    spec = {"method": "dspark", "model": str(out), "num_speculative_tokens": DSPARK_B}
    assert f"--speculative-config '{json.dumps(spec)}'" in body
    assert "--speculative-algorithm DSPARK" in body
    assert "| gsm8k | 1.8000 | 5 |" in body and done.facts.step == 3
    # the slot layout, stated in config.json in the keys servers read, and on the card
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["sample_from_anchor"] is True and cfg["dspark_bonus_anchor"] is False
    assert ("| slot layout | anchor-first: B slots, slot j drafts the token at anchor + j + 1 | "
            "config.json `sample_from_anchor: true` (`dspark_bonus_anchor: false`) |") in body
    assert "1+N layout" in body
    assert "| attention in a block | bidirectional | config.json `is_causal` |" in body


def test_a_run_without_best_publishes_its_latest_checkpoint(tmp_path):
    run = make_run(tmp_path, "dflash", steps=(3, 6), best=None)
    done = publish(run, tmp_path / "out")
    assert done.checkpoint.name == "step-6" and "latest complete checkpoint" in done.how
    assert "| held-out prompts of the training data | 2.6000 | 8 |" in \
        (tmp_path / "out" / "README.md").read_text()


def test_a_flipped_bit_is_refused_naming_the_file(tmp_path):
    run = make_run(tmp_path, "dflash", steps=(3,), best=3)
    weights = run / "checkpoints" / "step-3" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0x01
    weights.write_bytes(bytes(raw))
    out = tmp_path / "out"
    with pytest.raises(PublishError, match=r"is damaged: model.safetensors does not match its "
                                           r"checksum"):
        publish(run, out)
    assert not out.exists() and not list(tmp_path.glob(".out.publish-*"))


def test_a_checkpoint_without_served_weights_is_refused(tmp_path):
    run = make_run(tmp_path, "dflash", steps=(3,), best=3)
    (run / "checkpoints" / "step-3" / "model.safetensors").unlink()
    with pytest.raises(PublishError, match="holds no served weights"):
        publish(run / "checkpoints" / "step-3", tmp_path / "out")


def test_a_folder_publish_did_not_write_is_refused_and_untouched(tmp_path):
    run = make_run(tmp_path, "dflash", steps=(3,), best=3)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "README.md").write_text("my notes\n")
    (foreign / "model.safetensors").write_bytes(b"mine")
    for overwrite in (False, True):
        with pytest.raises(PublishError, match="holds 2 entries publish did not write"):
            publish(run, foreign, overwrite=overwrite)
    assert (foreign / "README.md").read_text() == "my notes\n"
    assert (foreign / "model.safetensors").read_bytes() == b"mine"
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(PublishError, match="is a file"):
        publish(run, a_file, overwrite=True)
    assert a_file.read_text() == "x"
    empty = tmp_path / "empty"
    empty.mkdir()
    publish(run, empty)  # an empty folder is as good as a new one
    assert (empty / "README.md").is_file()


def test_its_own_folder_is_replaced_only_with_overwrite(tmp_path):
    run = make_run(tmp_path, "dflash", steps=(3, 6), best=3)
    out = tmp_path / "out"
    publish(run / "checkpoints" / "step-3", out)
    with pytest.raises(PublishError, match="holds an earlier publish") as exc:
        publish(run / "checkpoints" / "step-6", out)
    assert "--overwrite" in exc.value.hint
    assert "| steps trained | 3 |" in (out / "README.md").read_text()
    done = publish(run / "checkpoints" / "step-6", out, overwrite=True)
    assert done.replaced and "| steps trained | 6 |" in (out / "README.md").read_text()
    _same_bytes(run / "checkpoints" / "step-6", out)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    (out / "notes.txt").write_text("added by hand")
    with pytest.raises(PublishError, match="files publish does not write \\(notes.txt\\)"):
        publish(run, out, overwrite=True)
    assert (out / "notes.txt").is_file()


def test_a_dflash2_checkpoint_gets_b_minus_1_and_vllms_dflash_method(tmp_path):
    run = make_run(tmp_path, "dflash2", steps=(3,), best=None)
    step = run / "checkpoints" / "step-3"
    out = tmp_path / "dflash2-out"
    publish(step, out)
    _same_bytes(step, out)
    front, body = _card(out)
    assert {"dflash2", "speculative-decoding"} <= set(front["tags"])
    assert "| objective | DFlash2 |" in body and f"| block size B | {DFLASH_B} |" in body
    assert "| drafts per round | 3 (B - 1) |" in body
    assert "| mask token id | 95 | config.json `dflash_config.mask_token_id` |" in body
    # vLLM serves it by its DFlash method; the count must be B - 1 (vLLM reads no block size)
    spec = {"method": "dflash", "model": str(out), "num_speculative_tokens": DFLASH_B - 1}
    assert f"--speculative-config '{json.dumps(spec)}'" in body
    assert f"`num_speculative_tokens` must be {DFLASH_B - 1} (B - 1)" in body
    assert "vLLM serves DFlash2 from version 0.32 on a GPU" in body
    # SGLang's DFlash model has no convolutions nor selector: no command that would not serve it
    assert "sglang.launch_server" not in body and "--speculative-draft-model-path" not in body
    assert "SGLang: no command is given" in body and "no candidate selector" in body


def _set_target(run: Path, path: str) -> None:
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["target"]["path"] = path
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_the_demo_s_card_names_the_run_s_target_folder_never_builtin_tiny(tmp_path):
    """builtin:tiny is no path a server loads: the card names the run's copy of the demo target
    (RUN/target, the folder vLLM serves), absolute; no base_model (a hub id field)."""
    run = make_run(tmp_path, "dflash", steps=(3,), best=3)
    _set_target(run, "builtin:tiny")
    (run / "target").mkdir()
    (run / "target" / "config.json").write_text("{}")
    out = tmp_path / "out"
    done = publish(run, out)
    front, body = _card(out)
    folder = str((run / "target").resolve())
    assert done.facts.target == folder and "builtin:tiny" not in body.split("## Serving")[1]
    assert f"vllm serve {folder} \\" in body and f"--model-path {folder} \\" in body
    assert "builtin:tiny: the run's copy of it" in body and "base_model" not in front


def test_a_local_target_is_named_by_its_absolute_folder_and_a_missing_copy_is_not_invented(
        tmp_path, monkeypatch):
    run = make_run(tmp_path, "dflash", steps=(3,), best=3)
    (tmp_path / "models" / "q").mkdir(parents=True)
    (tmp_path / "models" / "q" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    _set_target(run, "models/q")
    publish(run, tmp_path / "out")
    _, body = _card(tmp_path / "out")
    assert f"vllm serve {(tmp_path / 'models' / 'q').resolve()} \\" in body
    _set_target(run, "builtin:tiny")  # and no run/target: the card says so, names no folder
    publish(run, tmp_path / "out2")
    _, body = _card(tmp_path / "out2")
    assert "vllm serve TARGET \\" in body and "holds no copy of it" in body


def test_an_older_checkpoint_gets_the_serving_keys_it_left_unstated(tmp_path):
    """A checkpoint written before config.json stated is_causal (and the rest) is published
    with them added as this engine computes them: no server guesses. The weights stay
    byte-identical; the card says what was added."""
    from dflash_core.checkpoint.checksums import crc32_of, file_sum

    run = make_run(tmp_path, "dspark", steps=(3,), best=None)
    step = run / "checkpoints" / "step-3"
    cfg = json.loads((step / "config.json").read_text())
    for k in ("is_causal", "is_neox_style", "sample_from_anchor"):
        del cfg[k]
    (step / "config.json").write_text(json.dumps(cfg))
    sums = json.loads((step / "checksums.json").read_text())
    path = step / "config.json"
    sums["files"]["config.json"] = file_sum(path.stat().st_size, crc32_of(path))
    (step / "checksums.json").write_text(json.dumps(sums))
    said = []
    out = tmp_path / "old-out"
    publish(step, out, note=said.append)
    got = json.loads((out / "config.json").read_text())
    assert {k: got[k] for k in ("is_causal", "is_neox_style", "sample_from_anchor")} == {
        "is_causal": False, "is_neox_style": True, "sample_from_anchor": True}
    assert {k: v for k, v in got.items() if k not in
            ("is_causal", "is_neox_style", "sample_from_anchor")} == cfg
    assert (out / "model.safetensors").read_bytes() == (step / "model.safetensors").read_bytes()
    _, body = _card(out)
    assert "`sample_from_anchor: true`" in body and "left unstated added" in body
    assert any("leaves out keys a server reads" in m for m in said)
