"""bench/lab/prompt_sets.py: the code and docstrings sets from the held-out files."""

from bench.lab.corpus import collect
from bench.lab.prefixes import Tokenized, token_count, tokenize_documents
from bench.lab.prompt_sets import code_prompts, docstring_openings, docstring_prompts
from bench.lab.tokenizer import train_tokenizer

SOURCE = '''"""Module: ünïcode before the quotes."""
x = "é"


class K:
    r\'\'\'Raw single-quoted docstring.\'\'\'

    async def go(self):  # ß
        """Go."""


def plain():
    return 1
'''


def test_every_docstring_is_cut_just_after_its_opening_quotes():
    breaks = [i for i, c in enumerate(SOURCE) if c == "\n"]
    doc = Tokenized("m.py", SOURCE, [], breaks, [])
    got = docstring_openings(doc)
    assert [line for line, _ in got] == [1, 6, 9]
    assert got[0][1] == '"""'
    assert got[1][1].endswith("class K:\n    r'''")
    assert got[2][1].endswith('async def go(self):  # ß\n        """')
    assert docstring_openings(Tokenized("bad.py", "def (:\n", [], [6], [])) == []


def test_the_sets_spread_their_prompts_over_the_context_buckets(fake_site):
    docs = collect(("labfake_pkg", "labfake_single"), heldout_per_mille=0, chat_per_mille=0,
                   max_file_bytes=100_000).documents
    tk = train_tokenizer(docs, 400, 1_000_000)
    tdocs = tokenize_documents(tk, docs)
    edges = (8, 40, 120)
    code = code_prompts(tk, tdocs, edges, 6, seed=0)
    assert len(code) == 6
    lengths = sorted(token_count(tk, r["prompt"]) for r in code)
    assert sum(8 <= n < 40 for n in lengths) == 3 and sum(40 <= n < 120 for n in lengths) == 3
    assert code == code_prompts(tk, tdocs, edges, 6, seed=0)
    doc = docstring_prompts(tk, tdocs, edges, 6, seed=0)
    assert doc and all(r["prompt"].endswith('"""') for r in doc)
    assert all(8 <= token_count(tk, r["prompt"]) < 120 for r in doc)
    assert not docstring_prompts(tk, [t for t in tdocs if t.path.endswith(".md")], edges, 6, 0)
