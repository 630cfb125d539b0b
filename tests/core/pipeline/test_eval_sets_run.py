"""A run with named prompt sets (eval.prompt_sets): after the held-out measures each evaluation
publishes one EvalResult per set (exact tau and its histogram; the teacher-forced measures not
taken), the held-out result is the one a run without sets publishes, checkpoints/best follows
eval.best_set, and a set that cannot be evaluated is refused at preflight naming its key."""

import json
import time
from pathlib import Path

import pytest

from dflash_core import demo
from dflash_core.config import config_from_dict
from dflash_core.observe.events import Checkpoint, Error, EvalResult, LoadProgress, RunEnded
from dflash_core.checkpoint.folders import read_best
from dflash_core.pipeline.engine import Engine

TEXTS = ["The value of an expression is ", "Built-in functions and the return ",
         "If the object is a class, the ", "A sequence of statements that "]


def write_sets(root: Path) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    chat, plain = root / "chat.jsonl", root / "plain.jsonl"
    chat.write_text("".join(json.dumps({"id": f"c{k}", "messages": [
        {"role": "user", "content": t}]}) + "\n" for k, t in enumerate(TEXTS)))
    plain.write_text("".join(json.dumps({"prompt": t[::-1]}) + "\n" for t in TEXTS))
    return {"chat": chat, "plain": plain}


def run(tmp: Path, name: str, sets: list[dict], **eval_keys) -> list:
    """The demo for 4 steps, evaluated at steps 2 and 4 (2 held-out prompts, 8 new tokens)."""
    d = demo.demo_config(output_dir=str(tmp / "runs"), name=name, device="cpu").to_dict()
    d["run"].update(max_steps=4, log_every_s=60.0)
    d["data"].update(eval_prompts=2)
    d["checkpoint"].update(every=0, keep=1)
    d["eval"].update(every=2, max_new_tokens=8, prompt_sets=sets, **eval_keys)
    engine = Engine(config_from_dict(d))
    events: list = []
    engine.bus.tap(events.append)
    try:
        with demo.torch_threads(1):
            engine.start()
            deadline = time.monotonic() + 120
            while not any(isinstance(e, RunEnded) for e in events):
                assert time.monotonic() < deadline, "the run did not end in 120 s"
                time.sleep(0.05)
            assert engine.join(10)
    finally:  # a failed wait leaves no run going under the next tests
        engine.shutdown(timeout=10)
    return events


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data):
    """The same run without sets, and with two (3 prompts of chat, all 4 of plain)."""
    tmp = tmp_path_factory.mktemp("sets-run")
    files = write_sets(tmp / "sets")
    sets = [{"name": "chat", "path": str(files["chat"]), "prompts": 3},
            {"name": "plain", "path": str(files["plain"]), "prompts": 0, "max_new_tokens": 12}]
    return (run(tmp, "without", []),
            run(tmp, "with", sets, best_set="plain"))


def evals(events) -> list[EvalResult]:
    return [e for e in events if isinstance(e, EvalResult)]


def test_each_evaluation_publishes_one_result_per_set_after_the_held_out_one(runs):
    _, with_sets = runs
    assert [e for e in with_sets if isinstance(e, RunEnded)][-1].status == "finished"
    got = [(e.step, e.prompt_set) for e in evals(with_sets)]
    assert got == [(2, ""), (2, "chat"), (2, "plain"), (4, ""), (4, "chat"), (4, "plain")]
    for e in evals(with_sets):
        if not e.prompt_set:
            continue
        assert e.prompts == {"chat": 3, "plain": 4}[e.prompt_set]
        rounds = sum(e.acceptance)
        assert rounds >= e.prompts  # at least a round per prompt
        # tau is the histogram's: (accepted + 1) per round, pooled
        assert e.tau == pytest.approx(sum((k + 1) * n for k, n in enumerate(e.acceptance))
                                      / rounds)
        assert 1.0 <= e.tau <= len(e.acceptance)
        assert len(e.acceptance) == 8  # the demo drafter's block: 7 drafts + none accepted
        assert e.seconds > 0 and e.findings == [] and e.calibration == {}
        assert (e.tau_tf_target, e.tau_tf_heldout, e.tau_tf_train, e.agreement) == (
            -1.0, -1.0, -1.0, -1.0)


def test_the_held_out_results_are_those_of_a_run_without_sets(runs):
    without, with_sets = runs
    ours = [e for e in evals(with_sets) if not e.prompt_set]
    theirs = evals(without)
    assert [e.prompt_set for e in theirs] == ["", ""]

    def measures(e):
        return (e.step, e.tau, e.acceptance, e.prompts, e.tau_tf_target, e.tau_tf_heldout,
                e.agreement, e.findings)
    assert [measures(e) for e in ours] == [measures(e) for e in theirs]


def test_checkpoints_best_follows_the_set_eval_best_set_names(runs):
    _, with_sets = runs
    plain = {e.step: e.tau for e in evals(with_sets) if e.prompt_set == "plain"}
    best = [c for c in with_sets if isinstance(c, Checkpoint) and c.reason == "best"]
    assert best, "no checkpoints/best was marked"
    for c in best:
        assert c.tau == plain[c.step] and c.prompt_set == "plain"
    marker = read_best(Path(best[-1].path).parent.parent)
    assert marker["prompt_set"] == "plain" and marker["step"] == best[-1].step


@pytest.mark.parametrize("case, key, says", [
    ("missing", "eval.prompt_sets[0].path", "cannot read"),
    ("empty", "eval.prompt_sets[0].path", "holds no prompts"),
    ("thinking", "eval.prompt_sets[0].thinking", "has no thinking switch"),
    ("long", "eval.prompt_sets[0].max_new_tokens", "pass the target's"),
])
def test_a_set_that_cannot_be_evaluated_is_refused_at_preflight(tmp_path, demo_data, case, key,
                                                                   says):
    files = write_sets(tmp_path / "sets")
    empty = tmp_path / "sets" / "empty.jsonl"
    empty.write_text("\n")
    item = {"missing": {"path": str(tmp_path / "none.jsonl")},
            "empty": {"path": str(empty)},
            "thinking": {"path": str(files["chat"]), "thinking": "off"},
            "long": {"path": str(files["chat"]), "max_new_tokens": 100_000}}[case]
    events = run(tmp_path, case, [{"name": "s", **item}])
    assert [e for e in events if isinstance(e, RunEnded)][-1].status == "failed"
    (err,) = [e for e in events if isinstance(e, Error) and e.fatal]
    assert err.error_kind == "config" and err.message.startswith(f"ConfigError: {key}: ")
    assert says in err.message and "\n" not in err.message and err.hint
    assert not [e for e in events if isinstance(e, LoadProgress) and e.worker.startswith(
        "target")]  # refused before the target's weights load
