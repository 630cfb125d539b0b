"""Loading a config: from YAML (safe_load only), a dict, or ``--set`` overrides, strictly.

An unknown or mistyped key, a value of the wrong type, outside its allowed choices or outside its
range (schema.py) raises ``ConfigError`` naming the key path (``data.token_budget``), the bad
value and what is allowed."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from dflash_core.config.errors import ConfigError
from dflash_core.families.registry import FAMILIES, FAMILY_DEFAULT_KEYS
from dflash_core.config.eval_sets import check_prompt_sets
from dflash_core.config.schema import RANGES, Config, check_range, key_value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    try:
        return _coerce_value(value, tp, key)
    except ConfigError as exc:
        if not exc.hint and exc.key == key:
            exc.hint = f"set {key} to {_wanted(tp)} in config.yaml"
        raise


def _wanted(tp: Any) -> str:
    """What a value of type ``tp`` looks like, for a hint."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) or origin is dict:
        return "a section of 'name: value' lines (indented under it)"
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin is list:
        return f"a list [..., ...], each item {_wanted(typing.get_args(tp)[0])}"
    return {bool: "true or false (unquoted)", int: "a whole number", float: "a number",
            str: "a string"}.get(tp, f"a {_type_name(tp)}")


def _coerce_value(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {value!r}")
        return _build(tp, value, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(choices):
            value = "on" if value else "off"  # YAML 1.1 reads an unquoted on / off as a bool
        if value not in choices:
            raise ConfigError(key, f"{value!r} is not allowed; choose one of {list(choices)}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        if not math.isfinite(value):  # YAML's .inf / .nan: no key means either
            raise ConfigError(key, f"expected a finite number, got {value!r}",
                              hint=f"set {key} to an ordinary number in config.yaml")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    raise ConfigError(key, f"unsupported type {_type_name(tp)}")


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            guess = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                key, f"unknown key (value {value!r}).{guess} Allowed keys: {sorted(fields)}",
                hint=f"remove or rename '{key}' in config.yaml",
            )
        kwargs[name] = _coerce(value, hints[name], key)
    return cls(**kwargs)


def _check(cfg: Config) -> None:
    """Range and cross-field checks that types alone cannot express."""
    for key in RANGES:
        check_range(key, key_value(cfg, key))
    check_prompt_sets(cfg.eval)
    if cfg.data.max_length > cfg.data.token_budget:
        raise ConfigError(
            "data.max_length",
            f"{cfg.data.max_length} exceeds data.token_budget {cfg.data.token_budget}",
            hint="raise data.token_budget or lower data.max_length",
        )
    if not cfg.layout.targets:
        raise ConfigError("layout.targets", "needs at least one target device",
                          hint="set layout.targets to a list of GPU indices, e.g. [0]")
    if not cfg.layout.drafters:
        raise ConfigError("layout.drafters", "needs at least one drafter device",
                          hint="set layout.drafters to a list of GPU indices, e.g. [1]")
    for key, ids in (("layout.targets", cfg.layout.targets),
                     ("layout.drafters", cfg.layout.drafters)):
        if len(set(ids)) != len(ids):
            raise ConfigError(key, f"repeats a device: {ids}",
                              hint=f"list each device once in {key}")
        if any(i < 0 for i in ids):
            raise ConfigError(key, f"device indices must be >= 0, got {ids}",
                              hint=f"list GPU indices (0, 1, ...) in {key}")
    _check_group_layout(cfg)
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError("optim.betas", f"expected two numbers in [0, 1), got {cfg.optim.betas}",
                          hint="set optim.betas to [0.9, 0.95] or similar in config.yaml")
    if any(i < 0 for i in cfg.target.layer_ids):
        raise ConfigError("target.layer_ids", f"ids must be >= 0, got {cfg.target.layer_ids}",
                          hint="list layer indices of the target (0 = the first layer)")
    for p in FAMILIES[cfg.drafter.objective].refusals(cfg.drafter):  # e.g. dpace with dspark
        raise ConfigError(p.key, p.message, hint=p.hint)
    if "/" in cfg.run.name or not cfg.run.name or cfg.run.name in (".", ".."):
        raise ConfigError("run.name", f"must be a plain folder name, got {cfg.run.name!r}",
                          hint="set run.name to a name without '/', e.g. my-run")


def _check_group_layout(cfg: Config) -> None:
    """A copy of the target over several GPUs (target.gpus_per_copy): its size against
    layout.targets (what transformers can split is preflight's: target_group/split.py)."""
    k, targets = cfg.target.gpus_per_copy, cfg.layout.targets
    if k == 1:
        return
    if k > len(targets):
        raise ConfigError("target.gpus_per_copy", (
            f"a copy of {k} GPUs is larger than the {len(targets)} GPU(s) layout.targets lists"),
            hint=f"list {k} GPUs (or a multiple of {k}) in layout.targets, or lower "
                 "target.gpus_per_copy")
    if len(targets) % k:
        raise ConfigError("target.gpus_per_copy", (
            f"layout.targets lists {len(targets)} GPUs, not a whole number of copies of {k}"),
            hint=f"list a multiple of {k} GPUs in layout.targets, or set target.gpus_per_copy "
                 f"to a divisor of {len(targets)}")


def apply_overrides(cfg: Config, overrides: list[tuple[str, str]]) -> Config:
    """``cfg`` with each (``section.key``, value text) of the command line's ``--set`` applied,
    the text read as a YAML scalar or list (``muon``, ``0.02``, ``[0, 1]``, ``true``) and the
    whole config checked again as if config.yaml said it."""
    if not overrides:
        return cfg
    data = cfg.to_dict()  # section -> key -> value: exactly the keys there are
    for key, text in overrides:
        section, _, name = key.partition(".")
        if name not in data.get(section, {}):
            keys = [f"{a}.{b}" for a, part in data.items() for b in part]
            # The key's name under another section (run.lr -> optim.lr) before a spelling guess.
            near = ([k for k in keys if k.partition(".")[2] == name][:1]
                    or difflib.get_close_matches(key, keys, 1))
            raise ConfigError(key, "--set names no config key" + (
                f" (did you mean {near[0]}?)" if near else ""), hint=(
                "--set SECTION.KEY=VALUE with a key of config.yaml, e.g. --set optim.name=muon"))
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(key, f"--set {key}={text}: not a value ({exc})",
                              hint="quote it as YAML would, e.g. --set run.name=my-run") from exc
        data[section][name] = value
    given = getattr(cfg, "given", None)
    if given is not None:  # keys the objective chose, not the config nor --set: chosen again
        for name in FAMILY_DEFAULT_KEYS:
            key = f"drafter.{name}"
            if key not in given and all(k != key for k, _ in overrides):
                del data["drafter"][name]
    try:
        return config_from_dict(data)
    except ConfigError as exc:
        if any(exc.key == key for key, _ in overrides):
            raise ConfigError(exc.key, f"{exc.message} (from --set)",
                              hint=exc.hint.replace("in config.yaml", "with --set")) from exc
        raise


def config_from_dict(data: dict | None) -> Config:
    data = data or {}
    cfg = _build(Config, data, "")
    drafter = data.get("drafter") if isinstance(data.get("drafter"), dict) else {}
    # Keys whose default is the family's (DSpark's block_size and loss_chunk) when the config
    # sets the objective without them; the others' is the field's own.
    for name, value in FAMILIES[cfg.drafter.objective].defaults.items():
        if name not in drafter:
            setattr(cfg.drafter, name, value)
    # What the config itself said, for apply_overrides: an objective given later by --set
    # gets its own defaults for the keys the config left to it.
    cfg.given = frozenset(f"drafter.{name}" for name in drafter)
    _check(cfg)
    return cfg


def load_config(path: str | Path) -> Config:
    path = Path(path)
    if not path.exists():
        raise ConfigError("", f"config file {path} does not exist",
                          hint="pass --config PATH, or try the built-in demo: dflash-tui demo")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:  # a folder, no permission, a binary file
        raise ConfigError("", f"cannot read config file {path}: {exc}",
                          hint="pass --config the path of a readable YAML file") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{path} is not valid YAML: {exc}",
                          hint="fix the YAML syntax at the line shown") from exc
    if data is None:  # empty, or only comments: not "all defaults" in silence
        raise ConfigError("", f"{path} is empty (no keys)",
                          hint="write the run's config into it (see config.yaml in the "
                               "repository), or run --demo for the built-in demo")
    if not isinstance(data, dict):
        raise ConfigError("", f"{path} must hold a mapping at top level, got "
                          f"{type(data).__name__}",
                          hint="the file holds sections such as 'run:', 'target:', 'data:'")
    _refuse_duplicate_keys(text, path)
    return config_from_dict(data)


def _refuse_duplicate_keys(text: str, path: Path) -> None:
    """YAML keeps the last of two equal keys without a word; a config that sets a key twice is
    ambiguous, so name the key and both lines. Walks the composed node tree (no objects made)."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    stack = [(root, "")]
    while stack:
        node, prefix = stack.pop()
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key, value in node.value:
                name = f"{prefix}.{key.value}" if prefix else str(key.value)
                line = key.start_mark.line + 1
                if name in seen:
                    raise ConfigError(name, f"set twice in {path} (lines {seen[name]} and "
                                      f"{line}); YAML would silently keep the last",
                                      hint=f"keep one '{key.value}:' in that section")
                seen[name] = line
                stack.append((value, name))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{prefix}[{i}]") for i, item in enumerate(node.value))


def save_config(cfg: Config, path: str | Path) -> None:
    """Write ``cfg`` as YAML to ``path`` whole: under a temporary name, then renamed, so a reader
    (an attached dashboard, the report) never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
