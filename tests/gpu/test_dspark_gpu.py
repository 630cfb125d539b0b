"""drafter.objective dspark on the GPU: the engine trains a few steps with compiled FlexAttention
under bf16 autocast (the target's post-norm last hidden state handed over with its features), its
loss and three terms stay finite, the evaluation calibrates the confidence head, and the
checkpoint loads back through the served DSpark layout (dspark_format)."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_core.models.dspark import format as dspark_format
from dflash_core.models.dspark.drafter import DSparkDrafter
from dflash_core.models.dspark.calibration import Calibration
from dflash_core.eval.evaluate import evaluation_attention
from dflash_core.models.training.replica import DrafterReplica
from dflash_core.observe.events import EvalResult, StepMetrics
from dflash_core.checkpoint import save_load as ckpt
from tests.core.engine_fixtures import make_config, make_data, make_target
from tests.gpu.watch import Watched, watch_flex

STEPS = 6


def dspark_run(tmp_path: Path, monkeypatch, drafters=(0,)):
    """A DSpark run of STEPS steps on the GPUs: (cfg, steps, evaluations, feature widths seen,
    FlexAttention calls)."""
    flex_calls, _ = watch_flex(monkeypatch)
    widths = []
    accumulate = DrafterReplica.accumulate

    def recording(self, batch, features, seed, **kwargs):
        widths.append((features.shape[-1], str(features.device), str(self.device)))
        return accumulate(self, batch, features, seed, **kwargs)

    monkeypatch.setattr(DrafterReplica, "accumulate", recording)
    target = make_target(tmp_path / "target", head_dim=16)  # head_dim 16: compiled flex
    data = make_data(tmp_path / "data")
    cfg = make_config(tmp_path, target, data, layout__device="cuda", target__dtype="bfloat16",
                      layout__drafters=list(drafters), drafter__objective="dspark",
                      drafter__markov_rank=16, run__max_steps=STEPS, checkpoint__every=3)
    run = Watched()
    run.run(cfg, timeout=600)
    return cfg, run.of(StepMetrics), run.of(EvalResult), widths, flex_calls


def test_dspark_trains_on_one_gpu_and_its_checkpoint_is_the_served_folder(tmp_path: Path,
                                                                         monkeypatch):
    cfg, steps, evals, widths, flex_calls = dspark_run(tmp_path, monkeypatch)
    assert flex_calls, "the DSpark drafter did not run compiled FlexAttention on the GPU"
    H, k = 32, cfg.target.num_features
    assert {w for w, _, _ in widths} == {(k + 1) * H}  # the last hidden state came along
    assert [s.step for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        terms = (s.loss, s.loss_ce, s.loss_tv, s.loss_conf, s.grad_norm)
        assert all(math.isfinite(x) for x in terms), s
        assert min(s.loss_ce, s.loss_tv, s.loss_conf) > 0 and s.loss_tv <= 2
        assert s.loss == pytest.approx(0.1 * s.loss_ce + 0.9 * s.loss_tv + s.loss_conf,
                                       rel=1e-3)
    (ev,) = evals
    assert len(ev.acceptance) == cfg.drafter.block_size + 1  # B drafts, B+1 outcomes
    cal = Calibration.from_dict(ev.calibration)
    assert cal is not None and cal.rounds > 0 and 0 <= cal.ece <= 1

    folder = cfg.run_dir / "checkpoints" / f"step-{STEPS}"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert (config["block_size"], config["markov_rank"]) == (cfg.drafter.block_size, 16)
    served = load_file(str(folder / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in served.values())
    masters = ckpt.load_checkpoint(folder).drafter_state
    assert not set(dspark_format.FROZEN_KEYS) & set(masters)
    back = DSparkDrafter.load(folder, device="cuda")
    for name, value in back.state_dict().items():
        assert torch.equal(value.cpu(), masters[name].bfloat16().float()), name
    head = dspark_format.load_head(folder)
    from dflash_core.models.target.load import load_target

    target = load_target(cfg.target.path, device="cuda", dtype="bfloat16")
    assert torch.equal(head["lm_head.weight"].cuda(), target.lm_head.weight)
    assert torch.equal(head["embed_tokens.weight"].cuda(), target.embed_tokens.weight)
    # the served drafter drafts B tokens by chain from the target's features
    lm_head = torch.nn.Linear(H, head["lm_head.weight"].shape[0], bias=False)
    lm_head.weight = torch.nn.Parameter(head["lm_head.weight"].float().cuda(),
                                        requires_grad=False)
    back.attach_target_head(
        torch.nn.Embedding.from_pretrained(head["embed_tokens.weight"].float().cuda()), lm_head)
    ids = torch.randint(0, 100, (1, 12), device="cuda")
    ctx = target.features(ids, layer_ids=back.target_layer_ids).float()
    with evaluation_attention(back):  # as the run's evaluation decodes
        draft = back.chain_draft(ctx, int(ids[0, -1]))
    assert draft.tokens.shape == (cfg.drafter.block_size,)
    assert draft.confidences is not None and torch.isfinite(draft.confidences).all()


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="a drafter on its own GPU needs two GPUs")
def test_dspark_features_cross_to_a_drafter_on_another_gpu(tmp_path: Path, monkeypatch):
    """The wider features (layer features and last hidden state) are handed from the target's
    GPU to the drafter's, and train there."""
    cfg, steps, _, widths, _ = dspark_run(tmp_path, monkeypatch, drafters=(1,))
    assert {(d, r) for _, d, r in widths} == {("cuda:0", "cuda:1")}
    assert len(steps) == STEPS and all(math.isfinite(s.loss) for s in steps)
