"""Prompt files, the chat template's thinking switch, and drafters checked against the target:
each bad input is one line naming the cause."""

import json

import pytest

from dflash_core.eval.drafters import TargetShape, check_against, read_drafter
from dflash_core.eval.errors import EvalInputError
from dflash_core.eval.prompt_sets import load_prompt_set, parse_spec
from dflash_core.eval.rendering import (
    has_switch, load_chat_tokenizer, render_set, stop_ids, template_kwargs, tokenizer_spec,
)
from tests.core.eval.conftest import THINK_TEMPLATE, save_dflash, save_dspark, write_jsonl


def test_the_three_row_shapes_and_the_first_turn(tmp_path):
    f = write_jsonl(tmp_path / "s.jsonl", [
        {"id": "q1", "messages": [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "One?"},
                                  {"role": "assistant", "content": "1"},
                                  {"role": "user", "content": "Two?"}]},
        {"prompt": "Hello"},
        {"turns": ["First", "Second"]},
    ])
    (f.parent / "s.jsonl").write_text(f.read_text() + "\n\n")  # blank lines are skipped
    s = load_prompt_set("s", f)
    assert [p.id for p in s.prompts] == ["q1", "line 2", "line 3"]
    assert [m["content"] for m in s.prompts[0].messages] == ["Be brief.", "One?"]
    assert s.prompts[1].messages == ({"role": "user", "content": "Hello"},)
    assert s.prompts[2].messages == ({"role": "user", "content": "First"},)
    assert len(load_prompt_set("s", f, limit=2).prompts) == 2
    assert parse_spec("gsm8k=data/g.jsonl")[0] == "gsm8k"
    assert parse_spec("data/mt.jsonl")[0] == "mt"


@pytest.mark.parametrize("text, says", [
    ("\n\n", "holds no prompts"),
    ('{"prompt": "x"}\nnot json\n', ":2: not JSON"),
    ('{"question": "x"}\n', ':1: no "messages", "prompt" or "turns" (keys: question)'),
    ('{"messages": [{"role": "assistant", "content": "x"}]}\n', "no user turn"),
])
def test_a_bad_prompt_file_is_one_line_naming_it(tmp_path, text, says):
    f = tmp_path / "bad.jsonl"
    f.write_text(text)
    with pytest.raises(EvalInputError) as exc:
        load_prompt_set("bad", f)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_a_missing_prompt_file(tmp_path):
    with pytest.raises(EvalInputError, match="cannot read"):
        load_prompt_set("x", tmp_path / "none.jsonl")


@pytest.fixture(scope="module")
def think_tok(tmp_path_factory):
    from tests.core.data.chat_fixtures import train_bpe

    return load_chat_tokenizer(str(train_bpe(tmp_path_factory.mktemp("tok"), THINK_TEMPLATE)))


def test_thinking_on_and_off_set_the_templates_switch(think_tok, tmp_path):
    s = load_prompt_set("s", write_jsonl(tmp_path / "s.jsonl", [{"prompt": "What is two?"}]))
    assert has_switch(think_tok)
    off = render_set(think_tok, s, template_kwargs(think_tok, "off")).ids[0]
    on = render_set(think_tok, s, template_kwargs(think_tok, "on")).ids[0]
    default = render_set(think_tok, s, template_kwargs(think_tok, None)).ids[0]
    assert on == default and off != on
    assert think_tok.decode(off).endswith("<think>\n\n</think>\n\n")
    assert think_tok.convert_tokens_to_ids("<|im_end|>") in stop_ids(think_tok, {}, None)


@pytest.mark.parametrize("thinking", ["off", "on"])
def test_a_template_without_the_switch_is_refused(thinking):
    tok = load_chat_tokenizer("builtin:tiny")
    assert template_kwargs(tok, None) == {}
    with pytest.raises(EvalInputError) as exc:
        template_kwargs(tok, thinking, "the chat template of builtin:tiny")
    assert str(exc.value) == (f"--thinking {thinking}: the chat template of builtin:tiny has no "
                              "thinking switch (no enable_thinking variable)")
    assert "leave --thinking out" in exc.value.hint


def test_the_demo_target_renders_with_the_byte_tokenizer(demo_target, tmp_path):
    # its folder holds the byte tokenizer (a server's too): read from there
    assert tokenizer_spec(demo_target, None) == str(demo_target)
    assert tokenizer_spec(demo_target, "/x") == "/x"
    # one built before it did (recipe tiny-v1: no tokenizer beside the weights): the built-in
    import shutil

    old = shutil.copytree(demo_target, tmp_path / "old", ignore=shutil.ignore_patterns(
        "tokenizer*", "chat_template*"))
    assert tokenizer_spec(old, None) == "builtin:tiny"


DEMO = TargetShape(hidden_size=128, vocab_size=258, num_layers=4)


def test_drafters_of_this_target_pass_and_of_another_are_refused(tmp_path, demo_hf_config):
    ours = read_drafter(str(save_dflash(tmp_path / "ok", demo_hf_config, 0)))
    check_against(ours, DEMO)
    check_against(read_drafter(str(save_dspark(tmp_path / "dsp", demo_hf_config, 0))), DEMO)
    for shape, says in (
            (TargetShape(64, 258, 4), "hidden size 128 (the target's 64)"),
            (TargetShape(128, 400, 4), "vocabulary 258 (the target's 400)"),
            (TargetShape(128, 258, 36), "4 target layers (this one has 36)")):
        with pytest.raises(EvalInputError) as exc:
            check_against(ours, shape)
        assert str(exc.value) == f"--drafter {ours.given} was trained for another target: {says}"


def test_a_published_dflash_folder_is_read(tmp_path, demo_hf_config):
    """The public reference's folders keep block_size (and the rest) at the top level."""
    folder = save_dflash(tmp_path / "pub", demo_hf_config, 0, block=6)
    d = json.loads((folder / "config.json").read_text())
    dc = d.pop("dflash_config")
    d.update(block_size=dc["block_size"],
             dflash_config={"mask_token_id": dc["mask_token_id"],
                            "target_layer_ids": dc["target_layer_ids"]},
             auto_map={"AutoModel": "dflash.DFlashDraftModel"})
    (folder / "config.json").write_text(json.dumps(d))
    spec = read_drafter(str(folder))
    assert (spec.objective, spec.block_size, spec.target_layer_ids) == ("dflash", 6, [1, 2, 3])
    d["layer_types"] = ["sliding_attention"]
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(EvalInputError, match="sliding_attention"):
        read_drafter(str(folder))


def test_a_run_folder_means_its_newest_checkpoint_and_a_stranger_is_refused(tmp_path,
                                                                             demo_hf_config):
    for step in (3, 12):
        save_dflash(tmp_path / "run" / "checkpoints" / f"step-{step}", demo_hf_config, step)
        (tmp_path / "run" / "checkpoints" / f"step-{step}" / "training_state.json").write_text(
            "{}")
    spec = read_drafter(str(tmp_path / "run"))
    assert spec.path.name == "step-12" and spec.label == "run/step-12"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "other" / "model.safetensors").write_bytes(b"")
    with pytest.raises(EvalInputError, match="none of DFlashDraftModel, Qwen3DSparkModel, DFlash2DraftModel"):
        read_drafter(str(tmp_path / "other"))
    with pytest.raises(EvalInputError, match="no such folder"):
        read_drafter(str(tmp_path / "none"))
