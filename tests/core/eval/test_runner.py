"""An evaluation end to end on the demo target (two sets, two drafters): figures that agree
with the engine's exact tau, the lossless check, resumption, and the refusals."""

import json

import pytest

from dflash_core.eval import EvalInputError, EvalOptions, Evaluation, run_eval, spec_decode
from dflash_core.eval.results import open_results
from dflash_core.eval.evaluate import evaluate_tau, target_fn_for
from dflash_core.models.target.load import load_target
from tests.core.eval.conftest import DEMO_LAYERS, chat_target, save_dflash, save_dspark
from tests.core.eval.conftest import write_jsonl

NEW = 20


def _opts(demo_eval, out, **kw):
    base = dict(target=str(demo_eval["target"]), drafters=[str(d) for d in demo_eval["drafters"]],
                prompts=[f"{k}={v}" for k, v in demo_eval["sets"].items()], max_new_tokens=NEW,
                batch=2, out=str(out), device="cpu")
    return EvalOptions(**(base | kw))


def _tokens(out, set_name, file):
    lines = (out / set_name / file).read_text().splitlines()[1:]
    return {x["index"]: x["tokens"] for x in map(json.loads, lines) if x["kind"] == "prompt"}


@pytest.fixture(scope="module")
def measured(demo_eval, tmp_path_factory, module_thread):
    out = tmp_path_factory.mktemp("out")
    ev = Evaluation(_opts(demo_eval, out), lambda m: None)
    return ev, ev.run(), out


def test_two_sets_two_drafters_side_by_side(measured, demo_eval):
    ev, rep, out = measured
    assert [s.name for s in rep.sets] == ["chat", "plain"]
    assert rep.labels == ["d1", "d2"] and rep.per_round == {"d1": 3, "d2": 5}
    assert not rep.mismatches
    target = load_target(demo_eval["target"], dtype="float32")
    for s in rep.sets:
        assert s.plain.tau == 1.0 and s.plain.tokens == s.prompts * NEW
        for label, d in zip(rep.labels, ev.decoders[1:]):
            want = evaluate_tau(target_fn_for(target, DEMO_LAYERS), d.drafter,
                                [list(p) for p in ev.rendered[s.name].ids], NEW, DEMO_LAYERS)
            got = s.drafters[label]
            assert (got.tau, got.rounds, got.tokens) == (want.tau, want.rounds, want.tokens)
            assert got.acceptance[:len(want.acceptance)] == want.acceptance
            assert got.tokens_per_s > 0 and got.speedup > 0
            assert 0 <= got.accepted_at.get(1, 0) <= 1
    saved = json.loads((out / "results.json").read_text())
    assert set(saved["sets"]) == {"chat", "plain"}
    assert set(saved["sets"]["chat"]["drafters"]) == {"d1", "d2"}
    for name in ("chat", "plain"):
        assert {p.name for p in (out / name).iterdir()} == {
            "plain.jsonl", "drafter-d1.jsonl", "drafter-d2.jsonl"}


def test_interrupted_then_run_again_it_continues_to_the_same_results(measured, demo_eval,
                                                                     tmp_path):
    _, _, full = measured
    said = []

    def stop_after_first_batch(message):
        said.append(message)
        if "chat: 2/5 prompts" in message:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_eval(_opts(demo_eval, tmp_path), stop_after_first_batch)
    assert len(_tokens(tmp_path, "chat", "drafter-d2.jsonl")) == 2
    assert _tokens(tmp_path, "plain", "plain.jsonl") == {}  # its header only
    # a batch torn mid-write is decoded again
    with open(tmp_path / "chat" / "drafter-d2.jsonl", "a") as fh:
        fh.write('{"kind": "prompt", "index": 4, "tok')
    said.clear()
    rep = run_eval(_opts(demo_eval, tmp_path), said.append)
    assert any("chat: 1 of 3 batches measured before; continuing" in m for m in said)
    for name in ("chat", "plain"):
        for f in ("plain.jsonl", "drafter-d1.jsonl", "drafter-d2.jsonl"):
            assert _tokens(tmp_path, name, f) == _tokens(full, name, f)
    assert not rep.mismatches
    said.clear()
    run_eval(_opts(demo_eval, tmp_path), said.append)  # nothing left: nothing decoded
    assert any("chat: all 5 prompts measured before" in m for m in said)


def test_other_settings_are_not_mixed_into_a_results_file(measured, demo_eval, tmp_path):
    _, _, out = measured
    extra = tmp_path / "extra.jsonl"
    extra.write_text('{"prompt": "The"}\n')
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(EvalInputError) as exc:  # a new set too: nothing of it is started
        Evaluation(_opts(demo_eval, out, max_new_tokens=NEW + 1,
                         prompts=[f"new={extra}", f"chat={demo_eval['sets']['chat']}"]),
                   lambda m: None)
    assert "holds results of other settings (max_new_tokens 20 -> 21)" in str(exc.value)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    with pytest.raises(EvalInputError, match="temperature 0.0 -> 0.5"):
        Evaluation(_opts(demo_eval, out, temperature=0.5), lambda m: None)


def test_the_lossless_check_names_the_prompt_and_the_first_differing_position(
        demo_eval, tmp_path, monkeypatch):
    honest = spec_decode.greedy_accept
    # the second drafter's acceptance takes one draft more than the target agreed with
    monkeypatch.setattr(spec_decode, "greedy_accept",
                        lambda d, p: min(len(d), honest(d, p) + 1) if len(d) == 5 else
                        honest(d, p))
    rep = run_eval(_opts(demo_eval, tmp_path), lambda m: None)
    bad = rep.mismatches
    assert bad and {label for _, label, _ in bad} == {"d2"}
    plain, broken = (_tokens(tmp_path, "chat", f) for f in ("plain.jsonl", "drafter-d2.jsonl"))
    for name, _, m in bad:
        if name != "chat":
            continue
        i = m["index"]
        at = next(j for j, (a, b) in enumerate(zip(plain[i], broken[i])) if a != b)
        assert m["position"] == at and m["id"] == f"c{i}"
        assert (m["plain"], m["speculative"]) == (plain[i][at], broken[i][at])
        assert m["target_gap"] >= 0


def test_sampled_runs_with_one_seed_are_equal(demo_eval, tmp_path):
    def sampled(out, seed):
        return run_eval(_opts(demo_eval, out, temperature=0.7, seed=seed, limit=3,
                              drafters=[str(demo_eval["drafters"][0])],
                              prompts=[f"chat={demo_eval['sets']['chat']}"]), lambda m: None)

    a, b = sampled(tmp_path / "a", 3), sampled(tmp_path / "b", 3)
    for f in ("plain.jsonl", "drafter-d1.jsonl"):
        assert _tokens(tmp_path / "a", "chat", f) == _tokens(tmp_path / "b", "chat", f)
    assert a.sets[0].drafters["d1"].tau == b.sets[0].drafters["d1"].tau
    assert not a.mismatches  # sampled: no token-level check
    sampled(tmp_path / "c", 4)
    assert _tokens(tmp_path / "c", "chat", "plain.jsonl") != _tokens(tmp_path / "a", "chat",
                                                                      "plain.jsonl")


@pytest.mark.parametrize("case, says", [
    ("empty set", "prompt set chat: {f} holds no prompts"),
    ("thinking off", "--thinking off: the chat template of {t} has no thinking switch"),
    ("other target", "--drafter {d} was trained for another target: hidden size 64 (the "
                     "target's 128); vocabulary"),
    ("too long", "prompt set chat, prompt c0: 1100 tokens and 20 new ones pass the target's "
                 "1024 positions"),
])
def test_bad_input_is_refused_before_the_target_loads(demo_eval, tmp_path, monkeypatch, case,
                                                      says):
    import dflash_core.models.target.load as target_module

    monkeypatch.setattr(target_module, "load_target",
                        lambda *a, **k: pytest.fail("the target was loaded"))
    opts = _opts(demo_eval, tmp_path / "out")
    fmt = {"t": opts.target, "f": tmp_path / "empty.jsonl", "d": tmp_path / "d64"}
    if case == "empty set":
        (tmp_path / "empty.jsonl").write_text("\n")
        opts.prompts = [f"chat={tmp_path / 'empty.jsonl'}"]
    elif case == "thinking off":
        opts.thinking = "off"
    elif case == "other target":
        chat = chat_target(tmp_path / "chat")
        from transformers import AutoConfig

        save_dflash(tmp_path / "d64", AutoConfig.from_pretrained(chat), 0, [0, 2])
        opts.drafters = [str(tmp_path / "d64")]
    else:
        write_jsonl(tmp_path / "long.jsonl", [{"id": "c0", "prompt": "x" * 1100}])
        opts.prompts = [f"chat={tmp_path / 'long.jsonl'}"]
    with pytest.raises(EvalInputError) as exc:
        Evaluation(opts, lambda m: None).run()
    assert str(exc.value).startswith(says.format(**fmt)), str(exc.value)
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("hybrid", [False, True], ids=["qwen3", "qwen3_5-hybrid"])
def test_a_chat_target_with_its_thinking_switch_dflash_and_dspark(tmp_path, hybrid):
    """A tiny Qwen3 (or Qwen3.5, Gated DeltaNet layers) with a ChatML template that reads
    enable_thinking: two sets, a DFlash and a DSpark drafter, thinking off; batched and cached
    decoding (the cache restored on a hybrid target) both lossless."""
    from transformers import AutoConfig

    folder = chat_target(tmp_path / "target", hybrid=hybrid)
    cfg = AutoConfig.from_pretrained(folder)
    mask = cfg.vocab_size - 1
    ds = [save_dflash(tmp_path / "dflash", cfg, 0, [0, 2], block=4, mask=mask),
          save_dspark(tmp_path / "dspark", cfg, 0, [0, 2], block=3, mask=mask)]
    sets = [write_jsonl(tmp_path / "a.jsonl", [{"prompt": "What is two plus two?"},
                                               {"prompt": "Hello!"}]),
            write_jsonl(tmp_path / "b.jsonl", [{"messages": [
                {"role": "user", "content": "Tell me about the weather in Paris."}]}])]
    for cache in (False, True):
        rep = run_eval(EvalOptions(str(folder), [str(d) for d in ds],
                                   [f"a={sets[0]}", f"b={sets[1]}"], thinking="off",
                                   max_new_tokens=12, batch=2, cache=cache,
                                   out=str(tmp_path / f"out-{cache}"), device="cpu"),
                       lambda m: None)
        assert not rep.mismatches
        assert rep.per_round == {"dflash": 3, "dspark": 3}
        assert all(s.drafters[x].rounds > 0 for s in rep.sets for x in rep.labels)
    header = json.loads((tmp_path / "out-True" / "a" / "plain.jsonl").read_text()
                        .splitlines()[0])
    assert header["settings"]["thinking"] == "off" and header["settings"]["cache"] is True


def test_a_results_file_of_something_else_is_refused(tmp_path):
    (tmp_path / "x.jsonl").write_text("hello\n")
    with pytest.raises(EvalInputError, match="not a results file"):
        open_results(tmp_path / "x.jsonl", {})


def test_a_header_without_results_is_started_again_under_new_settings(tmp_path):
    """A run refused after its files were opened leaves headers only; the drafter repaired (its
    fingerprint changed), the same command goes on: nothing in such a file would be lost. One
    with a measured batch is still refused, and a file not ours is never replaced."""
    from dflash_core.eval.results import Batch, check_header

    path = tmp_path / "x.jsonl"
    open_results(path, {"fingerprint": "a"})
    with open(path, "a") as fh:  # a batch torn before its closing line: no results either
        fh.write('{"kind": "prompt", "index": 0, "tokens": [1]}\n')
    check_header(path, {"fingerprint": "b"})
    f = open_results(path, {"fingerprint": "b"})
    assert json.loads(path.read_text().splitlines()[0])["settings"] == {"fingerprint": "b"}
    assert len(path.read_text().splitlines()) == 1 and not f.prompts
    f.append([{"kind": "prompt", "index": 0, "tokens": [1, 2]}], Batch(0, [0], 0.1, 0.0))
    with pytest.raises(EvalInputError, match="holds results of other settings"):
        open_results(path, {"fingerprint": "c"})
    (tmp_path / "y.jsonl").write_text('{"kind": "note"}\n')
    with pytest.raises(EvalInputError, match="not a results file"):
        open_results(tmp_path / "y.jsonl", {})


def test_a_batch_is_held_as_it_reads_back(tmp_path):
    """The times are written rounded: a table made as the batch ends and one made from the file
    later must agree to the last digit (tokens/s sat on a rounding edge once: 407.8 vs 407.9)."""
    from dflash_core.eval.results import Batch
    path = tmp_path / "x.jsonl"
    f = open_results(path, {"a": 1})
    f.append([{"kind": "prompt", "index": 0, "tokens": [1, 2]}],
             Batch(0, [0], seconds=0.123456789012, prefill_seconds=0.0000004999))
    again = open_results(path, {"a": 1})
    assert again.batches == f.batches
    assert f.batches[0].seconds == 0.123457 and f.batches[0].prefill_seconds == 0.0
