"""bench/target/fp8_vs_bf16.py: its arguments, the two checkpoints it writes (the layout of FP8
block-wise releases, one shard per layer), the folder it may write into, and a tiny-shape run on
the CPU (the GPU run measures the 8B shape; this checks the script runs and says what it
measured)."""

import json
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "target"))

import fp8_vs_bf16 as bench  # noqa: E402


def test_arguments_and_their_defaults():
    args = bench.parse_args(["--device", "cpu"])
    assert (args.shape, args.batch, args.seq, args.batches, args.warmup) == \
        ("qwen3-8b", 4, 3072, 5, 2)
    assert str(args.dir).startswith("/dev/shm/") and args.fp8_matmul == "auto"
    hf = args.hf_config
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["intermediate_size"],
            hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"],
            hf["vocab_size"]) == (4096, 36, 12288, 32, 8, 128, 151936)
    assert bench.parse_args(["--device", "cpu", "--layers", "6"]).hf_config[
        "num_hidden_layers"] == 6
    assert bench.SHAPES["qwen3-8b"]["num_hidden_layers"] == 36  # the shape itself unchanged


@pytest.mark.parametrize("argv, says", [
    (["--layers", "2"], "--layers must be >= 4"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--seq", "100000"], "past the shape's max_position_embeddings"),
    (["--fp8-matmul", "fast"], "invalid choice: 'fast'"),
])
def test_bad_arguments_exit_2_naming_the_argument(argv, says, capsys):
    with pytest.raises(SystemExit) as exc_info:
        bench.parse_args(["--device", "cpu", *argv])
    assert exc_info.value.code == 2 and says in capsys.readouterr().err


def test_the_8b_shape_has_a_shard_per_layer_and_its_projections_in_fp8():
    shapes = bench.tensor_shapes(bench.SHAPES["qwen3-8b"])
    files = bench.shards(list(shapes))
    assert len(files) == 37 and files[0][0] == "model-00001-of-00037.safetensors"
    assert all(n.startswith("model.layers.0.") for n in files[0][1])
    assert sorted(files[-1][1]) == ["lm_head.weight", "model.embed_tokens.weight",
                                    "model.norm.weight"]
    fp8 = [n for n, s in shapes.items() if bench.quantized(n, s)]
    assert len(fp8) == 36 * 7 and shapes["model.layers.0.mlp.gate_proj.weight"] == (12288, 4096)
    assert not bench.quantized("lm_head.weight", shapes["lm_head.weight"])


def test_the_folder_is_refused_when_not_its_own_or_too_small(tmp_path, monkeypatch):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="holds files this script did not write"):
        bench.prepare_dir(foreign, 1)
    assert (foreign / "notes.txt").read_text() == "mine"
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100, 90, 10 * 2**30))
    with pytest.raises(SystemExit, match=r"need 24.0 GiB, 10.0 GiB free there: pass --dir"):
        bench.prepare_dir(tmp_path / "small", 24 * 2**30)
    assert not (tmp_path / "small").exists()


def test_a_tiny_run_on_the_cpu_writes_both_and_measures_them(tmp_path, capsys):
    folder = tmp_path / "bench"
    line = bench.main(["--device", "cpu", "--shape", "tiny", "--seq", "48", "--batch", "2",
                       "--batches", "1", "--warmup", "0", "--dir", str(folder), "--keep"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == line
    assert line["layer_ids"] == [1, 2, 3, 4, 5]
    for name in ("bf16", "fp8"):
        assert line[name]["tokens_per_s"] > 0 and line[name]["weights_gib"] > 0
    # on the CPU the FP8 target is dequantized as it loads, and says so
    assert line["fp8"]["held"] == "dequantized" and "the target runs on the CPU" in \
        line["fp8"]["note"]
    # FP8's rounding (steps of 1/16) shows in the features, and stays small
    assert set(line["rel_diff"]) == {"1", "2", "3", "4", "5"}
    assert all(0 < d < 0.15 for d in line["rel_diff"].values()), line["rel_diff"]
    # the FP8 checkpoint as releases store it: float8 projections, a float32 scale per block
    with safe_open(str(folder / "fp8" / "model-00001-of-00009.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv")
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
    assert q.dtype == torch.float8_e4m3fn and q.shape == (256, 384)
    assert scale.dtype == torch.float32 and scale.shape == (2, 3)
    assert norm.dtype == torch.bfloat16 and torch.equal(norm, torch.ones(256, dtype=norm.dtype))
    with safe_open(str(folder / "bf16" / "model-00001-of-00009.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    assert w.dtype == torch.bfloat16 and 0.015 < w.float().std().item() < 0.025
    back = q.float().view(2, 128, 3, 128) * scale[:, None, :, None]
    assert ((back.view(256, 384) - w.float()).norm() / w.float().norm()).item() < 0.04
    config = json.loads((folder / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    index = json.loads((folder / "fp8" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["lm_head.weight"] == "model-00009-of-00009.safetensors"


def test_without_keep_the_folder_is_removed(tmp_path, capsys):
    folder = tmp_path / "bench"
    bench.main(["--device", "cpu", "--shape", "tiny", "--layers", "4", "--seq", "16",
                "--batch", "1", "--batches", "1", "--warmup", "0", "--dir", str(folder)])
    assert not folder.exists()
