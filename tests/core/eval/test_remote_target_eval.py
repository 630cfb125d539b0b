"""`dflash-tui eval` on a target that exists only as its folder's own Python files (auto_map, as
Kimi-K2's): refused in one line naming --trust-remote-code before anything loads, and decoded
losslessly with it."""

from __future__ import annotations

import pytest

from dflash_core.eval import EvalInputError, EvalOptions, Evaluation, run_eval
from tests.core.eval.conftest import chat_target, save_dflash, write_jsonl
from tests.core.models.target.test_target_classes import made_remote


@pytest.fixture
def remote_chat(tmp_path, hf_modules_cache):
    """A tiny chat target (its tokenizer and template) made remote-code, and a drafter of it."""
    from transformers import AutoConfig

    folder = chat_target(tmp_path / "target")
    hf = AutoConfig.from_pretrained(folder)
    drafter = save_dflash(tmp_path / "drafter", hf, 0, [0, 2], block=4, mask=hf.vocab_size - 1)
    made_remote(folder)
    prompts = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "What is two plus two?"},
                                                 {"prompt": "Hello!"}])
    return folder, drafter, prompts


def _opts(remote_chat, out, **kw) -> EvalOptions:
    folder, drafter, prompts = remote_chat
    return EvalOptions(str(folder), [str(drafter)], [f"a={prompts}"], max_new_tokens=8,
                       batch=2, out=str(out), device="cpu", **kw)


def test_refused_without_the_flag_before_anything_loads(remote_chat, tmp_path):
    with pytest.raises(EvalInputError) as exc:
        Evaluation(_opts(remote_chat, tmp_path / "out"), lambda m: None).load()
    assert "needs its own code" in str(exc.value)
    assert str(exc.value).endswith("--trust-remote-code is not given")
    assert "--trust-remote-code" in exc.value.hint
    assert not (tmp_path / "out").exists()


def test_trusted_it_decodes_losslessly(remote_chat, tmp_path):
    rep = run_eval(_opts(remote_chat, tmp_path / "out", trust_remote_code=True), lambda m: None)
    assert not rep.mismatches
    (s,) = rep.sets
    assert s.prompts == 2 and s.drafters["drafter"].rounds > 0


def test_trusted_code_the_folder_lacks_is_refused_naming_the_flag(remote_chat, tmp_path):
    """Issue 59: the hint was a run's ("set target.path in config.yaml"); eval's fix is --target."""
    (remote_chat[0] / "modeling_tiny_remote.py").unlink()
    with pytest.raises(EvalInputError) as exc:
        Evaluation(_opts(remote_chat, tmp_path / "out", trust_remote_code=True),
                   lambda m: None).load()
    said = str(exc.value)
    assert "lacks the Python files" in said and "modeling_tiny_remote.py" in said
    assert "pass --target" in exc.value.hint and "config.yaml" not in exc.value.hint
    assert not (tmp_path / "out").exists()
