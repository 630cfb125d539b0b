"""Nothing a user wrote is deleted or changed by data prepare: not the folder of its input (a
datasets save_to_disk folder, a folder of Parquet parts), not a folder it did not write, even
with --overwrite; what --overwrite replaces is swapped in whole at the end."""

from __future__ import annotations

import errno
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_core.data import ShardedDataset
from dflash_core.data.output import OWNER, Staging
from dflash_core.data.prepare import PrepareOptions, prepare
from dflash_core.data.shards import DataError
from dflash_core.demo.chat import write_demo_conversations


def _rows(n=6, seed=0):
    return [{"id": f"r{seed}-{k}", "messages": [
        {"role": "user", "content": f"question {k}"},
        {"role": "assistant", "content": f"answer {k} of set {seed}"}]} for k in range(n)]


def save_to_disk_folder(folder, rows):
    """What datasets' save_to_disk writes: data-*.arrow (IPC stream), state.json,
    dataset_info.json."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    (folder / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return folder


def parquet_parts(folder, rows):
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    pq.write_table(table.slice(0, 3), folder / "part-00000.parquet")
    pq.write_table(table.slice(3), folder / "part-00001.parquet")
    return folder


def snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _opts(src, out, **kw):
    return PrepareOptions(src, out, workers=1, progress=False, **kw)


@pytest.mark.parametrize("make", [save_to_disk_folder, parquet_parts])
def test_an_output_that_is_holds_or_lies_in_the_input_is_refused_and_nothing_changes(
        tmp_path, make):
    src = make(tmp_path / "ds", _rows())
    before = snapshot(tmp_path)
    for out, words in ((src, "is the conversations source itself"),
                       (src / "prepared", "is inside the conversations source"),
                       (tmp_path, "holds the conversations source")):
        for overwrite in (False, True):
            with pytest.raises(DataError, match=words) as e:
                prepare(_opts(src, out, overwrite=overwrite))
            assert "never writes into its own input" in str(e.value)
            assert "new folder outside it" in e.value.hint
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no lock, no partial left
    # the same folder as input to another --out is fine
    assert prepare(_opts(src, tmp_path / "data"))["counts"]["samples"] == 6


@pytest.mark.parametrize("make", [save_to_disk_folder, parquet_parts])
def test_overwrite_refuses_a_folder_no_prepare_wrote_naming_its_files(tmp_path, make):
    theirs = make(tmp_path / "theirs", _rows())
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=4)
    before = snapshot(theirs)
    for overwrite in (False, True):
        with pytest.raises(DataError, match="no data verb wrote") as e:
            prepare(_opts(src, theirs, overwrite=overwrite))
        first = sorted(p.name for p in theirs.iterdir())[0]
        assert first in str(e.value) and "pass --out a new folder" in e.value.hint
        assert ("even with --overwrite" in str(e.value)) == overwrite
    assert snapshot(theirs) == before


def test_overwrite_swaps_the_new_data_in_whole(tmp_path):
    a = save_to_disk_folder(tmp_path / "a", _rows(6, seed=1))
    b = parquet_parts(tmp_path / "b", _rows(5, seed=2))
    out = tmp_path / "data"
    prepare(_opts(a, out))
    assert (out / OWNER).is_file()
    with pytest.raises(DataError, match="already holds a prepared data set") as e:
        prepare(_opts(b, out))
    assert "--overwrite" in e.value.hint
    m = prepare(_opts(b, out, overwrite=True, fmt="parquet"))
    assert m["counts"]["samples"] == 5 and len(ShardedDataset.open(out)) == 5
    assert not list(out.glob("*.arrow"))  # the old shards went with the old folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "data"]


def test_overwrite_keeps_files_a_prepare_does_not_write(tmp_path):
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=4)
    prepare(_opts(src, tmp_path / "data"))
    (tmp_path / "data" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="does not write .*notes.txt.*would delete"):
        prepare(_opts(src, tmp_path / "data", overwrite=True))
    assert (tmp_path / "data" / "notes.txt").read_text() == "mine"


def test_a_file_put_into_the_output_while_it_is_prepared_stops_the_swap(tmp_path,
                                                                       monkeypatch):
    import dflash_core.data.prepare as prep

    src = write_demo_conversations(tmp_path / "demo.jsonl", n=4)
    prepare(_opts(src, tmp_path / "data"))
    real = prep._prepare_into

    def meanwhile(*a, **k):
        m = real(*a, **k)
        (tmp_path / "data" / "late.txt").write_text("mine")
        return m

    monkeypatch.setattr(prep, "_prepare_into", meanwhile)
    before = snapshot(tmp_path / "data")
    with pytest.raises(DataError, match="now holds files .*late.txt"):
        prepare(_opts(src, tmp_path / "data", overwrite=True))
    assert snapshot(tmp_path / "data") == {**before, "late.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "demo.jsonl"]


def test_an_output_of_regenerate_or_a_file_is_refused(tmp_path):
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=2)
    (tmp_path / "regen").mkdir()
    (tmp_path / "regen" / OWNER).write_text(json.dumps({"verb": "regenerate"}))
    (tmp_path / "regen" / "regen_state.json").write_text("{}")
    with pytest.raises(DataError, match="output of data regenerate"):
        prepare(_opts(src, tmp_path / "regen", overwrite=True))
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file", tmp_path / "file" / "data"):
        with pytest.raises(DataError, match="is a file, not a folder"):
            prepare(_opts(src, out))
    assert (tmp_path / "file").read_text() == "x"


def test_the_tokenizer_folder_is_an_input_too(tmp_path):
    from tests.core.data.chat_fixtures import train_bpe

    tok = train_bpe(tmp_path / "tok")
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=2)
    before = snapshot(tok)
    with pytest.raises(DataError, match="inside the tokenizer folder"):
        prepare(_opts(src, tok / "data", tokenizer=str(tok)))
    assert snapshot(tok) == before


def test_a_replacement_killed_between_its_two_renames_is_put_back(tmp_path, capsys):
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=3)
    out = tmp_path / "data"
    prepare(_opts(src, out))
    before = snapshot(out)
    out.rename(tmp_path / ".data.old")  # where the fallback swap had moved it
    with pytest.raises(DataError, match="already holds"):
        prepare(_opts(src, out))
    assert "put back" in capsys.readouterr().err and snapshot(out) == before


def test_a_mount_point_output_is_replaced_file_by_file(tmp_path, monkeypatch):
    """A mount point cannot be renamed: the new files are moved in, the manifest last."""
    import dflash_core.data.output as output

    src = write_demo_conversations(tmp_path / "demo.jsonl", n=3)
    prepare(_opts(src, tmp_path / "data"))

    def busy(a, b):
        raise OSError(errno.EBUSY, "Device or resource busy", str(b))

    monkeypatch.setattr(output, "_exchange", busy)
    moved = []
    real_move = output.shutil.move
    monkeypatch.setattr(output.shutil, "move", lambda a, b: (moved.append(b), real_move(a, b)))
    m = prepare(_opts(src, tmp_path / "data", overwrite=True, fmt="parquet"))
    assert moved[-1].endswith("dflash_data.json")
    assert len(ShardedDataset.open(tmp_path / "data")) == m["counts"]["samples"] == 3
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == sorted(
        [OWNER, "dflash_data.json", "part-00000.parquet"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "demo.jsonl"]


def test_staging_leftovers_of_a_killed_prepare_are_cleared(tmp_path):
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=3)
    left = tmp_path / ".data.partial"
    left.mkdir()
    (left / OWNER).write_text(json.dumps({"verb": "prepare"}))
    (left / ".tmp-x-00000.arrow").write_bytes(b"half")
    prepare(_opts(src, tmp_path / "data"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "demo.jsonl"]
    # one holding files of someone else is not touched
    (tmp_path / ".other.partial").mkdir()
    (tmp_path / ".other.partial" / "x.txt").write_text("mine")
    with pytest.raises(DataError, match="no data verb wrote"):
        Staging(tmp_path / "other", lambda n: True, print).begin("prepare")
    assert (tmp_path / ".other.partial" / "x.txt").read_text() == "mine"


def test_an_empty_folder_the_user_made_is_kept_and_filled(tmp_path, monkeypatch):
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=3)
    (tmp_path / "here").mkdir()
    inode = (tmp_path / "here").stat().st_ino
    monkeypatch.chdir(tmp_path / "here")  # a shell standing in it, `--out .`
    prepare(_opts(src, "."))
    assert (tmp_path / "here").stat().st_ino == inode
    assert len(ShardedDataset.open(tmp_path / "here")) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.jsonl", "here"]


def test_an_output_that_is_a_link_replaces_the_folder_it_names(tmp_path):
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=3)
    prepare(_opts(src, tmp_path / "real"))
    (tmp_path / "link").symlink_to(tmp_path / "real")
    m = prepare(_opts(src, tmp_path / "link", overwrite=True, fmt="parquet"))
    assert (tmp_path / "link").is_symlink()
    assert len(ShardedDataset.open(tmp_path / "real")) == m["counts"]["samples"] == 3
    assert list((tmp_path / "real").glob("*.parquet"))


def test_an_interrupted_prepare_leaves_nothing_and_releases_its_lock(tmp_path, monkeypatch):
    import dflash_core.data.prepare as prep

    src = write_demo_conversations(tmp_path / "demo.jsonl", n=3)

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_prepare_into", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        prepare(_opts(src, tmp_path / "data"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.jsonl"]
