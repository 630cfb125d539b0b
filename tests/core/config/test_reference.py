"""The keys in words come from the schema: docs/config.md is what reference.py writes, and the
list under --help names every key with its default and range."""

from pathlib import Path

from dflash_core.config import config_keys
from dflash_core.config.reference import allowed, keys_help, keys_markdown

ROOT = Path(__file__).resolve().parents[3]


def test_docs_config_md_is_up_to_date_with_the_schema():
    written = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert written == keys_markdown(), (
        "docs/config.md is behind the schema: python -m dflash_core.config.reference "
        "docs/config.md")


def test_the_table_and_the_help_name_every_key_with_what_it_takes():
    table, help_text = keys_markdown(), keys_help()
    for spec in config_keys():
        assert f"| `{spec.path}` |" in table, spec.path
        assert f"  {spec.path}=" in help_text, spec.path
    lr = next(s for s in config_keys() if s.path == "optim.lr")
    assert "| `optim.lr` | `0.0006` | in (0, 1] | AdamW's peak learning rate" in table
    assert allowed(lr) == "in (0, 1]"
    assert "optim.name=adamw  [adamw | muon]" in help_text
    assert "run.seed=0  [any integer]" in help_text
    assert max(len(line) for line in help_text.splitlines()) <= 100
