"""Bad input at the command line, round three (docs/bad-input.md): paths that are not runs given
to attach, report, serve and replay, and configs that cannot be used given to check and the
dashboard. Each: one clear line and a hint on stderr, exit 2, no traceback, nothing written."""

from pathlib import Path

import pytest

from dflash_tui.cli import main


def a_binary(tmp_path: Path) -> Path:
    p = tmp_path / "tool"
    p.write_bytes(b"\x7fELF\x02\x01\x01\x00\xd0\xff\xfe" * 20)
    return p


def a_folder(tmp_path: Path) -> Path:
    (tmp_path / "notes").mkdir()
    return tmp_path / "notes"


def an_empty_config(tmp_path: Path) -> Path:
    (tmp_path / "c.yaml").write_text("# nothing yet\n")
    return tmp_path / "c.yaml"


def missing(tmp_path: Path) -> Path:
    return tmp_path / "nope.yaml"


# name: (argv before the path, the path, words on stderr)
CASES = {
    "attach a file that is not a run": (["--attach"], a_binary, ["is a file, not a run"]),
    "attach a folder that is not a run": (["--attach"], a_folder, ["events.jsonl does not exist"]),
    "report a file that is not a run": (["report"], a_binary, ["is a file, not a run"]),
    "report a folder that is not a run": (["report"], a_folder, ["events.jsonl does not exist"]),
    "serve a file that is not a run": (["serve"], a_binary, ["does not exist"]),
    "replay a folder that is not a run": (["--replay"], a_folder, ["does not exist"]),
    "replay a binary file": (["--replay"], a_binary, ["is not an events.jsonl"]),
    "replay a missing file": (["--replay"], lambda t: t / "x.jsonl", ["does not exist"]),
    "dashboard on an empty config": (["--config"], an_empty_config, ["is empty"]),
    "headless on an empty config": (["--headless", "--config"], an_empty_config, ["is empty"]),
    "check a missing config": (["check", "--config"], missing, ["does not exist"]),
    "check an empty config": (["check", "--config"], an_empty_config, ["is empty"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_path_that_is_not_usable_is_one_line_and_exit_2(tmp_path, capsys, name):
    argv, make, words = CASES[name]
    path = make(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code = main([*argv, str(path)])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in out + err
    assert "hint:" in err, err
    for word in words:
        assert word in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written
