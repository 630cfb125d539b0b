"""Preflight's capacity checks (planning/capacity_checks.py): the memory plan against the GPUs,
the run's checkpoints against the disk."""

import shutil

import pytest
import torch

from dflash_core.observe import events
from dflash_core.config import ConfigError
from dflash_core.pipeline.engine import Engine
from dflash_core.observe.events import Log, MemoryPlan
from dflash_core.planning.capacity_checks import check_memory
from dflash_core.planning.memory import plan_memory
from dflash_core.planning.sample_length import longest_sample
from dflash_core.units import GiB

from ..engine_fixtures import (  # noqa: F401 - assets, shutdown_started_engines: fixtures
    assets, long_config, make_config, run_to_end, shutdown_started_engines,
)
from ..planning.test_memory import GPU96, QWEN36_27B, node
from .test_preflight import refused


# --------------------------------------------------------------------------------------------
# The memory plan
# --------------------------------------------------------------------------------------------

def check_node_on_96gib_cards(monkeypatch, cfg) -> tuple[list, ConfigError | None]:
    """(what check_memory published, what it raised) for the real node's layout."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (96 * GiB, 96 * GiB))
    published = []
    try:
        check_memory(cfg, QWEN36_27B, [torch.device(f"cuda:{i}") for i in range(7)],
                     [torch.device("cuda:7")], published.append)
    except ConfigError as exc:
        return published, exc
    return published, None


def test_a_plan_that_does_not_fit_is_refused_naming_the_key_it_picks(monkeypatch):
    published, err = check_node_on_96gib_cards(monkeypatch, node())
    assert err is not None and err.error_kind == "config"
    assert err.key == "drafter.micro_block_tokens"
    assert "the memory plan does not fit:" in str(err) and "plan does NOT fit" in str(err)
    assert err.hint.startswith("cuda:7 (drafter) needs 243.5 GiB but has 96.0 GiB free: "
                               "lower drafter.micro_block_tokens (now 65536)")
    # one sequence per drafter pass fits: nothing is refused
    published, err = check_node_on_96gib_cards(monkeypatch, node(micro_block_tokens=8192))
    assert err is None and published[0].fits


def test_plan_event_round_trips(monkeypatch):
    cfg = node()
    published, err = check_node_on_96gib_cards(monkeypatch, cfg)
    assert err is not None
    (event,) = published
    assert isinstance(event, events.MemoryPlan) and event.fits is False
    back = events.from_json(event.to_json())
    assert back.rows == plan_memory(cfg, QWEN36_27B, GPU96, GPU96).to_event_rows()
    row = back.rows[0]
    assert set(row) >= {"device", "role", "components", "total", "free", "fits"}
    assert row["total"] == sum(row["components"].values())


def _fake_gpus(monkeypatch, free_gib: float):
    """Preflight sees CUDA devices with ``free_gib`` free (no GPU needed to plan)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda d=None: (int(free_gib * GiB), int(free_gib * GiB)))
    return [torch.device("cuda", i) for i in range(2)], [torch.device("cuda", i) for i in range(2, 8)]


def test_plan_that_does_not_fit_names_the_sizes_that_would(monkeypatch):

    tdev, ddev = _fake_gpus(monkeypatch, 96)
    cfg = node(micro_block_tokens=65536)
    cfg.layout.targets, cfg.layout.drafters = [0, 1], [2, 3, 4, 5, 6, 7]
    with pytest.raises(ConfigError) as info:
        check_memory(cfg, QWEN36_27B, tdev, ddev, lambda e: None)
    assert info.value.key == "drafter.micro_block_tokens"
    assert "these sizes fit: drafter.micro_block_tokens: 8192" in info.value.hint
    assert "layout.auto_fit: true" in info.value.hint


def test_auto_fit_lowers_the_sizes_and_says_so(monkeypatch):

    tdev, ddev = _fake_gpus(monkeypatch, 95)  # a 96 GB card offers ~95.6 GiB; rehearsed at 95
    cfg = node(micro_block_tokens=32768)
    cfg.layout.targets, cfg.layout.drafters, cfg.layout.auto_fit = [0, 1], [2, 3, 4, 5, 6, 7], True
    events = []
    assert check_memory(cfg, QWEN36_27B, tdev, ddev, events.append) == {
        "drafter.micro_block_tokens": 8192}
    assert cfg.drafter.micro_block_tokens == 8192
    (log,) = [e for e in events if isinstance(e, Log) and e.level == "warning"]
    assert "drafter.micro_block_tokens 32768 -> 8192" in log.message
    (plan,) = [e for e in events if isinstance(e, MemoryPlan)]
    assert plan.fits
    # and how long a sample these GPUs train (a whole sequence a pass: nothing recomputed)
    (said,) = [e.message for e in events if isinstance(e, Log) and "samples of up to" in e.message]
    longest = longest_sample(cfg, QWEN36_27B, {f"cuda:{i}": 95 * GiB for i in range(8)},
                             {f"cuda:{i}": 95 * GiB for i in range(8)})
    assert f"samples of up to {longest} tokens fit these GPUs (data.max_length 3072" in said
    assert longest > 3072 and cfg.drafter.recompute == "auto"


# --------------------------------------------------------------------------------------------
# The disk the checkpoints need
# --------------------------------------------------------------------------------------------

def _tensor_bytes(folder, keep) -> int:
    """Bytes of the tensors of a checkpoint folder whose names ``keep`` accepts."""
    from safetensors import safe_open

    total = 0
    for f in sorted(folder.rglob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                if keep(key):
                    t = sf.get_tensor(key)
                    total += t.numel() * t.element_size()
    return total


def test_the_checkpoint_size_is_what_a_checkpoint_holds(tmp_path, assets):
    import json
    from types import SimpleNamespace

    from dflash_core.checkpoint import save_load as ckpt
    from dflash_core.checkpoint.folders import latest_checkpoint
    from dflash_core.checkpoint import size as checkpoint_size
    from dflash_core.checkpoint.checkpointer import checkpoint_bytes

    target, data = assets
    cfg = make_config(tmp_path, target, data, run__max_steps=3, data__eval_prompts=0,
                      checkpoint__every=3, checkpoint__keep=2)
    engine = Engine(cfg)
    rec = run_to_end(engine)
    engine.shutdown()
    hf_config = json.loads((target / "config.json").read_text())
    params, matrices = checkpoint_size.drafter_counts(cfg, hf_config)
    size = checkpoint_size.checkpoint_bytes(params, matrices, 2, "adamw")  # bfloat16 served
    folder = latest_checkpoint(cfg.run_dir)
    # every tensor but the RNG state and AdamW's scalar step counts, byte for byte
    assert size == _tensor_bytes(folder, lambda k: not k.startswith("trainer/")
                                 and not k.endswith("/step"))
    # the run's own disk check counts the drafter it built the same way
    loaded = ckpt.load_checkpoint(folder)
    drafter = SimpleNamespace(state_dict=lambda: loaded.drafter_state)
    assert checkpoint_bytes(drafter, getattr(torch, cfg.drafter.dtype), cfg.optim.name) == size
    (said,) = [e.message for e in rec.of(Log) if e.message.startswith("checkpoints: a checkpoint")]
    # one run of 3 steps writes one checkpoint: nothing else to keep or write beside it
    assert said.startswith(f"checkpoints: a checkpoint is {checkpoint_size.gib(size)}; "
                           f"keep 2 needs {checkpoint_size.gib(size)};")
    assert f"free under {cfg.run_dir}" in said


def test_the_shipped_drafter_checkpoint_size_and_keep_3(monkeypatch, tmp_path):
    from collections import namedtuple

    from dflash_core.planning import capacity_checks

    cfg = node()  # config.yaml's drafter on the Qwen3.6-27B shape
    monkeypatch.setattr(capacity_checks.shutil, "disk_usage",
                        lambda p: namedtuple("U", "total used free")(0, 0, 500 * GiB))
    said = []
    capacity_checks.check_checkpoint_disk(cfg, QWEN36_27B, tmp_path, 30_000, said.append)
    # 2.86 G parameters (issue 26 measured 11.4 GB of float32 weights): bfloat16 5.3 GiB +
    # float32 master 10.7 GiB + AdamW moments 21.3 GiB; keep 3 and one being written: 4 of them
    assert said[0].message.startswith(
        "checkpoints: a checkpoint is 37.3 GiB; keep 3 needs 149.0 GiB (one being written); "
        "500.0 GiB free under")
    # optim.name muon: one float32 momentum per matrix entry instead of AdamW's two
    cfg.optim.name = "muon"
    capacity_checks.check_checkpoint_disk(cfg, QWEN36_27B, tmp_path, 30_000, said.append)
    assert said[1].message.startswith("checkpoints: a checkpoint is 26.6 GiB; keep 3 needs "
                                      "106.5 GiB (one being written);")


@pytest.mark.parametrize("free_checkpoints, key, keep", [(2.5, "checkpoint.keep", 1),
                                                         (0.5, "run.output_dir", 0)])
def test_checkpoints_that_cannot_fit_are_refused_before_loading(tmp_path, assets, monkeypatch,
                                                                free_checkpoints, key, keep):
    import json
    from collections import namedtuple

    from dflash_core.checkpoint import size as checkpoint_size
    from dflash_core.planning import preflight

    target, data = assets
    cfg = long_config(tmp_path, assets, run__max_steps=30, checkpoint__every=3,
                      checkpoint__keep=3)
    params, matrices = checkpoint_size.drafter_counts(
        cfg, json.loads((target / "config.json").read_text()))
    size = checkpoint_size.checkpoint_bytes(params, matrices, 2)
    free = int(free_checkpoints * size)
    real = shutil.disk_usage
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: real(p)._replace(free=free)
                        if str(p).startswith(str(tmp_path)) else real(p))
    monkeypatch.setattr(preflight, "MIN_FREE_DISK", 0)  # the tiny checkpoints are KBs
    err = refused(cfg)
    assert err.error_kind == "config"
    assert (f"the run's checkpoints do not fit: a checkpoint is {checkpoint_size.gib(size)}; "
            f"keep 3 needs {checkpoint_size.gib(4 * size)} (one being written); "
            f"{checkpoint_size.gib(free)} free under") in err.message
    assert key in err.message + err.hint
    if keep:
        assert f"set checkpoint.keep: {keep} (needs {checkpoint_size.gib(2 * size)})" in err.hint
    else:
        assert "checkpoint.keep" not in err.hint and "run.output_dir" in err.hint


def test_optimizer_state_per_parameter_is_what_torch_keeps():
    from dflash_core.checkpoint.size import optimizer_state_bytes

    def state_bytes(opt):
        return sum(t.numel() * t.element_size() for st in opt.state.values()
                   for name, t in st.items() if torch.is_tensor(t) and name != "step")

    w, norm = torch.nn.Parameter(torch.randn(24, 16)), torch.nn.Parameter(torch.ones(16))
    adamw = torch.optim.AdamW([w, norm])
    muon = torch.optim.Muon([w])
    for opt in (adamw, muon):
        (w.sum() + norm.sum()).backward()
        opt.step()
        opt.zero_grad()
    n = w.numel() + norm.numel()
    assert state_bytes(adamw) == optimizer_state_bytes("adamw", n, w.numel())
    # Muon: one momentum per matrix entry (the norms are AdamW's: 8 bytes each)
    assert state_bytes(muon) == optimizer_state_bytes("muon", n, w.numel()) - 8 * norm.numel()
    with pytest.raises(ValueError, match="no checkpoint size known for optimizer 'sgd'"):
        optimizer_state_bytes("sgd", n, w.numel())
