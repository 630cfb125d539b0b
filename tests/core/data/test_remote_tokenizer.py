"""A tokenizer that exists only as its folder's own Python files (tokenizer_config.json's
auto_map, as Kimi-K2's): the data verbs refuse it in one line naming --trust-remote-code (never
transformers' terminal prompt), and with the flag they load it and prepare data with it."""

from __future__ import annotations

import json

import pytest

from dflash_core.data.chat_render import load_tokenizer, tokenizer_code
from dflash_core.data.shards import DataError
from dflash_core.demo.chat import write_demo_conversations
from dflash_tui.cli import main

from tests.core.data.chat_fixtures import train_bpe

REMOTE_TOKENIZER = '''from transformers import PreTrainedTokenizerFast


class TinyRemoteTokenizer(PreTrainedTokenizerFast):
    """A tokenizer class transformers does not ship."""
'''


@pytest.fixture
def remote_tokenizer(tmp_path, hf_modules_cache):

    folder = train_bpe(tmp_path / "remote_tokenizer")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="TinyRemoteTokenizer", auto_map={
        "AutoTokenizer": [None, "tokenization_tiny_remote.TinyRemoteTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "tokenization_tiny_remote.py").write_text(REMOTE_TOKENIZER)
    return folder


def test_a_tokenizer_of_its_own_code_is_refused_naming_the_flag(remote_tokenizer):
    assert tokenizer_code(remote_tokenizer) == "tokenization_tiny_remote.TinyRemoteTokenizer"
    with pytest.raises(DataError, match="needs its own code") as exc_info:
        load_tokenizer(remote_tokenizer)
    assert "TinyRemoteTokenizer" in str(exc_info.value)
    assert "--trust-remote-code" in exc_info.value.hint


def test_trusted_it_loads_with_its_chat_template(remote_tokenizer):
    tok = load_tokenizer(remote_tokenizer, trust_remote_code=True)
    assert type(tok).__name__ == "TinyRemoteTokenizer"
    plain = load_tokenizer(train_bpe(remote_tokenizer.parent / "plain"))
    assert tok.encode("def f(x):") == plain.encode("def f(x):")  # the same vocabulary
    assert tok.chat_template == plain.chat_template


def test_a_plain_tokenizer_folder_names_no_code(tmp_path):
    assert tokenizer_code(train_bpe(tmp_path / "plain")) is None


def test_data_prepare_refuses_it_and_prepares_with_the_flag(remote_tokenizer, tmp_path, capsys):
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=3)
    args = ["data", "prepare", str(src), "--tokenizer", str(remote_tokenizer), "--out",
            str(tmp_path / "o"), "--quiet", "--workers", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "needs its own code" in err and "--trust-remote-code" in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()
    assert main(args + ["--trust-remote-code"]) == 0
    assert "prepared 3 samples" in capsys.readouterr().out


def test_data_inspect_decodes_with_it_when_trusted(remote_tokenizer, tmp_path, capsys):
    src = write_demo_conversations(tmp_path / "demo.jsonl", n=2)
    out = tmp_path / "o"
    assert main(["data", "prepare", str(src), "--tokenizer", str(remote_tokenizer), "--out",
                 str(out), "--quiet", "--workers", "1", "--trust-remote-code"]) == 0
    capsys.readouterr()
    assert main(["data", "inspect", str(out)]) == 0
    assert "needs its own code" in capsys.readouterr().err  # samples shown as ids, and why
    assert main(["data", "inspect", str(out), "--trust-remote-code"]) == 0
    assert "needs its own code" not in capsys.readouterr().err
