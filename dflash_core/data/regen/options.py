"""What ``data regenerate`` is asked to do (``RegenOptions``) and the checks of its numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_core.data.shards import DataError


@dataclass
class RegenOptions:
    source: str | Path
    out: str | Path
    endpoints: list[str]
    model: str | None = None  # None: the model the first endpoint serves
    api: str = "chat"  # chat | completions
    tokenizer: str | None = None  # completions: renders the prompt ids; target: the measure
    chat_template: str | Path | None = None
    trust_remote_code: bool = False  # a tokenizer of the folder's own code (auto_map) may run
    thinking: str = "keep"
    concurrency: int = 8  # requests in flight per endpoint
    max_tokens: int = 2048
    temperature: float = 0.0
    timeout_s: float = 600.0  # per request: from sending it to the answer's last byte
    retries: int = 4
    backoff_s: float = 1.0
    down_wait_s: float = 1800.0  # how long an endpoint that does not answer is waited for
    token_ids: bool = True
    api_key: str | None = None
    limit: int = 0  # 0 = all rows
    progress: bool = True
    target: Any = None  # a loaded HF causal LM of the target: measures a text round trip


def check_options(opts: RegenOptions) -> None:
    """The numbers the command line checks too, for callers of ``regenerate``."""
    def whole(v, lo):
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo

    def real(v, lo, strict):
        return isinstance(v, (int, float)) and math.isfinite(v) and (v > lo if strict
                                                                     else v >= lo)
    bad = [f"{name} must be {want}, got {v!r}" for name, v, ok, want in (
        ("concurrency", opts.concurrency, whole(opts.concurrency, 1), ">= 1"),
        ("max_tokens", opts.max_tokens, whole(opts.max_tokens, 1), ">= 1"),
        ("retries", opts.retries, whole(opts.retries, 0), ">= 0"),
        ("limit", opts.limit, whole(opts.limit, 0), ">= 0 (0 = all rows)"),
        ("timeout_s", opts.timeout_s, real(opts.timeout_s, 0, True), "a number > 0"),
        ("temperature", opts.temperature, real(opts.temperature, 0, False), "a number >= 0"),
        ("backoff_s", opts.backoff_s, real(opts.backoff_s, 0, False), "a number >= 0"),
        ("down_wait_s", opts.down_wait_s, real(opts.down_wait_s, 0, False), "a number >= 0"),
    ) if not ok]
    if opts.api not in ("chat", "completions"):
        bad.append(f"api must be chat or completions, got {opts.api!r}")
    if bad:
        raise DataError("; ".join(bad), hint="see dflash-tui data regenerate --help")
