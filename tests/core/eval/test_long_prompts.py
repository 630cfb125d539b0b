"""A long-prompt set (eval.prompt_sets[].long, eval's --long-prompts): a "messages" row whole, up
to its last user message, and the first half of the answer after it starting the response, so
decoding runs deep into the context; other rows as in any set. The eval verb records it in the
results' settings, the run's preflight renders it as the verb does."""

import json

import pytest

from dflash_core.config import config_from_dict
from dflash_core.eval import EvalOptions, Evaluation
from dflash_core.eval.prompt_sets import answer_start, load_prompt_set
from dflash_core.eval.rendering import load_chat_tokenizer, render_set
from dflash_core.eval.run_sets import prepare_sets
from tests.core.eval.conftest import write_jsonl

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "A sequence."},
        {"role": "user", "content": "And a tuple?"},
        {"role": "assistant", "content": "A sequence that cannot change once made."}]


@pytest.fixture
def sets(tmp_path):
    return write_jsonl(tmp_path / "long.jsonl", [
        {"id": "chat", "messages": CHAT},
        {"id": "open", "messages": CHAT[:4]},  # ends with a user turn: no answer to continue
        {"id": "doc", "prompt": "A document. " * 20}])


def test_an_answers_first_half_is_cut_back_to_a_space():
    assert answer_start("A sequence that cannot change once made.") == "A sequence that"
    assert answer_start("word") == "wo"  # no space in its first half: the half itself
    assert answer_start("") == ""


def test_a_long_set_takes_the_whole_conversation_and_the_answers_start(sets):
    short = load_prompt_set("s", sets)
    long = load_prompt_set("l", sets, long=True)
    assert long.long and not short.long and long.sha256 == short.sha256
    chat, open_, doc = long.prompts
    assert chat.messages == tuple(CHAT[:4]) and chat.answer_start == "A sequence that"
    assert open_.messages == tuple(CHAT[:4]) and open_.answer_start == ""
    assert doc.messages == short.prompts[2].messages and doc.answer_start == ""
    assert short.prompts[0].messages == tuple(CHAT[:2]) and short.prompts[0].answer_start == ""


def test_the_rendered_prompt_ends_with_the_answers_start(sets):
    tok = load_chat_tokenizer("builtin:tiny")
    long = render_set(tok, load_prompt_set("l", sets, long=True), {})
    text = tok.apply_chat_template(CHAT[:4], tokenize=False, add_generation_prompt=True)
    want = tok(text + "A sequence that", add_special_tokens=False)["input_ids"]
    assert list(long.ids[0]) == list(want)
    assert len(long.ids[0]) > len(render_set(tok, load_prompt_set("s", sets), {}).ids[0])


def test_the_verb_records_a_long_set_in_its_settings(sets, demo_target, demo_eval, tmp_path):
    opts = EvalOptions(target=str(demo_target), drafters=[str(demo_eval["drafters"][0])],
                       prompts=[f"short={sets}"], long_prompts=[f"long={sets}"],
                       out=str(tmp_path / "out"), device="cpu")
    ev = Evaluation(opts, lambda m: None)  # checked and files opened; nothing decoded
    assert [(p.name, p.long) for p in ev.sets] == [("short", False), ("long", True)]
    head = {n: json.loads((tmp_path / "out" / n / "plain.jsonl").read_text().splitlines()[0])
            for n in ("short", "long")}
    assert head["long"]["settings"]["long"] is True
    assert "long" not in head["short"]["settings"]  # older results files still continue
    assert ev.rendered["long"].ids[0] != ev.rendered["short"].ids[0]


def test_the_run_renders_a_long_set_as_the_verb_does(sets, demo_target):
    cfg = config_from_dict({"eval": {"prompt_sets": [
        {"name": "long", "path": str(sets), "long": True}]}}).eval
    (s,) = prepare_sets(cfg, demo_target, "builtin:tiny")
    tok = load_chat_tokenizer("builtin:tiny")
    assert s.prompt_ids == render_set(tok, load_prompt_set("l", sets, long=True), {}).ids
