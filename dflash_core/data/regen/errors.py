"""What stops ``data regenerate``: another model, a server that refuses the requests as made,
or one that cannot answer."""

from __future__ import annotations

from dflash_core.data.shards import DataError


class ModelMismatch(DataError):
    """An endpoint serves, or answers as, another model than the one asked for."""


class ServerRefuses(DataError):
    """The server refuses the requests as they are made (4xx): a flag or its options fix it."""


class ServerFailing(Exception):
    """The server cannot answer (down past the wait, or failing the probe past its retries):
    nothing is wrong with the input; the same command continues once it answers."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint
