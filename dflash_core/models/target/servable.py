"""A target folder a serving engine loads as it is: what this project writes into every target it
builds (the demo's, the lab's), and what a folder lacks for serving.

A server resolves the model class from config.json's ``architectures``; without it vLLM falls
back to the base model (``Qwen3Model``) and starts a pooling (embedding) runner instead of a
generating one. It takes text only through a tokenizer saved beside the weights
(``AutoTokenizer.from_pretrained(folder)``, offline), whose chat template renders chat requests.
``config.save_pretrained`` alone writes neither (``model.save_pretrained`` would write the
architecture, but it writes nothing off rank 0 under torch.distributed, which the builds avoid).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_core.models.target.config import CONFIG_NAME

# What a server loads the text with: any of these beside config.json (transformers' own names).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def name_architecture(config, model) -> None:
    """Set ``config.architectures`` to the class of ``model`` (before ``config.save_pretrained``),
    as ``model.save_pretrained`` would."""
    config.architectures = [type(model).__name__]


def add_architecture(folder: str | Path, architecture: str) -> bool:
    """Write ``architectures: [architecture]`` into ``folder``'s config.json when it names none
    (a folder built before this was written); atomic. Returns whether the file changed."""
    path = Path(folder) / CONFIG_NAME
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("architectures"):
        return False
    config["architectures"] = [architecture]
    tmp = path.with_name(f".{CONFIG_NAME}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return True


def serving_gaps(folder: str | Path) -> list[str]:
    """What ``folder`` lacks for a server to load it and take text, in words ([] when nothing)."""
    folder = Path(folder)
    gaps = []
    try:
        config = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return [f"a readable {CONFIG_NAME}"]
    if not config.get("architectures"):
        gaps.append(f"{CONFIG_NAME} names no architectures (a server would start the base "
                    "model, not the causal LM)")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        gaps.append("no tokenizer beside the weights (tokenizer.json): a server cannot take text")
    return gaps
