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
    "report a file that is not a run": (["report"], a_binary, ["is a file, not a run"]),  # wrote beside it
    "report a folder that is not a run": (["report"], a_folder, ["events.jsonl does not exist"]),
    "serve a file that is not a run": (["serve"], a_binary, ["is a file, not a run"]),
    "replay a folder that is not a run": (["--replay"], a_folder, ["does not exist"]),
    "replay a binary file": (["--replay"], a_binary, ["is a file, not a run's events"]),
    "replay a config file": (["--replay"], an_empty_config, ["is a file, not a run's events"]),
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


def test_unusable_training_data_exits_2_as_an_input_error(tmp_path, capsys):
    """A data error (a shard of zero rows) is the input's fault: exit 2 like a config error, the
    message and hint on the console, its traceback only in train.log."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.core.engine_fixtures import make_config, make_target, write_config

    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"input_ids": pa.array([], pa.list_(pa.int64()))}),
                   data / "part-0.parquet")
    cfg = make_config(tmp_path, make_target(tmp_path / "target"), data)
    code = main(["--headless", "--config", str(write_config(tmp_path / "c.yaml", cfg))])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "[data]" in out and "holds no samples" in out and "hint:" in out
    assert "Traceback" not in out + err


def test_a_checkpoints_folder_that_cannot_be_written_is_refused_in_preflight(tmp_path, capsys):
    """Found before training, not at the first save (which failed the run after its steps)."""
    from tests.core.engine_fixtures import make_config, make_data, make_target, write_config

    cfg = make_config(tmp_path, make_target(tmp_path / "target"), make_data(tmp_path / "data"))
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "checkpoints").write_text("a file where the checkpoints go")
    code = main(["--headless", "--resume", "--config",
                 str(write_config(tmp_path / "c.yaml", cfg))])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "cannot write checkpoints" in out and "is a file, not a folder" in out
    assert "StepMetrics" not in (cfg.run_dir / "events.jsonl").read_text()  # no step was run
    assert (cfg.run_dir / "checkpoints").read_text() == "a file where the checkpoints go"
