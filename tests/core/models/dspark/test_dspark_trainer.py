"""DSpark drafter replicas: the same data-parallel step as DFlash's with DSpark's loss, its three
terms reported, its features carrying the target's post-norm last hidden state."""

import copy
from types import SimpleNamespace

import pytest
import torch

from dflash_core.models.registry import ObjectiveMismatch, new_drafter
from dflash_core.models.dspark.drafter import DSparkDrafter, DSparkSettings
from dflash_core.models.training.replica import STATS, prepare_batch
from dflash_core.models.training.trainer import build_replicas, make_replicas, reduce_and_step

from ...engine_fixtures import VOCAB, assets, make_config  # noqa: F401 - assets is a fixture
from ..training.test_trainer import drafter_setup, head_copies

SETTINGS = DSparkSettings(block_size=4, markov_rank=8)


def last_hidden(tm, batch):
    """The target's last hidden state after its final norm (transformers' last hidden_states
    entry: lm_head of it is the logits)."""
    with torch.no_grad():
        out = tm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       output_hidden_states=True)
    return out.hidden_states[-1]


def _setup(tmp_path, assets, n_batches=2, **over):
    target, data = assets
    cfg = make_config(tmp_path, target, data, **over)
    tm, batches, feats, dflash = drafter_setup(cfg, target, data, n_batches)
    feats = [torch.cat([f, last_hidden(tm, b)], -1) for f, b in zip(feats, batches)]
    torch.manual_seed(0)
    init = new_drafter("dspark", tm.model.config, num_layers=1,
                       target_layer_ids=dflash.target_layer_ids, block_size=0,
                       mask_token_id=VOCAB - 1, settings=SETTINGS)
    return cfg, tm, batches, feats, init


def test_two_replicas_step_like_one_and_report_the_three_terms(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets)
    cpu = torch.device("cpu")
    before = {k: v.clone() for k, v in init.state_dict().items()}
    pair = make_replicas(copy.deepcopy(init), [cpu, cpu], cfg.drafter, cfg.optim,
                         *head_copies(tm), SETTINGS)
    pair[0].accumulate(batches[0], feats[0], cfg.run.seed)
    pair[1].accumulate(batches[1], feats[1], cfg.run.seed)
    res_pair = reduce_and_step(pair, 0, 10)
    (single,) = make_replicas(copy.deepcopy(init), [cpu], cfg.drafter, cfg.optim,
                              *head_copies(tm), SETTINGS)
    single.accumulate(batches[0], feats[0], cfg.run.seed)
    single.accumulate(batches[1], feats[1], cfg.run.seed)
    res_single = reduce_and_step([single], 0, 10)

    assert set(res_pair.extra) == {"loss_ce", "loss_tv", "loss_conf"}
    for k, v in res_single.extra.items():
        assert res_pair.extra[k] == pytest.approx(v, rel=1e-5)
    e = res_single.extra
    assert res_single.loss == pytest.approx(0.1 * e["loss_ce"] + 0.9 * e["loss_tv"]
                                            + 1.0 * e["loss_conf"], rel=1e-5)
    assert 0 < e["loss_tv"] <= 2 and e["loss_ce"] > 0 and e["loss_conf"] > 0
    assert res_pair.loss == pytest.approx(res_single.loss, rel=1e-5)
    assert res_pair.grad_norm == pytest.approx(res_single.grad_norm, rel=1e-4)
    assert 1.0 <= res_single.tau_tf <= SETTINGS.block_size + 1
    w = single.drafter.state_dict()
    for rep in pair:
        for name, value in w.items():
            torch.testing.assert_close(rep.drafter.state_dict()[name], value, rtol=1e-5,
                                       atol=1e-6)
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                 "confidence_head.proj.weight", "confidence_head.proj.bias", "fc.weight"):
        assert not torch.equal(before[name], w[name]), f"{name} was not trained"
    assert len(single.stats) == len(STATS) + 3


def test_loader_made_wide_labels_train_like_the_drafters_own(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets, 1)
    cpu = torch.device("cpu")
    B = SETTINGS.block_size
    prepared = prepare_batch(batches[0], cfg.drafter.num_anchors, init.label_width, cfg.run.seed)
    assert prepared.labels.shape[-1] == B + 1
    # DFlash-width labels (a loader that did not know the objective) are made again, not used
    wrong = prepare_batch(batches[0], cfg.drafter.num_anchors, B, cfg.run.seed)
    results = []
    for batch in (batches[0], prepared, wrong):
        (rep,) = make_replicas(copy.deepcopy(init), [cpu], cfg.drafter, cfg.optim,
                               *head_copies(tm), SETTINGS)
        rep.accumulate(batch, feats[0], cfg.run.seed)
        results.append(reduce_and_step([rep], 0, 10))
    assert results[0].loss == results[1].loss == results[2].loss
    assert results[0].extra == results[1].extra == results[2].extra


@pytest.mark.slow  # 15 steps of training; the fast path: the step tests above
def test_training_lowers_the_loss(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets, 1, optim__lr=1e-2,
                                           optim__warmup_frac=0.0)
    (rep,) = make_replicas(init, [torch.device("cpu")], cfg.drafter, cfg.optim,
                           *head_copies(tm), SETTINGS)
    first = None
    for step in range(15):
        rep.accumulate(batches[0], feats[0], cfg.run.seed)
        res = reduce_and_step([rep], step, 15)
        first = first or res
    # The tiny random target is near uniform and the data random: what a few steps learn is
    # mostly the confidence head's calibration (CE and TV barely move); the total must fall.
    assert res.loss < 0.8 * first.loss
    assert res.extra["loss_conf"] < 0.5 * first.extra["loss_conf"]


def test_features_without_the_last_hidden_state_are_named(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets, 1)
    (rep,) = make_replicas(init, [torch.device("cpu")], cfg.drafter, cfg.optim,
                           *head_copies(tm), SETTINGS)
    H = init.config.hidden_size
    with pytest.raises(ValueError, match="post-norm last hidden state .* the target stage must "
                       "append it"):
        rep.accumulate(batches[0], feats[0][..., :-H], cfg.run.seed)


def test_dpace_does_not_combine_with_dspark(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets, 1, drafter__loss="dpace")
    with pytest.raises(ValueError, match="drafter.loss dpace does not apply"):
        make_replicas(init, [torch.device("cpu")], cfg.drafter, cfg.optim,
                      *head_copies(tm), SETTINGS)


def test_resume_of_the_other_objective_is_refused_and_the_same_is_rebuilt(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets, 1)
    cpu = torch.device("cpu")
    (rep,) = make_replicas(copy.deepcopy(init), [cpu], cfg.drafter, cfg.optim,
                           *head_copies(tm), SETTINGS)
    resume = SimpleNamespace(drafter_config=init.interchange_config(),
                             drafter_state=init.state_dict(),
                             optimizer_state=rep.optimizer.state_dict())
    kw = dict(layer_ids=init.target_layer_ids, mask_id=VOCAB - 1, resume=resume)
    with pytest.raises(ObjectiveMismatch, match="holds a DSpark drafter"):
        build_replicas(cfg.drafter, cfg.optim, tm, [cpu], seed=0, **kw)
    (back,) = build_replicas(cfg.drafter, cfg.optim, tm, [cpu], seed=0, objective="dspark",
                             settings=SETTINGS, **kw)
    assert isinstance(back.drafter, DSparkDrafter)
    for k, v in init.state_dict().items():
        assert torch.equal(back.drafter.state_dict()[k], v)
    # a fresh DSpark drafter from the settings
    (fresh,) = build_replicas(cfg.drafter, cfg.optim, tm, [cpu], seed=0,
                              layer_ids=init.target_layer_ids, mask_id=VOCAB - 1, objective="dspark",
                              settings=SETTINGS)
    assert isinstance(fresh.drafter, DSparkDrafter) and fresh.drafter.block_size == 4


def test_muon_leaves_the_heads_on_adamw(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets, 1, optim__name="muon")
    (rep,) = make_replicas(init, [torch.device("cpu")], cfg.drafter, cfg.optim,
                           *head_copies(tm), SETTINGS)
    muon = {id(p) for g in rep.optimizer.muon.param_groups for p in g["params"]}
    names = {n for n, p in rep.drafter.named_parameters() if id(p) in muon}
    assert "fc.weight" in names and "layers.0.mlp.up_proj.weight" in names
    assert not any(n.startswith(("markov_head", "confidence_head")) for n in names)
    rep.accumulate(batches[0], feats[0], cfg.run.seed)
    assert reduce_and_step([rep], 0, 10).extra["loss_tv"] > 0
