"""The verbs of ``dflash-tui VERB``: one module each, exposing ``add_arguments`` and ``run``."""
