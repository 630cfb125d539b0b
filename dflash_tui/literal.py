"""Text from outside the dashboard (error messages, hints, tracebacks, paths, worker and run
names, log lines, notices) as it is to be shown: literally.

Textual reads a plain str handed to a widget (a DataTable cell, a Static, a notice) as markup, so
a gloo error's "[/__w/pytorch/.../pair.cc:553]" would be a closing tag and end the app with a
MarkupError, and "[bold]" in a path would vanish into a style. A rich Text is never parsed:
every string the dashboard did not write itself reaches a widget as one, through `literal`;
notices go through DFlashApp.notify, which turns markup off."""

from __future__ import annotations

from rich.text import Text


def literal(text: object, style: str = "") -> Text:
    """``text`` as a Text shown character for character (brackets included)."""
    return Text(str(text), style=style)
