"""Drafter replicas and their optimizer step (trainer.py), on a tiny random target on CPU."""

import copy

import pytest
import torch

from dflash_core.data import BatchStream, ShardedDataset
from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
from dflash_core.models.target.config import default_layer_ids
from dflash_core.models.target.load import load_target
from dflash_core.models.training.replica import STATS
from dflash_core.models.training.trainer import make_replicas, reduce_and_step

from ...engine_fixtures import VOCAB, assets, make_config  # noqa: F401 - assets is a fixture


def head_copies(tm):
    embed = torch.nn.Embedding.from_pretrained(tm.embed_tokens.weight.detach().clone(), freeze=True)
    head = torch.nn.Linear(tm.hidden_size, tm.vocab_size, bias=False)
    head.weight = torch.nn.Parameter(tm.lm_head.weight.detach().clone(), requires_grad=False)
    return embed, head


def test_two_drafter_replicas_step_like_one_drafter_on_both_batches(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets)
    assert len(batches) == 2 and batches[0].indices != batches[1].indices
    before = {k: v.clone() for k, v in init.state_dict().items()}
    cpu = torch.device("cpu")

    # Two replicas, one batch each.
    pair = make_replicas(copy.deepcopy(init), [cpu, cpu], cfg.drafter, cfg.optim, *head_copies(tm))
    pair[0].accumulate(batches[0], feats[0], cfg.run.seed)
    pair[1].accumulate(batches[1], feats[1], cfg.run.seed)
    res_pair = reduce_and_step(pair, 0, 10)

    # One replica, both batches accumulated (grad_accum 2).
    (single,) = make_replicas(copy.deepcopy(init), [cpu], cfg.drafter, cfg.optim, *head_copies(tm))
    single.accumulate(batches[0], feats[0], cfg.run.seed)
    single.accumulate(batches[1], feats[1], cfg.run.seed)
    res_single = reduce_and_step([single], 0, 10)

    assert res_pair.loss == pytest.approx(res_single.loss, rel=1e-5)
    assert res_pair.grad_norm == pytest.approx(res_single.grad_norm, rel=1e-4)
    assert res_pair.samples == res_single.samples == len(batches[0]) + len(batches[1])
    w_single = single.drafter.state_dict()
    moved = False
    for rep in pair:
        w = rep.drafter.state_dict()
        for name, value in w_single.items():
            torch.testing.assert_close(w[name], value, rtol=1e-5, atol=1e-6)
            if name in before and not torch.allclose(before[name], value):
                moved = True
    assert moved, "the optimizer step changed no weight: the comparison would prove nothing"


def drafter_setup(cfg, target, data, n_batches: int, device="cpu", dtype="float32"):
    """The target loaded on ``device``, the first batches of the data, their features and a
    fresh one-layer drafter (seeded) of the target's shape: what a trainer test steps on."""
    tm = load_target(target, device=device, dtype=dtype)
    layer_ids = default_layer_ids(tm.num_layers, cfg.target.num_features)
    stream = BatchStream.from_config(ShardedDataset.open(data), cfg.data, seed=1, epochs=1)
    batches = list(stream.iter_batches())[:n_batches]
    feats = [tm.features(b.input_ids.to(device), b.attention_mask.to(device), layer_ids)
             for b in batches]
    dcfg = build_drafter_config(tm.model.config, num_layers=1, target_layer_ids=layer_ids,
                                block_size=4, mask_token_id=VOCAB - 1)
    torch.manual_seed(0)
    return tm, batches, feats, DFlashDrafter(dcfg)


def _setup(tmp_path, assets, n_batches=2):
    target, data = assets
    cfg = make_config(tmp_path, target, data)
    return (cfg, *drafter_setup(cfg, target, data, n_batches))


class Doubling:
    """A stand-in for a second node that saw exactly the same batches."""

    def __init__(self):
        self.calls = []

    def all_reduce_(self, buf):
        self.calls.append(buf.numel())
        buf.mul_(2)


def test_a_step_reduces_across_nodes_once_with_its_statistics(tmp_path, assets):
    cfg, tm, batches, feats, init = _setup(tmp_path, assets, 1)
    cpu = torch.device("cpu")
    runs = []
    for across in (None, Doubling()):
        pair = make_replicas(copy.deepcopy(init), [cpu, cpu], cfg.drafter, cfg.optim,
                             *head_copies(tm))
        for rep in pair:
            rep.accumulate(batches[0], feats[0], cfg.run.seed)
        runs.append((reduce_and_step(pair, 0, 10, across=across), pair, across))
    (one, pair1, _), (two, pair2, across) = runs
    assert across.calls == [pair2[0].grad_numel + len(STATS)]
    # Twice the same samples over twice the weight: same loss, gradient and weights; counts double.
    assert two.loss == pytest.approx(one.loss, rel=1e-6)
    assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    assert two.samples == 2 * one.samples and two.tokens == 2 * one.tokens
    for p, q in zip(pair1[0].params(), pair2[1].params()):
        torch.testing.assert_close(p, q)


# --------------------------------------------------------------------------------------------
# The recipe options: drafter.loss dpace, optim.name muon
# --------------------------------------------------------------------------------------------

def _recipe_setup(tmp_path, assets, loss, optim, n_batches=2):
    target, data = assets
    cfg = make_config(tmp_path, target, data, drafter__loss=loss, optim__name=optim,
                      optim__muon_lr=2e-2)
    return (cfg, *drafter_setup(cfg, target, data, n_batches))


def test_muon_takes_the_matrices_and_adamw_the_norms(tmp_path, assets):
    cfg, tm, batches, feats, init = _recipe_setup(tmp_path, assets, "dflash", "muon", 1)
    (rep,) = make_replicas(init, [torch.device("cpu")], cfg.drafter, cfg.optim, *head_copies(tm))
    opt = rep.optimizer
    names = {id(p): n for n, p in rep.drafter.named_parameters()}
    on_muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    on_adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert "fc.weight" in on_muon and "layers.0.mlp.down_proj.weight" in on_muon
    assert "hidden_norm.weight" in on_adamw and "layers.0.self_attn.q_norm.weight" in on_adamw
    assert on_muon.isdisjoint(on_adamw)
    assert on_muon | on_adamw == {names[id(p)] for p in rep.params()}  # the frozen head: neither
    rep.accumulate(batches[0], feats[0], cfg.run.seed)
    res = reduce_and_step([rep], 0, 10)
    # Each part on its own schedule: warmup step 0 of 10 at 4% is the full rate.
    assert [g["lr"] for g in opt.muon.param_groups] == [pytest.approx(2e-2)]
    assert [g["lr"] for g in opt.adamw.param_groups] == [pytest.approx(res.lr)] == [1e-3]
    assert all("momentum_buffer" in opt.muon.state[p] for p in opt.muon.param_groups[0]["params"])


@pytest.mark.parametrize("loss,optim", [("dpace", "adamw"), ("dflash", "muon"), ("dpace", "muon")])
def test_recipe_replicas_stay_identical_and_step_like_one_drafter(tmp_path, assets, loss, optim):
    cfg, tm, batches, feats, init = _recipe_setup(tmp_path, assets, loss, optim)
    cpu = torch.device("cpu")
    pair = make_replicas(copy.deepcopy(init), [cpu, cpu], cfg.drafter, cfg.optim, *head_copies(tm))
    (single,) = make_replicas(copy.deepcopy(init), [cpu], cfg.drafter, cfg.optim, *head_copies(tm))
    for step in range(2):
        for i, rep in enumerate(pair):
            rep.accumulate(batches[i], feats[i], cfg.run.seed)
        res_pair = reduce_and_step(pair, step, 10)
        for i, b in enumerate(batches):
            single.accumulate(b, feats[i], cfg.run.seed)
        res_single = reduce_and_step([single], step, 10)
        # The same loss: D-PACE's weights depend on each block alone, normalised by the total.
        assert res_pair.loss == pytest.approx(res_single.loss, rel=1e-5)
    a, b = (rep.drafter.state_dict() for rep in pair)
    for name in a:  # same gradients, same optimizer state: bit-identical replicas
        assert torch.equal(a[name], b[name]), name
    sa, sb = (rep.optimizer.state_dict()["state"] for rep in pair)
    assert sa.keys() == sb.keys() and all(
        torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i] if torch.is_tensor(sa[i][k]))
    w = single.drafter.state_dict()
    for name in w:  # Muon's Newton-Schulz rounds to bf16: a sum in another order may round apart
        torch.testing.assert_close(a[name], w[name], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_resume_from_a_checkpoint_gives_the_next_step_of_continuing(tmp_path, assets, optim):
    from dflash_core.checkpoint import save_load as ckpt

    cfg, tm, batches, feats, init = _recipe_setup(tmp_path, assets, "dpace", optim, 3)
    cpu = torch.device("cpu")
    (rep,) = make_replicas(copy.deepcopy(init), [cpu], cfg.drafter, cfg.optim, *head_copies(tm))
    for step in range(2):
        rep.accumulate(batches[step], feats[step], cfg.run.seed)
        reduce_and_step([rep], step, 10)
    path = ckpt.save_checkpoint(
        tmp_path / "run", 2, drafter_state=rep.drafter.interchange_state(),
        drafter_config=rep.drafter.interchange_config(),
        optimizer_state=rep.optimizer.state_dict(), scheduler_state={"step": 2},
        trainer_state={"optimizer": optim}, keep=0)
    rep.accumulate(batches[2], feats[2], cfg.run.seed)
    going_on = reduce_and_step([rep], 2, 10)

    loaded = ckpt.load_checkpoint(path)
    drafter = DFlashDrafter(DFlashDrafter.config_from_dict(loaded.drafter_config))
    drafter.load_state_dict(loaded.drafter_state)
    (again,) = make_replicas(drafter, [cpu], cfg.drafter, cfg.optim, *head_copies(tm))
    again.optimizer.load_state_dict(loaded.optimizer_state)
    again.accumulate(batches[2], feats[2], cfg.run.seed)
    resumed = reduce_and_step([again], 2, 10)
    assert resumed.loss == going_on.loss and resumed.grad_norm == going_on.grad_norm
    for name, value in rep.drafter.state_dict().items():  # the optimizer state came back too
        assert torch.equal(again.drafter.state_dict()[name], value), name
    # Without the optimizer state the same step lands elsewhere: the check above can fail.
    (fresh,) = make_replicas(copy.deepcopy(drafter), [cpu], cfg.drafter, cfg.optim,
                             *head_copies(tm))
    fresh.accumulate(batches[2], feats[2], cfg.run.seed)
    reduce_and_step([fresh], 2, 10)
    assert any(not torch.equal(fresh.drafter.state_dict()[n], v)
               for n, v in rep.drafter.state_dict().items())
