"""The identity a checkpoint records of its data: the manifest's content and the shards' names
and sizes, not where the data lies or how its prepare ran."""

import json
import shutil

from dflash_core.checkpoint.data_identity import data_identity, describe


def _folder(path, manifest=None, shards=(("a.arrow", 10), ("b.arrow", 20))):
    path.mkdir()
    for name, size in shards:
        (path / name).write_bytes(b"x" * size)
    if manifest is not None:
        (path / "dflash_data.json").write_text(json.dumps(manifest))
    return path


def _id(path):
    return data_identity(path, sorted(path.glob("*.arrow")), 7)


MANIFEST = {"version": 1, "kind": "prepare", "counts": {"samples": 7}, "shards": ["a", "b"],
            "seconds": 1.5, "workers": 2}


def test_the_same_data_prepared_again_or_moved_is_the_same(tmp_path):
    a = _id(_folder(tmp_path / "a", MANIFEST))
    b = _id(_folder(tmp_path / "b", {**MANIFEST, "seconds": 9.0, "workers": 4, "marker": "x"}))
    assert a["id"] == b["id"] and a["manifest"] == b["manifest"] and a["path"] != b["path"]
    assert a["files"] == [["a.arrow", 10], ["b.arrow", 20]] and a["samples"] == 7
    assert describe(a) == (f"{tmp_path / 'a'} (data {a['id']}: 2 shards, 7 samples, manifest "
                           f"{a['manifest'][:12]})")


def test_other_content_or_other_shards_are_other_data(tmp_path):
    base = _id(_folder(tmp_path / "base", MANIFEST))
    counts = _id(_folder(tmp_path / "counts", {**MANIFEST, "counts": {"samples": 8}}))
    sizes = _id(_folder(tmp_path / "sizes", MANIFEST, (("a.arrow", 10), ("b.arrow", 21))))
    names = _id(_folder(tmp_path / "names", MANIFEST, (("a.arrow", 10), ("c.arrow", 20))))
    bare = _id(_folder(tmp_path / "bare"))
    assert len({base["id"], counts["id"], sizes["id"], names["id"], bare["id"]}) == 5
    assert bare["manifest"] is None and describe(bare).endswith("no manifest)")
    # without a manifest, names and sizes alone decide
    shutil.copytree(tmp_path / "bare", tmp_path / "bare2")
    assert _id(tmp_path / "bare2")["id"] == bare["id"]
