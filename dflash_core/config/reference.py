"""Every config key in words, read from the schema: the list under ``dflash-tui run --help`` (what
``--set`` takes) and the table of docs/config.md.

docs/config.md is this module's output; after changing a key, write it again with
``python -m dflash_core.config.reference docs/config.md`` (a test says when it is behind)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Literal

from dflash_core.config.schema import KeySpec, config_keys, describe_range


def allowed(spec: KeySpec) -> str:
    """What a key takes, in words: its range, its choices or its kind of value."""
    if spec.range is not None:
        return describe_range(spec.path, spec.range)
    if spec.unbounded:
        return spec.unbounded
    tp = typing.get_type_hints(spec.section)[spec.path.rsplit(".", 1)[1]]
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(typing.get_args(tp))
    if origin is list:
        item = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(item):
            return "a list of mappings (keys below)"
        return {int: "a list of integers", float: "a list of numbers"}.get(item, "a list")
    if origin is dict:
        return "a mapping"
    return {bool: "true | false", str: "text"}.get(tp, getattr(tp, "__name__", str(tp)))


def item_keys(spec: KeySpec) -> list[KeySpec]:
    """The keys of each item of a list of mappings (eval.prompt_sets[].name, ...), documented
    where their dataclass defines them; [] for any other key."""
    tp = typing.get_type_hints(spec.section)[spec.path.rsplit(".", 1)[1]]
    item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
    if item is None or not dataclasses.is_dataclass(item):
        return []
    return [KeySpec(f"{spec.path}[].{f.name}", item, f.default, f.metadata["doc"],
                    f.metadata["range"], f.metadata["unbounded"])
            for f in dataclasses.fields(item)]


def all_keys():
    """config_keys, each list of mappings followed by its items' keys."""
    for spec in config_keys():
        yield spec
        yield from item_keys(spec)


def default_text(value: Any) -> str:
    """A default as config.yaml would spell it."""
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(value)


def first_sentence(doc: str) -> str:
    end = re.search(r'(?<!e\.g)\.\s+(?=[A-Z"(0-9])', doc)  # not at "e.g. Kimi"
    return doc if end is None else doc[: end.start() + 1]


def keys_help(width: int = 100, values: dict[str, str] | None = None, whose: str = "") -> str:
    """The keys ``--set SECTION.KEY=VALUE`` takes, one paragraph each: the default, what the
    value may be and the first sentence of its doc (docs/config.md has it whole). ``values``:
    the text to show for each key instead of its default, ``whose`` naming them (the demo's
    config, which is not config.yaml's defaults)."""
    shown = f" {whose}" if whose else ""
    lines = textwrap.wrap(f"config keys{shown} (--set SECTION.KEY=VALUE; docs/config.md says "
                          "more of each):", width, subsequent_indent="  ")
    for spec in config_keys():
        value = (values or {}).get(spec.path)
        text = (f"{spec.path}={default_text(spec.default) if value is None else value}  "
                f"[{allowed(spec)}]  {first_sentence(spec.doc)}")
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="      ",
                               break_on_hyphens=False)
    return "\n".join(lines) + "\n"


def value_of(cfg: Any, path: str) -> Any:
    """The value of ``path`` ("optim.lr") in a loaded config."""
    for name in path.split("."):
        cfg = getattr(cfg, name)
    return cfg


def values_text(cfg: Any) -> dict[str, str]:
    """Every key's value in ``cfg``, spelt as config.yaml would (for keys_help)."""
    out = {}
    for spec in config_keys():
        value = value_of(cfg, spec.path)
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        elif isinstance(value, list):
            value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
        out[spec.path] = default_text(value)
    return out


def keys_markdown() -> str:
    """docs/config.md: one table per section of config.yaml."""
    out = ["# Config keys", "",
           "Every key of `config.yaml`, its default and what it takes. Loading refuses an unknown "
           "key, a value of another type, or one outside its range, naming the key path and "
           "what is allowed ([bad-input.md](bad-input.md#config-values)). `--set "
           "SECTION.KEY=VALUE` sets one for a command's runs; `--max-steps N` is "
           "`--set run.max_steps=N`.", "",
           "Generated from `dflash_core/config/schema.py` and `eval_schema.py` (where each key is "
           "defined) by "
           "`python -m dflash_core.config.reference docs/config.md`; "
           "`tests/core/config/test_reference.py` fails when this file is behind.", ""]
    section = None
    for spec in all_keys():
        name = spec.path.split(".")[0]
        if name != section:
            section = name
            doc = " ".join((spec.section.__doc__ or "").split())
            out += [""] * (out[-1] != "") + [f"## {name}", "", doc, "",
                                             "| key | default | allowed | what it does |",
                                             "|---|---|---|---|"]
        cells = [f"`{spec.path}`", f"`{default_text(spec.default)}`", allowed(spec), spec.doc]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    text = keys_markdown()
    if argv:
        Path(argv[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
