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


@pytest.mark.parametrize("argv", [["--headless", "--config"], ["check", "--config"]])
def test_a_target_config_json_with_nonsense_is_one_line_and_exit_2(tmp_path, capsys, argv):
    """A target's config.json is input: an FP8 block of [0, 128] (was a ZeroDivisionError in the
    memory plan, "a bug in dflash") is named with its file and field, before anything loads."""
    import json

    from tests.core.engine_fixtures import make_config, make_data, write_config

    target = tmp_path / "target"
    target.mkdir()
    hf_config = json.loads((Path(__file__).parents[1] / "fixtures" / "qwen3_8b_config.json")
                           .read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [0, 128]}
    (target / "config.json").write_text(json.dumps(hf_config))
    cfg = make_config(tmp_path, target, make_data(tmp_path / "data"))
    code = main([*argv, str(write_config(tmp_path / "c.yaml", cfg))])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in out + err and "bug in dflash" not in out + err
    assert (f"{target / 'config.json'}: quantization_config.weight_block_size [0, 128]: "
            in out + err), out + err
    assert "download the model again" in out + err


# ------------------------------------------------------------------------------------------------
# The data verbs, round four: inputs a new user may give. Each: exit 2, one error line naming
# the cause and a hint, no traceback, and nothing the user wrote changed.
# ------------------------------------------------------------------------------------------------

def _convs(d: Path) -> Path:
    from dflash_core.demo.chat import write_demo_conversations

    return write_demo_conversations(d / "convs.jsonl", n=3)


def _save_to_disk(d: Path) -> Path:
    from tests.core.data.test_output_folder import _rows, save_to_disk_folder

    return save_to_disk_folder(d / "ds", _rows())


def _parquet_parts(d: Path) -> Path:
    from tests.core.data.test_output_folder import _rows, parquet_parts

    return parquet_parts(d / "pq", _rows())


def _file(name: str, data: bytes):
    def make(d: Path) -> Path:
        (d / name).write_bytes(data)
        return d / name
    return make


TINY = ["--tokenizer", "builtin:tiny", "--quiet", "--workers", "1"]
# name: (make the input in tmp_path, argv after "data" given the input and tmp_path, words)
DATA_CASES = {
    "save_to_disk folder as its own --out": (
        _save_to_disk, lambda s, d: ["prepare", s, "--out", s, *TINY],
        ["is the conversations source itself", "never writes into its own input"]),
    "save_to_disk folder as its own --out, --overwrite": (
        _save_to_disk, lambda s, d: ["prepare", s, "--out", s, "--overwrite", *TINY],
        ["is the conversations source itself"]),
    "part-*.parquet folder as its own --out, --overwrite": (
        _parquet_parts, lambda s, d: ["prepare", s, "--out", s, "--overwrite", *TINY],
        ["is the conversations source itself"]),
    "--out inside the input folder": (
        _save_to_disk, lambda s, d: ["prepare", s, "--out", f"{s}/prepared", *TINY],
        ["is inside the conversations source"]),
    "--out the folder holding the input file": (
        _convs, lambda s, d: ["prepare", s, "--out", str(d), "--overwrite", *TINY],
        ["holds the conversations source"]),
    "--overwrite on a folder no prepare wrote": (
        _save_to_disk, lambda s, d: ["prepare", str(_convs(d)), "--out", s, "--overwrite",
                                     *TINY],
        ["no data verb wrote (data-00000-of-00001.arrow, dataset_info.json, state.json)",
         "even with --overwrite"]),
    "regenerate into its input's folder": (
        _convs, lambda s, d: ["regenerate", s, "--out", str(d), "--endpoint",
                              "http://127.0.0.1:9", "--quiet"],
        ["holds the conversations source"]),
    "empty jsonl": (_file("empty.jsonl", b""), lambda s, d: ["prepare", s, "--out",
                                                             f"{d}/o", *TINY],
                    ["the source is empty"]),
    "binary garbage named .jsonl": (
        _file("g.jsonl", bytes(range(256)) * 8), lambda s, d: ["prepare", s, "--out",
                                                              f"{d}/o", *TINY],
        ["no row could be used", "not_utf8"]),
    "binary garbage file": (_file("g.bin", b"\x7fELF\x00" * 50),
                            lambda s, d: ["prepare", s, "--out", f"{d}/o", *TINY],
                            ["unknown file type '.bin'"]),
    "jsonl of non-object lines": (
        _file("n.jsonl", b'[1]\n"x"\n3\n'), lambda s, d: ["prepare", s, "--out", f"{d}/o", *TINY],
        ["not_json: 3", "a JSON list, not an object"]),
    "rows without messages": (
        _file("m.jsonl", b'{"id": "a", "text": "hi"}\n'),
        lambda s, d: ["prepare", s, "--out", f"{d}/o", *TINY], ["no_turns: 1 (e.g. a: "]),
    "a chat template that is not text": (
        _convs, lambda s, d: ["prepare", s, "--out", f"{d}/o", "--chat-template",
                              str(_file("t.jinja", b"\xff\xfe\x00")(d)), *TINY],
        ["cannot read the chat template"]),
    "a damaged tokenizer.json": (
        _convs, lambda s, d: ["prepare", s, "--out", f"{d}/o", "--tokenizer",
                              str(_damaged_tokenizer(d)), "--quiet"],
        ["cannot load a tokenizer (KeyError"]),
    "a damaged Parquet file": (
        _file("x.parquet", b"PAR1" + b"\x00" * 40), lambda s, d: ["prepare", s, "--out",
                                                                  f"{d}/o", *TINY],
        ["not a readable Parquet file"]),
    "an endpoint that is not a URL": (
        _convs, lambda s, d: ["regenerate", s, "--out", f"{d}/o", "--endpoint", "http://[::1",
                              "--quiet"],
        ["is not a URL"]),
    "inspect conversations, not data": (
        _convs, lambda s, d: ["inspect", s], ["holds conversations, not prepared"]),
    "inspect with a target that is no model": (
        _convs, lambda s, d: ["inspect", str(_prepared(d)), "--target", s],
        ["cannot load the target model"]),
}


def _damaged_tokenizer(d: Path) -> Path:
    (d / "tok").mkdir()
    (d / "tok" / "tokenizer.json").write_text('{"version": "1.0", "truncation": null}')
    (d / "tok" / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast"}')
    return d / "tok"


def _prepared(d: Path) -> Path:
    from dflash_core.data.prepare import PrepareOptions, prepare

    prepare(PrepareOptions(_convs(d), d / "data", workers=1, progress=False))
    return d / "data"


def _tree(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("name", list(DATA_CASES))
def test_bad_input_to_the_data_verbs_is_one_line_and_exit_2(tmp_path, capsys, name):
    make, argv, words = DATA_CASES[name]
    src = str(make(tmp_path))
    args = ["data", *argv(src, tmp_path)]
    before = _tree(tmp_path)
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert lines[-2].startswith("data error: ") and lines[-1].startswith("hint: "), err
    for word in words:
        assert word in err, err
    assert _tree(tmp_path) == before  # nothing changed, nothing half-written


@pytest.mark.parametrize("argv,words", [
    (["prepare", "c.jsonl", "--out", "o", "--tokenizer", "builtin:tiny",
      "--samples-per-shard", "-1"], "--samples-per-shard: must be >= 1, got -1"),
    (["prepare", "c.jsonl", "--out", "o", "--tokenizer", "builtin:tiny", "--max-length", "-5"],
     "--max-length: must be >= 0 (0 = no limit), got -5"),
    (["prepare", "c.jsonl", "--out", "o", "--tokenizer", "builtin:tiny", "--workers", "-2"],
     "--workers: must be >= 0"),
    (["prepare", "c.jsonl", "--out", "o", "--tokenizer", "builtin:tiny", "--workers", "lots"],
     "--workers: expected a whole number of processes, got 'lots'"),
    (["regenerate", "c.jsonl", "--out", "o", "--endpoint", "x", "--concurrency", "0"],
     "--concurrency: must be >= 1"),
    (["regenerate", "c.jsonl", "--out", "o", "--endpoint", "x", "--concurrency", "100000"],
     "--concurrency: must be <= 1024"),
    (["regenerate", "c.jsonl", "--out", "o", "--endpoint", "x", "--max-tokens", "0"],
     "--max-tokens: must be >= 1"),
    (["regenerate", "c.jsonl", "--out", "o", "--endpoint", "x", "--timeout", "nan"],
     "--timeout: expected a finite number, got 'nan'"),
    (["regenerate", "c.jsonl", "--out", "o", "--endpoint", "x", "--timeout", "-1"],
     "--timeout: must be > 0"),
    (["regenerate", "c.jsonl", "--out", "o", "--endpoint", "x", "--retries", "-1"],
     "--retries: must be >= 0"),
    (["regenerate", "c.jsonl", "--out", "o", "--endpoint", "x", "--limit", "-1"],
     "--limit: must be >= 0 (0 = all rows)"),
    (["regenerate", "c.jsonl", "--out", "o", "--endpoint", "x", "--temperature", "-0.5"],
     "--temperature: must be >= 0"),
    (["inspect", "d", "--samples", "-1"], "--samples: must be >= 0"),
    (["inspect", "d", "--agreement-samples", "0"], "--agreement-samples: must be >= 1"),
])
def test_numbers_of_the_data_verbs_are_checked_where_parsed(tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(["data", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def _init_folder(tmp_path: Path, target: Path, case: str) -> Path:
    """A drafter.init_from folder for the tiny target: DFlash2 with its codebooks under
    '.weight' names or a selector_top_k above the vocabulary, or a DSpark / sound DFlash2
    drafter (for a run of another family)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from dflash_core.families.dflash2 import DFlash2Settings
    from dflash_core.families.dspark import DSparkSettings
    from dflash_core.models.registry import new_drafter
    from tests.core.engine_fixtures import VOCAB

    family = "dspark" if case == "dspark" else "dflash2"
    m = new_drafter(family, AutoConfig.from_pretrained(target), num_layers=1,
                    target_layer_ids=[1, 3], block_size=4, mask_token_id=VOCAB - 1,
                    settings=(DFlash2Settings(block_size=4, selector_rank=8, selector_top_k=4)
                              if family == "dflash2" else
                              DSparkSettings(block_size=4, markov_rank=16)))
    folder = tmp_path / case
    if family == "dspark":  # its served folder holds copies of the target's embedding and head
        import torch

        V, H = m.config.vocab_size, m.config.hidden_size
        m.attach_target_head(torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False))
    m.save(folder)
    if case == "weight names":
        state = load_file(str(folder / "model.safetensors"))
        save_file({(k + ".weight" if k.endswith("_codebook") else k): v
                   for k, v in state.items()}, str(folder / "model.safetensors"))
    if case == "top_k":
        d = json.loads((folder / "config.json").read_text())
        d["dflash_config"]["selector_top_k"] = VOCAB + 43
        (folder / "config.json").write_text(json.dumps(d))
    return folder


# case (the folder _init_folder makes) -> (drafter.objective, words of the error line, its hint)
INIT_FROM = {
    "weight names": ("dflash2", ["drafter.init_from: ", "model.safetensors names the selector's "
                                 "codebooks ['candidate_selector.predecessor_codebook.weight'"],
                     "point drafter.init_from at a drafter folder this engine can load"),
    "top_k": ("dflash2", ["drafter.init_from: ", "dflash_config.selector_top_k 171: the "
                          "selector picks among the top-K of the 128 tokens"],
              "point drafter.init_from at a drafter folder this engine can load"),
    "dspark": ("dflash2", ["drafter.init_from: ", "holds a DSpark drafter, but drafter.objective "
                           "is dflash2"],
               "point drafter.init_from at the folder of a DFlash2 drafter or of a DFlash drafter "
               "(the family dflash2 starts from), or set drafter.objective: dspark to train "
               "from this one"),
    "dflash2": ("dflash", ["holds a DFlash2 drafter, but drafter.objective is "
                                           "dflash"],
                                "point drafter.init_from at the folder of a DFlash drafter, or "
                                "set drafter.objective: dflash2 to train from this one"),
}


@pytest.mark.parametrize("argv, case", [(["--headless", "--config"], c) for c in INIT_FROM]
                         + [(["check", "--config"], "weight names")])
def test_an_init_from_folder_the_loader_would_refuse_is_refused_at_preflight(
        tmp_path, capsys, monkeypatch, argv, case):
    """drafter.init_from judged at preflight as the loader judges it (its family against
    drafter.objective, DFlash2's config and tensor names): a [config] line naming the key, a hint
    to start from another folder, exit 2, before the target loads (was: "[internal] ... a bug in
    dflash" or a traceback after the target loaded; the family mismatch with resume wording)."""
    import dflash_core.models.target.load as target_module
    from tests.core.engine_fixtures import make_config, make_data, make_target, write_config

    objective, words, hint = INIT_FROM[case]
    target = make_target(tmp_path / "target")
    folder = _init_folder(tmp_path, target, case)
    monkeypatch.setattr(target_module, "load_target",
                        lambda *a, **k: pytest.fail("the target was loaded"))
    cfg = make_config(tmp_path, target, make_data(tmp_path / "data"), data__eval_prompts=0,
                      drafter__objective=objective, drafter__init_from=str(folder),
                      **({"drafter__selector_rank": 8, "drafter__selector_top_k": 4}
                         if objective == "dflash2" else {}))
    code = main([*argv, str(write_config(tmp_path / "c.yaml", cfg))])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    text = out + err
    assert "Traceback" not in text and "bug in dflash" not in text and "[internal]" not in text
    (line,) = [x for x in text.splitlines() if "drafter.init_from: " in x or "holds a" in x]
    assert line.startswith("ERROR [config] engine (preflight)" if argv[0] == "--headless"
                           else "config error: drafter.init_from: "), line
    for w in words:
        assert w in line, line
    assert f"hint: {hint}" in text, text
