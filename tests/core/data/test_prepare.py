"""data prepare end to end: shards the engine reads, reasons counted, manifest last, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_core.data import ShardedDataset
from dflash_core.demo.chat import write_demo_conversations
from dflash_core.data.manifest import MANIFEST, MARKER, check_data_folder
from dflash_core.data.prepare import PrepareOptions, prepare
from dflash_core.data.shards import DataError

from tests.core.data.chat_fixtures import train_bpe


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("bpe"))


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _source(tmp_path):
    rows = [
        {"id": "ok1", "messages": [{"role": "user", "content": "What is two plus two?"},
                                   {"role": "assistant", "content": "Four."}]},
        {"conversations": [{"from": "human", "value": "Hello!"},
                           {"from": "gpt", "value": "How can I help you today?"},
                           {"from": "human", "value": "The weather in Paris."},
                           {"from": "gpt", "value": "It rains. " * 30}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]},
        {"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]},
    ]
    src = tmp_path / "convs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    return src


def test_prepare_counts_every_left_out_row_by_reason(tmp_path, bpe_folder):
    m = prepare(PrepareOptions(_source(tmp_path), tmp_path / "out", tokenizer=str(bpe_folder),
                               max_length=60, workers=1, progress=False))
    c = m["counts"]
    # the long conversation is kept, cut to its first 60 tokens (inside its last answer)
    assert c["rows"] == 6 and c["samples"] == 2
    assert c["dropped"] == {"empty_assistant": 1, "missing_role": 1, "not_json": 1,
                            "unknown_role": 1}
    assert c["cut"]["samples"] == c["cut"]["in_answer"] == 1
    assert "robot" in m["examples"]["unknown_role"]
    ds = ShardedDataset.open(tmp_path / "out")
    ids, mask = ds.get(0)
    assert len(ds) == 2 and ds.has_loss_mask and 0 < mask.sum() < len(ids)
    assert len(ds.get(1)[0]) == 60
    assert m["tokens"]["tokens"] == len(ids) + 60
    assert m["tokens"]["trained_tokens"] == mask.sum() + ds.get(1)[1].sum()
    assert (tmp_path / "out" / MANIFEST).exists() and not (tmp_path / "out" / MARKER).exists()


def test_parallel_prepare_writes_what_one_process_writes(tmp_path):
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=150)
    a = prepare(PrepareOptions(src, tmp_path / "a", workers=1, progress=False,
                               samples_per_shard=64))
    b = prepare(PrepareOptions(src, tmp_path / "b", workers=2, progress=False,
                               samples_per_shard=64))
    assert a["fingerprints"] == b["fingerprints"] and a["tokens"] == b["tokens"]
    da, db = ShardedDataset.open(tmp_path / "a"), ShardedDataset.open(tmp_path / "b")
    assert len(da) == len(db) == 150 and len(da.files) == 3
    for i in (0, 77, 149):
        assert all(np.array_equal(x, y) for x, y in zip(da.get(i), db.get(i)))
    # the demo template: user text, then the answer and <|endoftext|>, trained
    ids, mask = da.get(0)
    assert ids[-1] == 256 and mask[-1] == 1 and mask[0] == 0


def test_an_output_folder_with_data_is_refused_unless_overwrite(tmp_path):
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=4)
    prepare(PrepareOptions(src, tmp_path / "out", workers=1, progress=False))
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    with pytest.raises(DataError, match="already holds") as e:
        prepare(PrepareOptions(src, tmp_path / "out", workers=1, progress=False))
    assert "--overwrite" in e.value.hint
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before  # nothing lost
    m = prepare(PrepareOptions(src, tmp_path / "out", workers=1, progress=False,
                               overwrite=True))
    assert m["counts"]["samples"] == 4
    # --overwrite replaces data, it does not empty a folder of other things
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="does not write"):
        prepare(PrepareOptions(src, tmp_path / "out", workers=1, progress=False,
                               overwrite=True))
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_a_prepare_that_fails_leaves_no_folder_and_old_data_as_it_was(tmp_path, monkeypatch):
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=8)
    import dflash_core.data.prepare as prep

    def crash(*a, **k):
        raise RuntimeError("killed mid-way")

    monkeypatch.setattr(prep, "mark_finished", crash)
    with pytest.raises(RuntimeError):
        prepare(PrepareOptions(src, tmp_path / "out", workers=1, progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.jsonl"]  # nothing half-written
    monkeypatch.undo()
    prepare(PrepareOptions(src, tmp_path / "out", workers=1, progress=False))
    before = _snapshot(tmp_path / "out")
    monkeypatch.setattr(prep, "mark_finished", crash)
    with pytest.raises(RuntimeError):
        prepare(PrepareOptions(src, tmp_path / "out", workers=1, progress=False,
                               overwrite=True))
    assert _snapshot(tmp_path / "out") == before  # the old data, byte for byte
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.jsonl", "out"]


def test_a_folder_an_earlier_version_left_unfinished_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / MARKER).write_text("{}")
    (tmp_path / "out" / "data-00000-of-00001.arrow").write_bytes(b"")
    with pytest.raises(DataError, match="did not finish") as e:
        check_data_folder(tmp_path / "out", None)
    assert "--overwrite" in e.value.hint


def test_manifest_checked_against_the_target_names_both_sides(tmp_path, bpe_folder):
    from dflash_core.data.chat_render import fingerprints, load_tokenizer

    src = write_demo_conversations(tmp_path / "demo.jsonl", n=4)
    prepare(PrepareOptions(src, tmp_path / "out", workers=1, progress=False))
    demo_fp = json.loads((tmp_path / "out" / MANIFEST).read_text())["fingerprints"]
    assert check_data_folder(tmp_path / "out", demo_fp)["counts"]["samples"] == 4
    other = fingerprints(load_tokenizer(bpe_folder))
    with pytest.raises(DataError) as e:
        check_data_folder(tmp_path / "out", other, "the target /models/x")
    msg = str(e.value)
    assert demo_fp["tokenizer"] in msg and other["tokenizer"] in msg and "/models/x" in msg


def test_preflight_refuses_data_prepared_for_another_tokenizer(tmp_path, bpe_folder):
    from dflash_core.config import config_from_dict
    from dflash_core.planning.data_checks import check_data_manifest

    src = write_demo_conversations(tmp_path / "demo.jsonl", n=4)
    prepare(PrepareOptions(src, tmp_path / "data", tokenizer=str(bpe_folder), workers=1,
                           progress=False))
    cfg = config_from_dict({"target": {"path": "builtin:tiny"},
                            "data": {"path": str(tmp_path / "data")}})
    with pytest.raises(DataError, match="prepared with the tokenizer of"):
        check_data_manifest(cfg, tmp_path / "data", tmp_path)
    # the same tokenizer (a target folder holding it) passes
    cfg2 = config_from_dict({"target": {"path": str(bpe_folder)},
                             "data": {"path": str(tmp_path / "data")}})
    check_data_manifest(cfg2, tmp_path / "data", bpe_folder)


def test_cli_bad_input_exits_2_without_traceback(tmp_path, capsys):
    from dflash_tui.cli import main

    src = write_demo_conversations(tmp_path / "demo.jsonl", n=2)
    (tmp_path / "tok").mkdir()
    assert main(["data", "prepare", str(src), "--tokenizer", str(tmp_path / "tok"), "--out",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "holds no tokenizer files" in err and "hint:" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    assert main(["data", "prepare", str(src), "--tokenizer", "builtin:tiny", "--out",
                 str(tmp_path / "o"), "--quiet"]) == 0
    assert "prepared 2 samples" in capsys.readouterr().out
