"""FP8 block-wise targets kept FP8 in target groups, on CUDA (compute capability 8.9+).

One GPU: a rank's dequantizing FP8 matmul (models/target/fp8_group.py), put in place of
transformers' kernels in a loaded model, gives the bf16 twin's features (dense) and the
dequantized model's (Qwen3-MoE's routed experts, through their eager loop), leaving no weight
dequantized behind. Two GPUs: 2-rank groups (NCCL) of FP8 Qwen3-MoE and DeepSeek-V3-shaped
checkpoints, tensor parallel + expert parallel and FSDP + expert parallel, hold float8 weights on
each GPU and give one process's features of the same checkpoint, on whichever matmul the ranks
agreed on (transformers' kernels where they load)."""

from __future__ import annotations

import gc

import pytest
import torch

from dflash_core.models.target import fp8, fp8_group
from dflash_core.models.target.fp8 import checkpoint_bytes
from dflash_core.models.target.load import load_target
from dflash_core.pipeline.group_stage import GroupStage  # noqa: F401 (the engine's side imports)

from tests.core.models.target.fp8_twin import LAYERS, write_fp8_twin
from tests.core.models.target.test_target_classes import fp8_checkpoint
from tests.core.target_group.fp8_targets import VOCAB, write_fp8
from tests.core.target_group.group_harness import reply, start_group

KEEPS_FP8 = torch.cuda.is_available() and \
    torch.cuda.get_device_capability(0) >= fp8.FP8_MIN_CAPABILITY
pytestmark = pytest.mark.skipif(not KEEPS_FP8, reason="FP8 stays FP8 on compute capability 8.9+")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
# transformers' kernels quantize the activations to e4m3 as well (steps of 1/16): against the
# dequantized weights a few percent; the dequantizing matmul multiplies those weights themselves
TOLERANCE = {"engine": 2e-2, "transformers": 0.15}  # bf16, relative to the norm


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture
def dequantizing(monkeypatch):
    """fp8_group replaces transformers' fp8_linear for the whole process (a rank's): put back
    after the test."""
    import transformers.integrations.finegrained_fp8 as hf_fp8
    monkeypatch.setattr(hf_fp8, "fp8_linear", hf_fp8.fp8_linear)


def test_the_dequantizing_matmul_gives_the_twins_features(tmp_path, dequantizing):
    folder, bf16 = write_fp8_twin(tmp_path)
    ids = torch.randint(0, 500, (2, 300), device="cuda:0",
                        generator=torch.Generator("cuda:0").manual_seed(0))
    layers = [0, 1, LAYERS - 1]
    want = load_target(bf16, device="cuda:0", dtype=torch.bfloat16).features(ids, layer_ids=layers)
    gc.collect()
    torch.cuda.empty_cache()
    target = load_target(folder, device="cuda:0", dtype=torch.bfloat16,
                         fp8_matmul="transformers")  # transformers' FP8Linear layers, kept
    assert fp8_group.use_dequantized_matmul(target.model) == []
    got = target.features(ids, layer_ids=layers)
    assert rel(got, want) < 1e-4
    before = torch.cuda.memory_allocated(0)
    assert torch.equal(target.features(ids, layer_ids=layers), got)
    assert torch.cuda.memory_allocated(0) - before < 2**20  # no dequantized weight kept
    assert all(p.dtype == torch.float8_e4m3fn for n, p in target.model.named_parameters()
               if n.endswith("_proj.weight"))


def test_routed_experts_run_on_the_dequantizing_matmul(tmp_path, dequantizing, monkeypatch):
    """Qwen3-MoE with per-expert FP8 tensors, kept FP8 whether or not the kernels package is
    there (a rank's rule), its experts through their eager loop one expert at a time."""
    monkeypatch.setattr(fp8, "fp8_dequantize_reason", lambda devices, experts: None)
    ref = fp8_checkpoint(tmp_path).to("cuda:0")
    target = load_target(tmp_path, device="cuda:0", dtype=torch.float32,
                         fp8_matmul="transformers")
    assert any(p.dtype == torch.float8_e4m3fn for n, p in target.model.named_parameters()
               if ".experts." in n)
    assert fp8_group.use_dequantized_matmul(target.model) == []
    x = torch.randint(0, 200, (2, 64), device="cuda:0",
                      generator=torch.Generator("cuda:0").manual_seed(5))
    with torch.inference_mode():
        hs = ref(input_ids=x, output_hidden_states=True).hidden_states
    assert rel(target.features(x, layer_ids=[1]), hs[2]) < 1e-4


def test_the_probe_answers_on_this_gpu():
    """transformers' kernels on a standalone FP8 layer: None where they run and agree with its
    dequantized weight, else why (the ranks then use the dequantizing matmul)."""
    layer = fp8_group._probe_layer((128, 128), torch.device("cuda", 0))
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.is_cuda
    why = fp8.transformers_matmul_fails(torch.nn.Sequential(layer), torch.bfloat16)
    print("transformers' FP8 kernels:", why or "run")
    assert why is None or isinstance(why, str)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-group-gpu")
    return {name: write_fp8(root / name, name) for name in ("qwen3_moe", "deepseek_v3")}


def _batch(seed, rows=2, length=256):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    return ids, torch.ones_like(ids)


@two_gpus
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("mode", ["shared", "sharded"])
def test_a_two_rank_fp8_group_keeps_fp8_and_gives_one_process_features(folders, tmp_path,
                                                                        name, mode):
    folder = folders[name]
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    said: list[str] = []
    one = load_target(folder, device=devs[0], dtype=torch.bfloat16, say=said.append)
    one_matmul = "transformers" if "run by transformers' FP8 kernels" in said[0] else "engine"
    group = start_group(folder, mode, True, tmp_path, devices=devs, dtype="bfloat16")
    try:
        loaded = [reply(group, r, ("loaded",), timeout=300) for r in range(2)]
        note = loaded[0][3]
        print(note.line)
        assert note.kept and "stay FP8 on the group's 2 ranks" in note.line
        _, plain = checkpoint_bytes([folder / "model.safetensors"], torch.bfloat16)
        # each GPU holds float8 weights (and the rank's share only)
        assert all(msg[1] < 0.6 * plain for msg in loaded)
        used = "transformers" if "run by transformers' FP8 kernels" in note.line else "engine"
        tol = max(TOLERANCE[used], TOLERANCE[one_matmul])
        sent = [_batch(r, rows=2 + r) for r in range(2)] if mode == "sharded" \
            else [_batch(0)] * 2
        for r in range(2):
            group.requests[r].put(("batch", 1, *sent[r]))
        for r in range(2) if mode == "sharded" else [0]:
            _, _, feats = reply(group, r, ("features",))
            assert feats.device == devs[r]
            ids, mask = sent[r]
            want = one.features(ids.to(devs[0]), mask.to(devs[0]), [1, 2]).to(devs[r])
            assert rel(feats, want) < tol, (r, used, one_matmul)
            del feats
            group.requests[r].put(("ack", 1))
        for r in range(2):
            group.requests[r].put(("end",))
        for r in range(2):
            reply(group, r, ("done",))
    finally:
        assert group.shutdown() == []
