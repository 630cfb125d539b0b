"""The regenerate verb (``dflash-tui data regenerate``): conversations' assistant turns answered
again by the target behind OpenAI-compatible servers. Not the training reading path (that is
``dflash_core.data`` above); entry point: ``regenerate.regenerate``."""
