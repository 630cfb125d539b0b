"""The one error a config can raise."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config value. ``key`` is the dotted path; ``hint`` says what to change."""

    error_kind = "config"

    def __init__(self, key: str, message: str, hint: str = ""):
        self.key = key
        self.message = message
        self.hint = hint
        super().__init__(f"{key}: {message}" if key else message)
