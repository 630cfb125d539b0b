"""The one error publish raises for bad input: the message and the fix, each one line."""

from __future__ import annotations


class PublishError(ValueError):
    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint
