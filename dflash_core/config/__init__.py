"""The run configuration: its keys (schema.py), loading and checking (load.py), the keys in words
(reference.py: ``--set``'s help, docs/config.md) and the recipe in words (recipe.py).

``from dflash_core.config import Config, load_config, ConfigError, ...`` is the way in."""

from dflash_core.config.errors import ConfigError
from dflash_core.config.load import (
    apply_overrides, config_from_dict, load_config, save_config,
)
from dflash_core.config.recipe import recipe_text
from dflash_core.config.schema import (
    RANGES, UNBOUNDED, CheckpointConfig, Config, CostConfig, DataConfig, DrafterConfig,
    EvalConfig, KeySpec, LayoutConfig, NodesConfig, OptimConfig, RunConfig, TargetConfig,
    TelemetryConfig, WandbConfig, check_range, config_keys, default_gamma, describe_range, key,
    key_value, set_key_value,
)

__all__ = [
    "RANGES", "UNBOUNDED", "CheckpointConfig", "Config", "ConfigError", "CostConfig",
    "DataConfig", "DrafterConfig", "EvalConfig", "KeySpec", "LayoutConfig", "NodesConfig",
    "OptimConfig", "RunConfig", "TargetConfig", "TelemetryConfig", "WandbConfig",
    "apply_overrides", "check_range", "config_from_dict", "config_keys", "default_gamma",
    "describe_range", "key", "key_value", "load_config", "recipe_text", "save_config",
    "set_key_value",
]
