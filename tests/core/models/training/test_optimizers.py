"""The drafter's optimizers (optimizers.py): Muon + AdamW as one state dict, and a clear refusal
where torch has no Muon."""

import copy

import pytest
import torch

from dflash_core.config import ConfigError, OptimConfig
from dflash_core.models.training import optimizers


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5, bias=True), torch.nn.LayerNorm(5),
                               torch.nn.Linear(5, 3, bias=False))


def _step(model, opt):
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def test_one_state_dict_in_torchs_form_that_round_trips():
    model = _model()
    params = list(model.parameters())
    opt = optimizers.build_optimizer(model, params, OptimConfig(name="muon", lr=1e-2), torch.device("cpu"))
    muon, rest = optimizers.split_params(model, params)
    assert [p.shape for p in muon] == [(5, 6), (3, 5)] and len(rest) == 3  # bias, norm w and b
    _step(model, opt)
    sd = opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3, 4]]
    assert set(sd["state"][0]) == {"momentum_buffer"} and {"exp_avg", "exp_avg_sq"} <= set(sd["state"][2])

    twin = _model()
    twin.load_state_dict(model.state_dict())
    opt2 = optimizers.build_optimizer(twin, list(twin.parameters()), OptimConfig(name="muon", lr=1e-2),
                                      torch.device("cpu"))
    opt2.load_state_dict(copy.deepcopy(sd))  # as from disk: torch would share the tensors
    torch.manual_seed(1)
    _step(model, opt)
    torch.manual_seed(1)
    _step(twin, opt2)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="parameter groups"):  # an AdamW state is not Muon's
        opt2.load_state_dict(torch.optim.AdamW(list(twin.parameters())).state_dict())


def test_a_torch_without_muon_is_a_config_error_naming_the_fix(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ConfigError) as err:
        optimizers.build_optimizer(_model(), list(_model().parameters()), OptimConfig(name="muon"),
                                   torch.device("cpu"))
    assert err.value.key == "optim.name" and "torch.optim.Muon" in str(err.value)
    assert "optim.name: adamw" in err.value.hint


def test_muon_lr_zero_means_optim_lr():
    model = _model()
    opt = optimizers.build_optimizer(model, list(model.parameters()),
                                     OptimConfig(name="muon", lr=3e-3, muon_lr=0.0), torch.device("cpu"))
    optimizers.set_lr(opt, OptimConfig(name="muon", lr=3e-3, muon_lr=0.0), 0.5)
    assert [g["lr"] for g in opt.param_groups] == [1.5e-3, 1.5e-3]
    optimizers.set_lr(opt, OptimConfig(name="muon", lr=3e-3, muon_lr=2e-2), 0.5)
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1.5e-3]


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_the_staging_layout_made_before_the_first_step_is_the_stepped_state(name):
    """The checkpoint arena is sized at warm-up from the state the optimizer will have: for Muon
    too (a wrong guess remakes the arena at the first checkpoint, blocking training longer)."""
    from dflash_core.checkpoint.staging import stepped_optimizer_state

    model = _model()
    params = list(model.parameters())
    opt = optimizers.build_optimizer(model, params, OptimConfig(name=name, lr=1e-2),
                                     torch.device("cpu"))
    guess = stepped_optimizer_state(opt)
    _step(model, opt)
    real = opt.state_dict()
    assert guess["param_groups"] == real["param_groups"]
    assert {i: {k: (tuple(v.shape), v.dtype) for k, v in s.items()}
            for i, s in guess["state"].items()} == \
        {int(i): {k: (tuple(v.shape), v.dtype) for k, v in s.items()}
         for i, s in real["state"].items()}
