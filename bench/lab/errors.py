"""What stops a stage of the lab chain: one line naming the cause, and the fix."""

from __future__ import annotations


class LabError(Exception):
    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint

    def line(self) -> str:
        return f"{self}" + (f"\n  hint: {self.hint}" if self.hint else "")
