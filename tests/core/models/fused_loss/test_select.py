"""drafter.fused_loss off CUDA (models/fused_loss/select.py): auto runs the torch loss of every
family, on is refused in one line naming the key (by the step loss and by preflight, before the
target loads), and YAML's unquoted on / off are the modes. The fused kernels themselves are
tests/gpu/test_fused_loss_gpu.py's."""

import pytest
import torch

from dflash_core.config import ConfigError, config_from_dict, load_config
from dflash_core.models import objective as obj
from dflash_core.models.dflash.loss import DFlashStepLoss
from dflash_core.models.dspark import loss as dspark_loss
from dflash_core.models.dspark.heads import ConfidenceHead, MarkovHead
from dflash_core.models.dspark.step_loss import DSparkStepLoss
from dflash_core.models.fused_loss import select
from dflash_core.planning.drafter_checks import check_fused_loss

from ...engine_fixtures import assets, long_config  # noqa: F401 - assets is a fixture
from ...planning.test_preflight import refused

V, H, R = 50, 8, 4


class Drafter:
    """What the step losses read of a drafter (both families)."""

    def __init__(self, block_size: int, markov: bool = False):
        g = torch.Generator().manual_seed(0)
        self.block_size, self.markov_rank = block_size, R
        self.lm_head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
        torch.nn.init.normal_(self.lm_head.weight, generator=g)
        self.markov_head = MarkovHead(V, R) if markov else None
        self.confidence_head = ConfidenceHead(H + R) if markov else None


def dcfg(**keys):
    return config_from_dict({"drafter": {"objective": "dflash", **keys}}).drafter


def batch(B: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 24), generator=g)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[:, :3] = 0
    anchors = torch.tensor([[3, 9, 20], [5, 12, -1]])
    hidden = torch.randn(2, 3 * B, H, generator=g)
    return ids, mask, anchors, hidden


def one_line(err: ConfigError) -> None:
    assert err.key == "drafter.fused_loss" and "\n" not in str(err) and "\n" not in err.hint


def test_auto_is_fused_only_on_cuda_with_triton(monkeypatch):
    assert not select.fused("auto", "cpu") and not select.fused("off", "cpu")
    monkeypatch.setattr(select, "triton_installed", lambda: True)
    assert select.fused("auto", "cuda") and select.fused("on", "cuda")
    assert not select.fused("auto", "cpu") and not select.fused("off", "cuda")
    monkeypatch.setattr(select, "triton_installed", lambda: False)
    assert not select.fused("auto", "cuda")


def test_on_without_cuda_or_triton_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(select, "triton_installed", lambda: True)
    with pytest.raises(ConfigError) as cpu:
        select.fused("on", "cpu")
    one_line(cpu.value)
    assert "CUDA" in str(cpu.value) and "CPU" in str(cpu.value) and "auto" in cpu.value.hint
    monkeypatch.setattr(select, "triton_installed", lambda: False)
    with pytest.raises(ConfigError) as bare:
        select.fused("on", "cuda")
    one_line(bare.value)
    assert "Triton" in str(bare.value)


def test_the_dflash_step_loss_on_the_cpu_is_the_torch_loss(monkeypatch):
    def fused_path(*a, **k):
        raise AssertionError("the fused loss ran on the CPU")

    monkeypatch.setattr(obj, "_fused_chunked_loss", fused_path)
    drafter = Drafter(4)
    ids, mask, anchors, hidden = batch(4)
    labels = obj.block_labels(ids, mask, anchors, 4)
    for loss in ("dflash", "dpace"):
        step = DFlashStepLoss(drafter, dcfg(block_size=4, loss=loss, loss_chunk=5,
                                            fused_loss="auto"))
        assert step.fused_mode == "auto"
        _, t = step.targets(drafter, None, labels, ids, anchors)
        h = hidden.clone().requires_grad_()
        got = step(drafter, h, None, labels, t)
        (got.loss * got.weight_sum).backward()
        want = obj.chunked_loss(hidden, labels, drafter.lm_head.weight, step.gamma, 5,
                                rows=t.picked)
        assert torch.equal(got.loss.detach(), want.loss) and h.grad.abs().sum() > 0
    on = DFlashStepLoss(drafter, dcfg(block_size=4, fused_loss="on"))
    with pytest.raises(ConfigError) as e:
        on(drafter, hidden, None, labels, t)
    one_line(e.value)


def test_the_dspark_step_loss_on_the_cpu_is_the_torch_loss(monkeypatch):
    def fused_path(*a, **k):
        raise AssertionError("the fused loss ran on the CPU")

    monkeypatch.setattr(dspark_loss, "fused_row_terms", fused_path)
    drafter = Drafter(3, markov=True)
    ids, mask, anchors, hidden = batch(3)
    wide = dspark_loss.wide_labels(ids, mask, anchors, 3)
    last = torch.randn(2, 24, H)
    feats = torch.cat([torch.randn(2, 24, 2 * H), last], -1)
    drafter.config, drafter.target_layer_ids = type("C", (), {"hidden_size": H}), [0, 1]
    step = DSparkStepLoss(drafter, dcfg(objective="dspark", block_size=3, loss_chunk=4))
    _, t = step.targets(drafter, feats, wide, ids, anchors)
    pos = (anchors.clamp(min=0)[:, :, None] + torch.arange(3)).reshape(2, -1)
    h = hidden.clone().requires_grad_()
    got = step(drafter, h, pos, t.labels, t)
    (got.loss * got.weight_sum).backward()
    s = step.settings
    want = dspark_loss.dspark_loss(hidden, last, pos, t.labels, t.extra[1], drafter,
                                   gamma=step.gamma, chunk=4, rows=t.picked,
                                   loss_weights=(s.ce_weight, s.tv_weight, s.conf_weight))
    assert torch.equal(got.loss.detach(), want.loss.detach()) and h.grad.abs().sum() > 0
    on = DSparkStepLoss(drafter, dcfg(objective="dspark", block_size=3, fused_loss="on"))
    with pytest.raises(ConfigError) as e:
        on(drafter, hidden, pos, t.labels, t)
    one_line(e.value)


def test_preflight_refuses_on_for_drafters_without_cuda(monkeypatch):
    cfg = config_from_dict({"drafter": {"fused_loss": "on"}})
    monkeypatch.setattr(select, "triton_installed", lambda: True)
    with pytest.raises(ConfigError) as e:
        check_fused_loss(cfg, [torch.device("cuda:0"), torch.device("cpu")])
    one_line(e.value)
    check_fused_loss(cfg, [torch.device("cuda:0"), torch.device("cuda:1")])  # runs: no refusal
    cfg.drafter.fused_loss = "auto"
    check_fused_loss(cfg, [torch.device("cpu")])


def test_an_engine_run_with_on_stops_at_preflight_in_one_line(tmp_path, assets):
    err = refused(long_config(tmp_path, assets, drafter__fused_loss="on"))
    assert err.error_kind == "config"
    assert "drafter.fused_loss" in err.message and "\n" not in err.message, err.message


def test_unquoted_yaml_on_and_off_are_the_modes(tmp_path):
    assert config_from_dict({}).drafter.fused_loss == "auto"
    for text, mode in (("on", "on"), ("off", "off"), ("auto", "auto"), ("'on'", "on")):
        path = tmp_path / "config.yaml"
        path.write_text(f"drafter:\n  fused_loss: {text}\n")
        assert load_config(path).drafter.fused_loss == mode
    with pytest.raises(ConfigError) as e:
        config_from_dict({"drafter": {"fused_loss": "fast"}})
    assert e.value.key == "drafter.fused_loss" and "'auto', 'on', 'off'" in str(e.value)


def test_the_log_says_which_loss_a_cuda_drafter_runs(monkeypatch):
    from dflash_core.planning.drafter_checks import fused_loss_line

    def line(mode, triton):
        monkeypatch.setattr(select, "triton_installed", lambda: triton)
        return fused_loss_line(config_from_dict({"drafter": {"fused_loss": mode}}))

    assert line("auto", True).startswith("drafter loss: fused") and "auto" in line("auto", True)
    assert line("on", True).startswith("drafter loss: fused")
    assert line("off", True) == ("drafter loss: torch (chunked, logits recomputed in backward; "
                                 "drafter.fused_loss off)")
    assert line("auto", False).endswith("drafter.fused_loss auto, Triton is not installed)")


def test_the_dflash2_step_loss_on_the_cpu_is_the_torch_loss(monkeypatch):
    from dflash_core.models.dflash2 import loss as d2loss
    from dflash_core.models.dflash2.loss import DFlash2StepLoss
    from tests.core.models.dflash2.tiny import B as B2, dflash2, head

    def fused_path(*a, **k):
        raise AssertionError("the fused loss ran on the CPU")

    monkeypatch.setattr(d2loss, "_fused_loss", fused_path)
    drafter = dflash2(std=0.3)
    drafter.attach_target_head(*head())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 299, (2, 30), generator=g)
    anchors = torch.tensor([[4, 9, 20], [2, 17, -1]])
    labels = obj.block_labels(ids, torch.ones_like(ids), anchors, B2)
    hidden = torch.randn(2, 3 * B2, drafter.config.hidden_size, generator=g)
    keys = {"objective": "dflash2", "block_size": B2, "selector_rank": 8, "selector_top_k": 5}
    step = DFlash2StepLoss(drafter, dcfg(**keys, fused_loss="auto"))
    _, t = step.targets(drafter, None, labels, ids, anchors)
    got = step(drafter, hidden, None, labels, t)
    assert float(got.loss) > 0
    on = DFlash2StepLoss(drafter, dcfg(**keys, fused_loss="on"))  # accepted by the config ...
    with pytest.raises(ConfigError) as e:  # ... and refused where it cannot run
        on(drafter, hidden, None, labels, t)
    one_line(e.value)
