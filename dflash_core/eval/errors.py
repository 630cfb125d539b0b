"""The one error of benchmark evaluation that is the user's input, not a bug."""

from __future__ import annotations


class EvalInputError(ValueError):
    """A prompt file, checkpoint, template or option that cannot be evaluated as asked: one line
    naming the cause, and ``hint`` the fix (the command line exits 2)."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint
