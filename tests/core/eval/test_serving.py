"""What is measured is what is served (issue 46): the drafter decodes in its served dtype by
default (eval, the run's evaluation; float32 by name), and acceptance is counted in vLLM's and
SGLang's terms beside tau."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_core.eval import EvalInputError, EvalOptions, Evaluation
from dflash_core.acceptance import serving_counts, serving_fields
from dflash_core.eval.drafter_dtype import check_dtype, served_copy, served_dtype_of
from dflash_core.eval.table import set_table
from tests.core.eval.conftest import DEMO_LAYERS, DEMO_TEXTS, save_dflash, write_jsonl


def test_serving_counts_from_a_known_histogram():
    # 5 rounds: accepted 0, 1, 2, 2, 3 drafts; proposed 1, 2, 3, 3, 3 (the first near the limit)
    sc = serving_counts([1, 1, 2, 1], [0, 1, 1, 3])
    assert sc.rounds == 5 and sc.accepted == 8 and sc.proposed == 12
    assert sc.tau == pytest.approx(13 / 5)  # vLLM's mean acceptance length, SGLang's accept len
    assert sc.accept_length_without_bonus == pytest.approx(8 / 5)  # tau - 1
    # position k: rounds that accepted >= k / rounds that proposed >= k
    assert sc.acceptance_rate_per_position == pytest.approx([4 / 5, 3 / 4, 1 / 3])
    assert sc.draft_acceptance_rate == pytest.approx(8 / 12)
    # without the proposals: every round proposed the full block (a server's num_drafts)
    full = serving_counts([1, 1, 2, 1])
    assert full.acceptance_rate_per_position == pytest.approx([4 / 5, 3 / 5, 1 / 5])
    assert full.draft_acceptance_rate == pytest.approx(8 / 15)
    assert serving_counts([]).acceptance_rate_per_position == []
    assert set(serving_fields([1, 1], [0, 2])) == {
        "proposed", "accept_length_without_bonus", "acceptance_rate_per_position",
        "draft_acceptance_rate"}


def _bf16_folder(folder, hf_config, seed=1):
    """A drafter folder whose model.safetensors is bfloat16, as a run's checkpoint writes it."""
    save_dflash(folder, hf_config, seed)
    w = folder / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(w)).items()}, str(w))
    return folder


def _watch(monkeypatch):
    """The dtype of the drafter's parameters at each forward while decoding."""
    from dflash_core.models.dflash.drafter import DFlashDrafter

    seen = []
    forward = DFlashDrafter.forward

    def spy(self, *a, **k):
        seen.append(self.fc.weight.dtype)
        return forward(self, *a, **k)
    monkeypatch.setattr(DFlashDrafter, "forward", spy)
    return seen


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_target, demo_hf_config):
    root = tmp_path_factory.mktemp("served")
    drafter = _bf16_folder(root / "d", demo_hf_config)
    prompts = write_jsonl(root / "p.jsonl", [{"prompt": t} for t in DEMO_TEXTS[:2]])
    return {"target": demo_target, "drafter": drafter, "prompts": prompts}


def _run(served, out, **kw):
    opts = EvalOptions(target=str(served["target"]), drafters=[str(served["drafter"])],
                       prompts=[f"p={served['prompts']}"], max_new_tokens=8, batch=2,
                       out=str(out), device="cpu", **kw)
    return Evaluation(opts, lambda m: None)


def test_eval_decodes_the_drafter_in_its_served_dtype_and_float32_by_name(
        served, tmp_path, monkeypatch):
    assert served_dtype_of(served["drafter"]) == "bfloat16"
    seen = _watch(monkeypatch)
    ev = _run(served, tmp_path / "a")
    report = ev.run()
    assert seen and set(seen) == {torch.bfloat16}
    res = json.loads((tmp_path / "a" / "results.json").read_text())
    (label,) = res["drafters"]
    assert res["drafters"][label]["dtype"] == "bfloat16"
    d = res["sets"]["p"]["drafters"][label]
    sc = serving_counts(d["acceptance"], d["proposed"])
    assert d["accept_length_without_bonus"] == pytest.approx(d["tau"] - 1)
    assert d["acceptance_rate_per_position"] == pytest.approx(sc.acceptance_rate_per_position)
    assert d["draft_acceptance_rate"] == pytest.approx(sc.draft_acceptance_rate)
    s = report.sets[0]
    table = set_table(s.name, s.prompts, s.plain, s.drafters, report.per_round, True)
    assert any(line.startswith("accept length w/o bonus") for line in table.splitlines())
    assert any(line.startswith("draft acceptance rate") for line in table.splitlines())

    seen.clear()
    _run(served, tmp_path / "b", drafter_dtype="float32").run()
    assert seen and set(seen) == {torch.float32}
    # another dtype is another measurement: not continued in the bfloat16 results
    with pytest.raises(EvalInputError, match="other settings"):
        _run(served, tmp_path / "a", drafter_dtype="float32")


def test_eval_also_counts_its_rounds_as_vllm_s_counters_do(served, tmp_path):
    """Each drafter's greedy line keeps its rounds counted whole (served_acceptance, every
    round of served_drafts drafts); results.json's vllm_count sums them as vLLM's four counters,
    and the table says its tau beside ours. 8 new tokens: every prompt's last round is cut."""
    from dflash_core.served_counts import VllmCounts

    report = _run(served, tmp_path).run()
    res = json.loads((tmp_path / "results.json").read_text())
    (label,) = res["drafters"]
    lines = [json.loads(x) for x in (tmp_path / "p" / f"drafter-{label}.jsonl").read_text()
             .splitlines()]
    rows = [x for x in lines if x["kind"] == "prompt"]
    assert len(rows) == 2 and all(x["served_drafts"] == 3 for x in rows)
    want = VllmCounts(0, 0, 0, [])
    for x in rows:
        assert len(x["served_acceptance"]) == len(x["acceptance"])
        assert all(a <= w <= 3 for a, w in zip(x["acceptance"], x["served_acceptance"]))
        want = want + VllmCounts.of_rounds(x["served_acceptance"], 3)
    got = res["sets"]["p"]["drafters"][label]["vllm_count"]
    assert VllmCounts.from_record(got) == want
    assert got["drafts"] == sum(len(x["acceptance"]) for x in rows)
    assert got["draft_tokens"] == 3 * got["drafts"]
    assert got["mean_acceptance_length"] == pytest.approx(1 + want.accepted / want.drafts)
    assert got["accepted"] >= sum(sum(x["acceptance"]) for x in rows)
    assert res["sets"]["p"]["plain"]["vllm_count"] is None
    s = report.sets[0]
    table = set_table(s.name, s.prompts, s.plain, s.drafters, report.per_round, True)
    (row,) = [x for x in table.splitlines() if x.startswith("tau, vLLM's count")]
    assert row.split()[-1] == f"{want.mean_acceptance_length:.2f}"
    assert not any(x.startswith("vLLM:") for x in table.splitlines())
    # with --engine vllm's figures (served.ServedSet) the vLLM rows follow, its plain beside
    from dflash_core.eval.served import ServedSet

    v = ServedSet(counts=VllmCounts(5, 15, 6, [3, 2, 1]), prompts=2, tokens=16, seconds=0.5,
                  tokens_per_s=28.0, speedup=1.4, steps_equal=1, plain_tokens_per_s=20.0,
                  vs_ours=[{"index": 1, "id": "line 2", "position": 3}])
    table = set_table(s.name, s.prompts, s.plain, s.drafters, report.per_round, True,
                      served={label: v})
    rows = {x.split("  ")[0]: x.split() for x in table.splitlines() if x.startswith("vLLM:")}
    assert rows["vLLM: tau (its counters)"][-1] == "2.20"  # 1 + 6 / 5
    assert rows["vLLM: steps = our rounds"][-2:] == ["1/2", "prompts"]
    assert rows["vLLM: per position"][-3:] == ["0.60", "0.40", "0.20"]
    assert rows["vLLM: tokens/s"][-2:] == ["20.0", "28.0"]
    assert rows["vLLM: speedup"][-2:] == ["1.00x", "1.40x"]
    assert " ".join(rows["vLLM: lossless"][-5:]) == "exact; 1 differ from ours"


def test_a_dtype_the_device_cannot_run_or_an_unknown_name_is_one_line(served, tmp_path,
                                                                      monkeypatch):
    with pytest.raises(EvalInputError, match="--drafter-dtype 'int8': use bfloat16"):
        _run(served, tmp_path, drafter_dtype="int8")
    assert not (tmp_path / "p").exists()  # refused before any file was started
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def refuses_half(q, k, v, *a, **kw):  # as an older torch's CPU kernels answer
        if q.dtype == torch.float16:
            raise RuntimeError('"baddbmm_with_gemm" not implemented for \'Half\'')
        return sdpa(q, k, v, *a, **kw)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refuses_half)
    with pytest.raises(EvalInputError, match="cpu cannot run the drafter in float16 "
                                             r"\(\"baddbmm_with_gemm\" not implemented"):
        _run(served, tmp_path, drafter_dtype="float16")
    assert check_dtype("bfloat16", torch.device("cpu")) == "bfloat16"


def test_the_run_evaluates_a_served_copy_and_publishes_serving_counts(
        demo_target, demo_hf_config, monkeypatch):
    from dflash_core.config import EvalConfig
    from dflash_core.eval.run_sets import RunSet
    from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config
    from dflash_core.models.target.load import load_target
    from dflash_core.pipeline.evaluation import Evaluator

    target = load_target(demo_target, device=torch.device("cpu"), dtype="float32")
    torch.manual_seed(0)
    drafter = DFlashDrafter(build_drafter_config(
        demo_hf_config, num_layers=1, target_layer_ids=DEMO_LAYERS, block_size=4,
        mask_token_id=0))
    drafter.attach_target_head(target.embed_tokens, target.lm_head)
    ids = tuple(tuple(t.encode()) for t in DEMO_TEXTS[:2])
    sets = [RunSet("p", ids, 8, frozenset())]
    seen = _watch(monkeypatch)
    for dtype, want in (("served", torch.bfloat16), ("float32", torch.float32)):
        events = []
        ev = Evaluator(EvalConfig(drafter_dtype=dtype, best_set="p"), events.append,
                       dataset=None, eval_indices=[], layer_ids=DEMO_LAYERS, max_length=64,
                       loss_chunk=4096, seed=0, sets=sets, served_dtype="bfloat16")
        seen.clear()
        assert ev.evaluate(10, drafter, target) is not None
        assert seen and set(seen) == {want}
        (res,) = events
        assert res.drafter_dtype == str(want).removeprefix("torch.")
        assert res.proposed and sum(res.proposed) == sum(res.acceptance)
        assert res.accept_length_without_bonus == pytest.approx(res.tau - 1)
        sc = serving_counts(res.acceptance, res.proposed)
        assert res.acceptance_rate_per_position == pytest.approx(sc.acceptance_rate_per_position)
        assert res.draft_acceptance_rate == pytest.approx(sc.draft_acceptance_rate)
    assert drafter.fc.weight.dtype == torch.float32  # the training weights untouched


def test_a_served_copy_shares_the_target_head_and_leaves_the_original(demo_hf_config):
    from dflash_core.models.dflash.drafter import DFlashDrafter, build_drafter_config

    d = DFlashDrafter(build_drafter_config(demo_hf_config, num_layers=1,
                                           target_layer_ids=DEMO_LAYERS, block_size=4,
                                           mask_token_id=0))
    emb = torch.nn.Embedding(demo_hf_config.vocab_size, demo_hf_config.hidden_size)
    head = torch.nn.Linear(demo_hf_config.hidden_size, demo_hf_config.vocab_size, bias=False)
    d.attach_target_head(emb, head)
    c = served_copy(d, "bfloat16")
    assert c.embed_tokens is emb and c.lm_head is head
    assert all(p.dtype == torch.bfloat16 for p in c.parameters())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in d.parameters())
    assert torch.equal(c.fc.weight, d.fc.weight.to(torch.bfloat16))
