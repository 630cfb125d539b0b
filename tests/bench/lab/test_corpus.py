"""bench/lab/corpus.py: which files are the text, and the split by a hash of their path."""

import importlib
import shutil

from bench.lab.corpus import SPLITS, collect, split_of

PACKAGES = ("labfake_pkg", "labfake_single", "labfake_not_installed")


def _collect(**kw):
    return collect(PACKAGES, heldout_per_mille=kw.get("heldout", 300),
                   chat_per_mille=kw.get("chat", 300), max_file_bytes=kw.get("max_bytes", 100_000))


def test_the_corpus_is_the_packages_text_files_with_the_unusable_ones_counted(fake_site):
    corpus = _collect()
    paths = [d.path for d in corpus.documents]
    assert paths == sorted(paths)
    assert "labfake_pkg/sub/mod0.py" in paths and "labfake_pkg/README.md" in paths
    assert "labfake_single.py" in paths
    assert not any(p.endswith(("latin1.py", "huge.py", "__init__.py", "data.bin")) for p in paths)
    assert corpus.skipped == {"empty": 1, "not_utf8": 1, "too_large": 1}
    assert corpus.missing == ["labfake_not_installed"]
    assert set(corpus.found) == {"labfake_pkg", "labfake_single"}
    # every document in exactly one split
    assert sorted(d.path for s in SPLITS for d in corpus.split(s)) == paths


def test_the_split_follows_the_path_alone_wherever_the_packages_are_installed(fake_site,
                                                                                tmp_path,
                                                                                monkeypatch):
    first = _collect()
    splits = {s: [d.path for d in first.split(s)] for s in SPLITS}
    assert all(splits.values()), splits  # 26 files at 30/30/40 %: each split holds some
    for s, paths in splits.items():
        assert all(split_of(p, 300, 300) == s for p in paths)
    # the same packages installed elsewhere: the same digest, the same split
    moved = tmp_path / "elsewhere"
    shutil.copytree(fake_site, moved)
    monkeypatch.syspath_prepend(str(moved))
    importlib.invalidate_caches()
    again = _collect()
    assert str(moved) in str(importlib.util.find_spec("labfake_pkg").origin)
    assert again.digest == first.digest
    assert {s: [d.path for d in again.split(s)] for s in SPLITS} == splits
    # a changed file is another corpus (another target)
    (moved / "labfake_single.py").write_text("print('changed')\n")
    assert _collect().digest != first.digest


def test_more_held_out_per_mille_only_moves_files_into_held_out(fake_site):
    small, large = _collect(heldout=100), _collect(heldout=400)
    held_small = {d.path for d in small.split("heldout")}
    held_large = {d.path for d in large.split("heldout")}
    assert held_small < held_large
