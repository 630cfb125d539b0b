"""The verbs of ``dflash-tui [--version] VERB [options]``, in the order ``dflash-tui --help``
lists them.

Each verb is a module of this package with ``add_arguments(parser)`` and ``run(args) -> int``
(the exit code); the first line of its docstring is its one-line help, the rest its ``--help``
text. A verb group (``data prepare``) is a module whose ``add_arguments`` adds its own
sub-parsers. Adding a verb is its module plus one line here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

VERBS: dict[str, str] = {  # verb -> module of this package
    "run": "run",
    "demo": "demo",
    "check": "check",
    "eval": "eval",
    "data": "data",
    "attach": "attach",
    "replay": "replay",
    "serve": "serve",
    "report": "report",
    "publish": "publish",
}
DEFAULT_VERB = "run"  # `dflash-tui --config X` is `dflash-tui run --config X`


def load(verb: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{VERBS[verb]}")
