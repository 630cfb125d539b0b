"""The report page's HTML cells: escaped text and a plain table, shared by the page and its
sections (sets.py, hours.py), which the page imports."""

from __future__ import annotations

import html


def esc(x) -> str:
    return html.escape(str(x), quote=True)


def table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
