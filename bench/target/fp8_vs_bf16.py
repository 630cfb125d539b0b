"""An FP8 block-wise target against its bf16 twin, both loaded through the engine's loader: the
memory of their weights, the features' tokens/s, and how far the FP8 target's features are from
the twin's, layer by layer (||fp8 - bf16|| / ||bf16||).

Random weights (nothing is downloaded), Qwen3-8B's shape by default (hidden 4096, 36 layers,
intermediate 12288, 32 heads, 8 kv heads, head_dim 128, vocab 151936): normal with std 0.02 (norms
1), so the activations stay finite through every layer. They are drawn on the GPU one layer at a
time and written straight to safetensors, one shard per layer, twice: the bf16 checkpoint and its
FP8 block-wise twin as Qwen and DeepSeek publish theirs (each attention and MLP projection in
float8_e4m3fn with a float32 weight_scale_inv per 128 x 128 block; embeddings, lm_head and norms
bf16; config.json's quantization_config {quant_method: fp8, weight_block_size: [128, 128]}).

Each target then loads on its own (the other freed), runs --warmup batches of --batch x --seq
random tokens, then --batches timed ones, through TargetModel.features of the engine's default
layers (5 spread from 1 to N-3; the forward stops after the last). The first batch's features of
the two are compared. The memory plan's figures for the same batch are printed beside the
measured ones. One JSON line on stdout; progress on stderr.

    python bench/target/fp8_vs_bf16.py                      # one H200, full size, < 4 minutes
    python bench/target/fp8_vs_bf16.py --layers 4 --batches 2
    python bench/target/fp8_vs_bf16.py --fp8-matmul engine  # the engine's FP8 linear even where
                                                            # transformers' kernels load
    python bench/target/fp8_vs_bf16.py --device cpu --shape tiny --seq 64 --batch 2

--dir holds the two checkpoints (default /dev/shm/dflash-fp8-bench, about 25 GB at full size:
memory-backed, so writing and reading them costs seconds); it is emptied and removed at the end
unless --keep.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import FIXTURES, env_line  # noqa: E402 - common puts the repository on sys.path

from dflash_core.checkpoint.safetensors_io import write_file  # noqa: E402
from dflash_core.config import config_from_dict  # noqa: E402
from dflash_core.models.target.config import default_layer_ids  # noqa: E402
from dflash_core.models.target.fp8 import MATMULS, quantize_blockwise  # noqa: E402
from dflash_core.models.target.load import load_target  # noqa: E402

SHAPES = {
    "qwen3-8b": json.loads((FIXTURES / "qwen3_8b_config.json").read_text()),
    "tiny": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1024,
             "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 8,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "tie_word_embeddings": False, "max_position_embeddings": 4096,
             "torch_dtype": "bfloat16"},
}
BLOCK = (128, 128)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(BLOCK)}
STD = 0.02  # random weights' spread: larger ones blow the residual stream up over 36 layers
MARKER = "fp8_vs_bf16.json"  # in --dir: this script's folder, which it may empty
GiB = 2**30
WRITERS = 8  # shard files written at once


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm/dflash-fp8-bench"),
                    help="where the two checkpoints are written (emptied and removed after)")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per batch")
    ap.add_argument("--seq", type=int, default=3072, help="tokens per sequence")
    ap.add_argument("--batches", type=int, default=5, help="timed batches")
    ap.add_argument("--warmup", type=int, default=2, help="batches before timing")
    ap.add_argument("--fp8-matmul", default="auto", choices=MATMULS,
                    help="what multiplies the kept FP8 weights (the loader's fp8_matmul)")
    ap.add_argument("--keep", action="store_true", help="leave the checkpoints in --dir")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    for name in ("batch", "seq", "batches"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.warmup < 0 or args.layers < 0:
        ap.error("--warmup and --layers must be >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: --device cpu --shape tiny for a smoke run")
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
        shape["max_window_layers"] = args.layers
    if shape["num_hidden_layers"] < 4:
        ap.error("--layers must be >= 4 (the default feature layers spread from 1 to N-3)")
    if args.seq > shape.get("max_position_embeddings", args.seq):
        ap.error(f"--seq {args.seq} is past the shape's max_position_embeddings")
    args.hf_config = shape
    return args


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# The two checkpoints
# --------------------------------------------------------------------------------------------

def tensor_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the model's state dict holds, with its shape, from a model built on the meta
    device (no memory): the names transformers will look for."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = dict(hf_config)
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def shards(names: list[str]) -> list[tuple[str, list[str]]]:
    """(shard file, its tensor names): one per decoder layer, then one for the rest."""
    layers: dict[int, list[str]] = {}
    rest = []
    for name in names:
        parts = name.split(".")
        if "layers" in parts and parts[parts.index("layers") + 1].isdigit():
            layers.setdefault(int(parts[parts.index("layers") + 1]), []).append(name)
        else:
            rest.append(name)
    total = len(layers) + 1
    out = [(f"model-{i + 1:05d}-of-{total:05d}.safetensors", layers[k])
           for i, k in enumerate(sorted(layers))]
    return out + [(f"model-{total:05d}-of-{total:05d}.safetensors", rest)]


def quantized(name: str, shape: tuple[int, ...]) -> bool:
    """What an FP8 block-wise release stores in FP8: the projections of every layer."""
    return len(shape) == 2 and name.endswith("_proj.weight") and ".layers." in name


def draw(name: str, shape: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    if len(shape) == 1:  # norms 1 (biases, none in Qwen3, would be 0)
        return torch.ones(shape, dtype=torch.bfloat16, device=device) if "norm" in name \
            else torch.zeros(shape, dtype=torch.bfloat16, device=device)
    return (torch.randn(shape, generator=gen, device=device) * STD).to(torch.bfloat16)


def write_twins(hf_config: dict, root: Path, device: str) -> tuple[Path, Path, float]:
    """(bf16 folder, FP8 folder, seconds): both written shard by shard from the same draws. The
    draws and copies to the host go one shard at a time; the files are written by a pool of
    threads (the writer's CRC-32 and the writes release the GIL), a few shards in flight."""
    t0 = time.perf_counter()
    shapes = tensor_shapes(hf_config)
    bf16, fp8 = root / "bf16", root / "fp8"
    maps: dict[Path, dict[str, str]] = {bf16: {}, fp8: {}}
    for folder in (bf16, fp8):
        folder.mkdir(parents=True)
    gen = torch.Generator(device).manual_seed(0)
    pending: list[Future] = []
    with ThreadPoolExecutor(WRITERS, thread_name_prefix="write") as pool:
        for file, names in shards(list(shapes)):
            plain, quant = [], []
            for name in names:
                w = draw(name, shapes[name], gen, device)
                plain.append((name, w.cpu(), None))
                if quantized(name, shapes[name]):
                    q, scale = quantize_blockwise(w, BLOCK)
                    quant += [(name, q.cpu(), None), (name + "_scale_inv", scale.cpu(), None)]
                else:
                    quant.append(plain[-1])
            for folder, entries in ((bf16, plain), (fp8, quant)):
                pending.append(pool.submit(write_file, folder / file, entries))
                maps[folder].update({name: file for name, _, _ in entries})
            while len(pending) > 2 * WRITERS:  # bounded host memory: wait for the oldest
                pending.pop(0).result()
        for f in pending:
            f.result()
    for folder in (bf16, fp8):
        config = dict(hf_config, **({"quantization_config": FP8_CONFIG} if folder is fp8 else {}))
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": maps[folder]}))
    return bf16, fp8, time.perf_counter() - t0


def prepare_dir(root: Path, needed: int) -> None:
    """--dir empty (or this script's own from an earlier run, emptied), with room for both."""
    if root.exists() and any(root.iterdir()):
        if not (root / MARKER).is_file():
            raise SystemExit(f"--dir {root} holds files this script did not write: pass an empty "
                             "or new folder")
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text(json.dumps({"written_by": "bench/target/fp8_vs_bf16.py"}))
    free = shutil.disk_usage(root).free
    if free < needed * 1.05:
        shutil.rmtree(root)
        raise SystemExit(f"--dir {root}: the two checkpoints need {needed / GiB:.1f} GiB, "
                         f"{free / GiB:.1f} GiB free there: pass --dir on a disk with room, or "
                         "--layers N for a smaller stack")


# --------------------------------------------------------------------------------------------
# Measuring one target
# --------------------------------------------------------------------------------------------

def planned(hf_config: dict, args, layers: list[int], kept: bool) -> dict[str, float]:
    """The memory plan's weights and its total for this batch (the target's tensors, no CUDA
    margin), GiB."""
    from dflash_core.planning.target_memory import target_tensors

    cfg = config_from_dict({  # DFlash's target: its selected layers only (DSpark runs them all)
        "drafter": {"objective": "dflash"},
        "layout": {"device": args.device, "targets": [0], "drafters": [0]},
        "target": {"layer_ids": layers},
        "data": {"token_budget": args.batch * args.seq, "max_length": args.seq,
                 "max_seqs_per_batch": args.batch}})
    plan = target_tensors(cfg, hf_config, on_cuda=args.device == "cuda", quantized=kept)
    return {"weights_gib": (plan.get("weights", 0) + plan.get("experts", 0)) / GiB,
            "peak_gib": sum(plan.values()) / GiB}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(folder: Path, args, batches: list[torch.Tensor], layers: list[int]
            ) -> tuple[dict, torch.Tensor]:
    """(what one target measured, its features of the first batch, on the host: they stay
    while the next target loads, outside this one's peak)."""
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # as the engine runs targets
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    said: list[str] = []
    t0 = time.perf_counter()
    target = load_target(folder, device=args.device, dtype=dtype, say=said.append,
                         fp8_matmul=args.fp8_matmul)
    load_s = time.perf_counter() - t0
    for line in said:
        say(f"  {line}")
    weights = (torch.cuda.memory_allocated() - base if cuda
               else sum(p.numel() * p.element_size() for p in target.model.parameters()))
    first = target.features(batches[0], layer_ids=layers).cpu()
    for i in range(args.warmup):
        target.features(batches[i % len(batches)], layer_ids=layers)
    sync(args.device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for ids in batches:
        target.features(ids, layer_ids=layers)
    sync(args.device)
    seconds = time.perf_counter() - t
    q = target.quantized
    out = {
        "weights_gib": weights / GiB,
        "tokens_per_s": sum(b.numel() for b in batches) / seconds,
        "peak_gib": (torch.cuda.max_memory_allocated() - base) / GiB if cuda else None,
        "load_s": load_s,
        "fp8_params": sum(p.numel() for p in target.model.parameters()
                          if p.dtype == torch.float8_e4m3fn),
        "held": None if q is None else ("dequantized" if not q.kept else
                                        "engine" if "engine's FP8 linear" in q.line
                                        else "transformers"),
        "note": None if q is None else q.line,
    }
    del target
    return out, first


def relative_differences(got: torch.Tensor, want: torch.Tensor, layers: list[int],
                         hidden: int) -> dict[str, float]:
    """||got - want|| / ||want|| of each layer's slice of the concatenated features."""
    out = {}
    for k, layer in enumerate(layers):
        a = got[..., k * hidden:(k + 1) * hidden].float()
        b = want[..., k * hidden:(k + 1) * hidden].float()
        out[str(layer)] = ((a - b).norm() / b.norm()).item()
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    from dflash_core.planning.weight_bytes import target_weight_bytes

    t_start = time.perf_counter()
    hf = args.hf_config
    if args.device == "cuda":
        from dflash_core.planning.allocator import configure_allocator

        say(configure_allocator().describe())  # as the engine: expandable segments
    say(env_line())
    fp8_hf = dict(hf, quantization_config=FP8_CONFIG)
    needed = target_weight_bytes(hf, "bfloat16") + target_weight_bytes(fp8_hf, "bfloat16",
                                                                        quantized=True)
    prepare_dir(args.dir, needed)
    try:
        bf16_dir, fp8_dir, write_s = write_twins(hf, args.dir, args.device)
        say(f"wrote both checkpoints ({needed / GiB:.1f} GiB) to {args.dir} in {write_s:.0f} s")
        layers = sorted(set(default_layer_ids(hf["num_hidden_layers"])))  # few layers: repeats
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, hf["vocab_size"], (args.batch, args.seq), generator=gen)
                   .to(args.device) for _ in range(args.batches)]
        results, features = {}, {}
        for name, folder, cfg in (("bf16", bf16_dir, hf), ("fp8", fp8_dir, fp8_hf)):
            say(f"{name}: loading {folder}")
            results[name], features[name] = measure(folder, args, batches, layers)
            kept = results[name]["fp8_params"] > 0
            results[name]["planned"] = planned(cfg, args, layers, kept)
            say(f"{name}: weights {results[name]['weights_gib']:.2f} GiB (planned "
                f"{results[name]['planned']['weights_gib']:.2f}), "
                f"{results[name]['tokens_per_s']:,.0f} tokens/s")
            if args.device == "cuda":
                torch.cuda.empty_cache()
        diffs = relative_differences(features["fp8"].to(args.device),
                                     features["bf16"].to(args.device), layers, hf["hidden_size"])
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    bf, f8 = results["bf16"], results["fp8"]
    line = {
        "bench": "fp8_vs_bf16", "env": env_line(), "shape": args.shape,
        "layers": hf["num_hidden_layers"], "layer_ids": layers, "batch": args.batch,
        "seq": args.seq, "batches": args.batches, "warmup": args.warmup,
        "fp8_matmul": args.fp8_matmul, "write_s": round(write_s, 1),
        "bf16": bf, "fp8": f8,
        "weights_fp8_over_bf16": f8["weights_gib"] / bf["weights_gib"],
        "tokens_per_s_fp8_over_bf16": f8["tokens_per_s"] / bf["tokens_per_s"],
        "rel_diff": diffs,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    if not all(math.isfinite(v) for v in diffs.values()):
        say("the features are not finite: the random weights' spread is too large for this depth")
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
