"""The run's prompt sets (run_sets.py) are the eval verb's: the same file renders to the same
token ids with the target's chat template, and a drafter's exact tau on them is the eval verb's
tau (the same prompts, the same new-token limit and end of turn, the same decoding code) at any
eval.set_batch, with and without the cache."""

import pytest

from dflash_core.eval import EvalOptions, Evaluation
from dflash_core.eval.run_sets import evaluate_set, prepare_sets
from dflash_core.config import ConfigError, config_from_dict
from dflash_core.eval.evaluate import evaluation_attention
from tests.core.eval.conftest import DEMO_LAYERS, THINK_TEMPLATE, chat_target, write_jsonl

# The demo's assets, built by the session's fixture (a fresh cache builds them beside other tests).
pytestmark = pytest.mark.usefixtures("demo_target")

NEW = 20


def eval_config(*sets, **keys):
    return config_from_dict({"eval": {"prompt_sets": list(sets), **keys}}).eval


@pytest.fixture(scope="module")
def verb(demo_eval, tmp_path_factory, module_thread):
    """The eval verb on the chat set's first 3 prompts with the first drafter."""
    out = tmp_path_factory.mktemp("verb")
    opts = EvalOptions(target=str(demo_eval["target"]), drafters=[str(demo_eval["drafters"][0])],
                       prompts=[f"chat={demo_eval['sets']['chat']}"], max_new_tokens=NEW,
                       batch=2, limit=3, out=str(out), device="cpu")
    ev = Evaluation(opts, lambda m: None)
    return ev, ev.run()


def test_a_set_renders_to_the_eval_verbs_token_ids(verb, demo_eval):
    ev, _ = verb
    cfg = eval_config({"name": "chat", "path": str(demo_eval["sets"]["chat"]), "prompts": 3,
                       "max_new_tokens": NEW})
    (s,) = prepare_sets(cfg, demo_eval["target"], "builtin:tiny")
    assert s.name == "chat" and s.max_new_tokens == NEW
    assert s.prompt_ids == ev.rendered["chat"].ids and len(s.prompt_ids) == 3
    assert s.stop_ids == ev.stop and s.stop_ids  # the target's end of turn


@pytest.mark.parametrize("batch, cache", [(1, False), (3, False), (2, True)])
def test_the_runs_tau_on_a_set_is_the_eval_verbs(verb, demo_eval, batch, cache):
    ev, rep = verb
    (s,) = prepare_sets(eval_config({"name": "chat", "path": str(demo_eval["sets"]["chat"]),
                                     "prompts": 3, "max_new_tokens": NEW}),
                        demo_eval["target"], "builtin:tiny")
    drafter = ev.decoders[1].drafter
    with evaluation_attention(drafter):
        res = evaluate_set(s, 7, ev.target, drafter, DEMO_LAYERS, batch=batch, cache=cache)
    got = rep.sets[0].drafters[ev.decoders[1].label]
    assert (res.step, res.prompt_set, res.prompts) == (7, "chat", 3)
    assert res.tau == pytest.approx(got.tau) and sum(res.acceptance) == got.rounds
    assert res.acceptance == got.acceptance[:len(res.acceptance)]


def test_eval_max_new_tokens_stands_for_a_sets_zero(demo_eval):
    cfg = eval_config({"name": "p", "path": str(demo_eval["sets"]["plain"]), "prompts": 0},
                      max_new_tokens=24)
    (s,) = prepare_sets(cfg, demo_eval["target"], "builtin:tiny")
    assert s.max_new_tokens == 24 and len(s.prompt_ids) == 5  # prompts 0: the whole file
    assert prepare_sets(eval_config(), demo_eval["target"], "builtin:tiny") == []


def test_thinking_off_renders_the_templates_switch(tmp_path):
    """A template with the switch: off renders the empty reasoning block, as eval --thinking."""
    target = chat_target(tmp_path / "qwen", THINK_TEMPLATE)
    f = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "What is two?"}])
    on, off, default = (prepare_sets(eval_config({"name": "s", "path": str(f),
                                                  "thinking": t}), target, str(target))[0]
                        for t in ("on", "off", "template"))
    assert off.prompt_ids != on.prompt_ids and on.prompt_ids == default.prompt_ids


def test_a_target_without_a_tokenizer_is_refused_naming_the_key(tmp_path, demo_eval):
    from tests.core.engine_fixtures import make_target

    target = make_target(tmp_path / "bare")
    with pytest.raises(ConfigError) as exc:
        prepare_sets(eval_config({"name": "c", "path": str(demo_eval["sets"]["chat"])}),
                     target, str(target))
    assert exc.value.key == "eval.prompt_sets" and "tokenizer" in str(exc.value)
    assert "leave eval.prompt_sets empty" in exc.value.hint


def test_a_bad_line_names_the_file_and_line(tmp_path, demo_eval):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "x"}\n{"question": "y"}\n')
    with pytest.raises(ConfigError) as exc:
        prepare_sets(eval_config({"name": "b", "path": str(f)}), demo_eval["target"], "t")
    assert exc.value.key == "eval.prompt_sets[0].path"
    assert f"{f}:2: no \"messages\", \"prompt\" or \"turns\" (keys: question)" in str(exc.value)
