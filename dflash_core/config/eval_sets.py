"""The checks of eval.prompt_sets and eval.best_set that need no file: each item's ranges, a name
and a path, no name twice, a best_set that names a set. Preflight checks the files and the
chat template (eval/run_sets.py), with the eval verb's own loaders."""

from __future__ import annotations

import dataclasses
import re

from dflash_core.config.errors import ConfigError
from dflash_core.config.schema import check_range

# a set's name is a W&B key's part (eval/<name>/tau) and a word of the log: no '/' or spaces
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def item_key(i: int, name: str = "") -> str:
    return f"eval.prompt_sets[{i}]" + (f".{name}" if name else "")


def check_prompt_sets(eval_cfg) -> None:
    """Raise ConfigError naming the item and key of the first problem."""
    seen: dict[str, int] = {}
    for i, s in enumerate(eval_cfg.prompt_sets):
        for f in dataclasses.fields(s):
            if f.metadata["range"] is not None:
                check_range(item_key(i, f.name), getattr(s, f.name), f.metadata["range"])
        if not s.name:
            raise ConfigError(item_key(i, "name"), "missing: each prompt set needs a name",
                              hint=f"add name: gsm8k (say) to {item_key(i)} in config.yaml")
        if not NAME.fullmatch(s.name):
            raise ConfigError(item_key(i, "name"), f"{s.name!r}: use letters, digits, '.', "
                              "'-', '_' (it names W&B keys eval/<name>/tau)",
                              hint=f"rename it, e.g. {re.sub(r'[^A-Za-z0-9_.-]+', '-', s.name)!r}")
        if s.name in seen:
            raise ConfigError(item_key(i, "name"), f"{s.name!r} names two sets (items "
                              f"{seen[s.name]} and {i})", hint="give each set its own name")
        seen[s.name] = i
        if not s.path:
            raise ConfigError(item_key(i, "path"), f"missing: set {s.name} needs its JSONL file",
                              hint=f"add path: sets/{s.name}.jsonl (say) to {item_key(i)}")
    if eval_cfg.best_set and eval_cfg.best_set not in seen:
        names = ", ".join(seen) or "none"
        raise ConfigError("eval.best_set", f"{eval_cfg.best_set!r} names no set of "
                          f"eval.prompt_sets ({names})",
                          hint='set eval.best_set to "" (the held-out tau) or to one of them')


def set_words(name: str) -> str:
    """A set as messages name it: "" is the held-out prompts (eval.best_set's default)."""
    return f"prompt set {name}" if name else "the held-out prompts"
