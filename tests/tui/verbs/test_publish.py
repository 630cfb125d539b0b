"""`dflash-tui publish` through the CLI: the folder written, one line per bad input, exit 2."""

from __future__ import annotations

import pytest

from dflash_tui.cli import main
from tests.core.publish.run_fixture import make_run


def test_publish_writes_the_folder_and_says_which_checkpoint(tmp_path, capsys):
    run = make_run(tmp_path, "dflash", steps=(3,), best=3)
    out = tmp_path / "hub"
    assert main(["publish", str(run), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "checkpoints/best names step-3" in said and f"wrote {out}" in said
    assert "exact tau held-out 2.3000, gsm8k 1.8000" in said
    assert (out / "README.md").is_file()
    # again: refused, naming --overwrite; with it, replaced
    assert main(["publish", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("nothing published: --out") and "earlier publish" in err[0]
    assert "--overwrite" in err[1] and len(err) == 2
    assert main(["publish", str(run), "--out", str(out), "--overwrite"]) == 0
    assert f"replaced {out}" in capsys.readouterr().out


def test_bad_input_gets_one_line_and_exit_2(tmp_path, capsys):
    run = make_run(tmp_path, "dflash", steps=(3,), best=3)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x.txt").write_text("keep")
    cases = [
        ([str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "does not exist"),
        ([str(run), "--out", str(foreign), "--overwrite"], "entries publish did not write"),
        ([str(run / "events.jsonl"), "--out", str(tmp_path / "o")], "is a file"),
    ]
    for args, words in cases:
        assert main(["publish", *args]) == 2
        err = capsys.readouterr().err.splitlines()
        assert words in err[0] and err[1].startswith("hint: "), err
    assert (foreign / "x.txt").read_text() == "keep" and not (tmp_path / "o").exists()


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        main(["publish", "--help"])
    text = capsys.readouterr().out
    assert "dflash-tui publish runs/demo --out" in text and "--overwrite" in text
