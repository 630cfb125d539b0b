"""Speculative decoding through a target group (2 ranks, gloo, fp32): tau, the drafts and the
output equal one process's decoding of the same weights, with full forwards and with the cache
kept in the ranks, on a dense, a mixture-of-experts, a DeepSeek-V3 and a hybrid (Gated DeltaNet)
target; greedy output is the group's own plain decoding (lossless); the evaluation's other
forwards agree too; verify requests are served while the ranks' batch streams run; a rank that
dies while the engine waits on it is named."""

import os
import signal

import pytest
import torch

from dflash_core.eval import spec_decode
from dflash_core.eval.drafters import load_weights, read_drafter
from dflash_core.eval.evaluate import evaluate_tau, plain_greedy
from dflash_core.eval.spec_decode import DecodeSettings, decode_rows
from dflash_core.eval.target_decoding import head_is_lm_head, rows_backend, target_fn_for
from dflash_core.models.agreement import label_agreement
from dflash_core.models.target.load import load_target
from dflash_core.target_group.group import GroupRankFailed, TargetHeads
from dflash_core.target_group.remote import GroupTarget
from dflash_core.target_group.session import GroupSession
from dflash_core.target_group.split import GroupSplit

from ..eval.conftest import save_dflash
from ..eval.test_spec_decode import _truth, oracle
from ..models.target.target_classes import LAYERS, VOCAB, build
from .group_harness import reply, start_group

TOL = 1e-5
NEW = 20
LAYER_IDS = [1, 2]
PROMPTS = [[5, 17, 3, 9], [1], list(range(10, 40))]
CPU = torch.device("cpu")


def _dense(folder):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=LAYERS, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
                     ).save_pretrained(folder)


slow = pytest.mark.slow
# One case in the fast suite; the rest with the slow trainings (`make test-slow`).
CASES = [pytest.param(("qwen3", "sharded"), id="qwen3-sharded"),
         pytest.param(("qwen3", "shared"), marks=slow, id="qwen3-shared"),
         pytest.param(("qwen3_moe", "sharded"), marks=slow, id="qwen3_moe-sharded"),
         pytest.param(("deepseek_v3", "shared"), marks=slow, id="deepseek_v3-shared"),
         pytest.param(("deepseek_v3", "sharded"), marks=slow, id="deepseek_v3-sharded"),
         # recurrent layers: the cache is taken back and fed again in the ranks
         pytest.param(("qwen3_5_moe_text", "sharded"), marks=slow, id="qwen3_5_moe-sharded")]


@pytest.fixture(scope="module", params=CASES)
def grouped(request, tmp_path_factory):
    """(one process's target, the group's GroupTarget, a DFlash drafter of it, the truth)."""
    name, mode = request.param
    root = tmp_path_factory.mktemp(f"{name}-{mode}")
    folder = root / "target"
    _dense(folder) if name == "qwen3" else build(name).save_pretrained(folder)
    one = load_target(folder, dtype="float32")
    spec = read_drafter(str(save_dflash(root / "drafter", one.model.config, 0, LAYER_IDS,
                                        block=5, mask=VOCAB - 1)))
    drafter = load_weights(spec, one, "cpu")
    drafter.attn_impl = "chunked"
    session = GroupSession(folder, [CPU] * 2, GroupSplit(2, mode, True), dtype="float32",
                           attn_implementation="sdpa", layer_ids=LAYER_IDS,
                           trust_remote_code=False, folder=root / "run", say=lambda m: None)
    try:
        group = session.open(CPU)
        yield one, group, drafter, _truth(one, LAYER_IDS, PROMPTS, NEW)
    finally:
        session.close()
    assert all(p.exitcode == 0 for p in session.group.procs)


@pytest.mark.parametrize("cache", [False, True], ids=["full", "cache"])
def test_decoding_through_the_group_is_one_process_s_and_lossless(grouped, cache, monkeypatch):
    one, group, drafter, truth = grouped
    # drafts of the true continuation with one slot spoiled: rounds keep part of a block, so
    # every rewind (and the hybrid's re-feed) runs in the ranks
    monkeypatch.setattr(spec_decode, "propose", oracle(truth))
    here = decode_rows(rows_backend(one, LAYER_IDS, cache), drafter, PROMPTS,
                       DecodeSettings(NEW))
    monkeypatch.setattr(spec_decode, "propose", oracle(truth))
    there = decode_rows(rows_backend(group, LAYER_IDS, cache), drafter, PROMPTS,
                        DecodeSettings(NEW))
    assert [r.tokens for r in there] == [r.tokens for r in here]
    assert [r.acceptance for r in there] == [r.acceptance for r in here]
    assert [r.drafts for r in there] == [r.drafts for r in here]
    assert any(0 < a < max(r.proposed) for r in there for a in r.acceptance)
    # lossless against the group's own plain decoding, through the same backend
    plain = decode_rows(rows_backend(group, LAYER_IDS, cache), None, PROMPTS,
                        DecodeSettings(NEW))
    assert [r.tokens for r in there] == [r.tokens for r in plain]
    fn = target_fn_for(group, LAYER_IDS)
    assert [r.tokens for r in plain] == [plain_greedy(fn, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("cache", [False, True], ids=["full", "cache"])
def test_the_held_out_tau_through_the_group_is_one_process_s(grouped, cache, monkeypatch):
    """evaluate.evaluate_tau (the run's held-out measure: each prompt a batch of one, the
    drafter's own proposals) through the group's one-prompt decodings."""
    one, group, drafter, _ = grouped
    want = evaluate_tau(target_fn_for(one, LAYER_IDS, cache=cache), drafter, PROMPTS, NEW,
                        LAYER_IDS)
    got = evaluate_tau(target_fn_for(group, LAYER_IDS, cache=cache), drafter, PROMPTS, NEW,
                       LAYER_IDS)
    assert got.tau == pytest.approx(want.tau, abs=1e-9) and got.acceptance == want.acceptance
    assert got.outputs == want.outputs


def test_the_evaluation_s_other_forwards_agree(grouped):
    one, group, _, _ = grouped
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    valid = mask.bool()
    for last in (False, True):
        want = one.features(ids, mask, LAYER_IDS, with_last_hidden=last)
        got = group.features(ids, mask, LAYER_IDS, with_last_hidden=last)
        assert float((got[valid] - want[valid]).abs().max()) < TOL
    lw, fw = one.logits_and_features(ids[:1], LAYER_IDS)
    lg, fg = group.logits_and_features(ids[:1], LAYER_IDS)
    assert float((lg - lw).abs().max()) < TOL and float((fg - fw).abs().max()) < TOL
    assert head_is_lm_head(group, PROMPTS[2], [0]) == head_is_lm_head(one, PROMPTS[2], [0])
    # labels the target's own greedy text, every third spoiled: agreement near 2/3
    fn = target_fn_for(one, [0])
    rows = [p + plain_greedy(fn, p, 20) for p in ([3, 1, 4, 1, 5], [9, 2, 6], [7] * 6)]
    for r in rows:
        for t in range(6, len(r), 3):
            r[t] = (r[t] + 1) % VOCAB
    masks = [[0] * 3 + [1] * (len(r) - 3) for r in rows]
    want = label_agreement(one, rows, masks, seed=1)
    assert 0 < want[0] < want[1]
    assert label_agreement(group, rows, masks, seed=1) == want
    hs = group.model(input_ids=ids[:1], output_hidden_states=True, use_cache=False)
    with torch.no_grad():
        ref = one.model(input_ids=ids[:1], output_hidden_states=True, use_cache=False)
    assert len(hs.hidden_states) == len(ref.hidden_states)
    assert max(float((a - b).abs().max()) for a, b in zip(hs.hidden_states,
                                                         ref.hidden_states)) < TOL


def _heads(group) -> TargetHeads:
    """Rank 0's embedding and lm_head (they come before its "loaded")."""
    from dflash_core.models.target.config import load_target_config

    msg = reply(group, 0, ("heads",))
    return TargetHeads(load_target_config(group.target_path), msg[2], msg[3])


def test_verify_is_served_while_the_batch_streams_run_and_a_dead_rank_is_named(tmp_path):
    """The run's evaluation asks the ranks while their streams are mid-way: first with both
    rings full of unacknowledged features and a batch waiting on each, then with rank 0 holding
    a batch and rank 1 waiting for one (in lockstep rank 0 waits for it). Each time the verify
    forward is answered and the streams then go on unchanged; a rank killed while the engine
    waits on a verify answer fails it naming the rank and its GPU."""
    folder = tmp_path / "target"
    _dense(folder)
    one = load_target(folder, dtype="float32")
    group = start_group(folder, "sharded", False, tmp_path / "run", layer_ids=LAYER_IDS)
    try:
        heads = _heads(group)
        for r in range(2):
            reply(group, r, ("loaded",))
        target = GroupTarget(group, heads, CPU)
        g = torch.Generator().manual_seed(1)
        sent = {r: [torch.randint(0, VOCAB, (2, 10 + 3 * s + r), generator=g) for s in range(4)]
                for r in range(2)}
        got = {0: [], 1: []}

        def batch(r: int, s: int) -> None:
            group.requests[r].put(("batch", s + 1, sent[r][s], torch.ones_like(sent[r][s])))

        def verify_now(prompt: list[int]) -> None:
            ids = torch.tensor([prompt])
            want_l, want_f = one.logits_and_features(ids, LAYER_IDS)
            logits, feats = target.forward_rows([prompt], [3], LAYER_IDS, exact_head=True)
            assert float((logits[0] - want_l[0, -3:]).abs().max()) < TOL
            assert float((feats[0] - want_f[0, -3:]).abs().max()) < TOL

        for r in range(2):  # three batches each, a ring of two: the third waits for an ack
            for s in range(3):
                batch(r, s)
        for r in range(2):
            got[r] += [reply(group, r, ("features",)) for _ in range(2)]
        verify_now(PROMPTS[2])
        for r in range(2):
            group.requests[r].put(("ack", 1))
        for r in range(2):
            got[r].append(reply(group, r, ("features",)))
            group.requests[r].put(("ack", 2))
        batch(0, 3)  # rank 0 a fourth batch, rank 1 none yet: rank 0 waits in step for it
        verify_now(PROMPTS[0])
        batch(1, 3)
        for r in range(2):
            got[r].append(reply(group, r, ("features",)))
            for s, (_, seq, f) in enumerate(got[r]):
                assert seq == s + 1
                want = one.features(sent[r][s], layer_ids=LAYER_IDS)
                assert float((f - want).abs().max()) < TOL
        os.kill(group.procs[1].pid, signal.SIGKILL)
        with pytest.raises(GroupRankFailed) as err:
            target.features(torch.tensor([PROMPTS[0]]), layer_ids=LAYER_IDS)
        assert "target group 0 rank 1 (cpu:0.1, pid" in str(err.value)
        assert "killed by SIGKILL" in str(err.value) and err.value.error_kind == "oom"
        assert err.value.hint
    finally:
        group.shutdown()
