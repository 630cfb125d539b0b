"""An FP8 block-wise target on a GPU (tests/core/models/target/fp8_twin.py writes it and its bf16
twin): on compute capability 8.9+ its projections stay float8 on the GPU, its weights take about
half the twin's memory, and its features are the twin's (to the bit on the engine's FP8 linear,
within 15% on transformers' kernels, which quantize the activations too); it trains and
evaluates through the engine, and the log says how its weights are held."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from dflash_core.models.target import fp8
from dflash_core.models.target.load import load_target
from dflash_core.observe.events import EvalResult, Log, StepMetrics
from tests.core.engine_fixtures import make_config, make_data, run_config
from tests.core.models.target.fp8_twin import LAYERS, write_fp8_twin

KEEPS_FP8 = torch.cuda.is_available() and \
    torch.cuda.get_device_capability(0) >= fp8.FP8_MIN_CAPABILITY
# against the bf16 twin: the engine's FP8 linear multiplies the same bf16 weights the twin holds;
# transformers' kernels round each activation block to e4m3 as well (steps of 1/16)
TOLERANCE = {"engine": 1e-4, "transformers": 0.15}
LAYER_IDS = [0, 1, LAYERS - 1]


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    return write_fp8_twin(tmp_path_factory.mktemp("fp8"))


def loaded(folder, **kw):
    """(target, bytes its weights took on cuda:0, the lines it said)."""
    said: list[str] = []
    gc.collect()  # the last test's target freed now, not while this one loads (its bytes < 0)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(0)
    target = load_target(folder, device="cuda:0", dtype=torch.bfloat16, say=said.append, **kw)
    return target, torch.cuda.memory_allocated(0) - base, said


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("matmul", ["auto", "engine"])
def test_an_fp8_target_stays_fp8_on_the_gpu_with_its_twins_features(twin, matmul):
    folder, bf16 = twin
    ids = torch.randint(0, 500, (2, 300), device="cuda:0",
                        generator=torch.Generator("cuda:0").manual_seed(0))
    ref, ref_bytes, said = loaded(bf16)
    assert said == [] and ref.quantized is None
    want = ref.features(ids, layer_ids=LAYER_IDS)
    del ref
    target, fp8_bytes, said = loaded(folder, fp8_matmul=matmul)
    assert len(said) == 1 and said[0] == target.quantized.line
    if not KEEPS_FP8:  # an older GPU: dequantized as it loads, and said
        assert "dequantized to bfloat16 as they load" in said[0] and "fp8 needs 8.9+" in said[0]
        assert not fp8.fp8_left(target.model)
        assert rel(target.features(ids, layer_ids=LAYER_IDS), want) < TOLERANCE["engine"]
        return
    projections = [p for n, p in target.model.named_parameters() if n.endswith("_proj.weight")]
    assert len(projections) == 7 * LAYERS
    assert all(p.dtype == torch.float8_e4m3fn and p.device.type == "cuda" for p in projections)
    assert target.embed_tokens.weight.dtype == torch.bfloat16
    assert fp8_bytes < 0.7 * ref_bytes, (fp8_bytes, ref_bytes)
    assert said[0].startswith("target: FP8 block-wise weights stay FP8 on cuda:0")
    used = "engine" if "the engine's FP8 linear" in said[0] else "transformers"
    assert used == "engine" or matmul == "auto"
    got = target.features(ids, layer_ids=LAYER_IDS)
    H = target.hidden_size
    for k in range(len(LAYER_IDS)):
        part = slice(k * H, (k + 1) * H)
        off = rel(got[..., part], want[..., part])
        assert off < TOLERANCE[used], (LAYER_IDS[k], off, said[0])
    # no dequantized weight stays behind after a forward (the weights dequantized would be
    # 2.9 MiB in bf16); measured around a second one, the first having made its workspaces
    before = torch.cuda.memory_allocated(0)
    again = target.features(ids, layer_ids=LAYER_IDS)
    assert torch.equal(again, got)
    del again
    assert torch.cuda.memory_allocated(0) - before < 2**20
    assert all(p.dtype == torch.float8_e4m3fn for n, p in target.model.named_parameters()
               if n.endswith("_proj.weight"))


def test_an_fp8_target_trains_and_evaluates_through_the_engine(tmp_path, twin):
    folder, _ = twin
    data = make_data(tmp_path / "data", n=32)
    cfg = make_config(tmp_path, folder, data, layout__device="cuda", target__dtype="bfloat16",
                      run__max_steps=3, checkpoint__every=0, data__eval_prompts=1,
                      eval__max_new_tokens=4, target__layer_ids=[0, 1])
    end, rec = run_config(cfg, timeout=300)
    assert end.status == "finished", end.reason
    assert all(math.isfinite(m.loss) for m in rec.of(StepMetrics))
    # the held-out evaluation decoded with the same target (target 0's model)
    (result,) = rec.of(EvalResult)
    assert result.prompts == 1 and result.tau >= 1
    fp8_lines = [(e.source, e.level, e.message) for e in rec.of(Log) if "FP8" in e.message]
    if KEEPS_FP8:
        # preflight before loading, then target 0 once with the matmul that runs them
        (pre, pre_level, pre_line), (who, level, line) = fp8_lines
        assert pre == "preflight" and pre_level == "info" and "stay as stored" in pre_line
        assert who == "target-0" and level == "info" and "stay FP8 on cuda:0" in line
    else:
        ((pre, level, line),) = fp8_lines
        assert pre == "preflight" and level == "warning" and "fp8 needs 8.9+" in line
