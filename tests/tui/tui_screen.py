"""What the dashboard puts on the screen, read back as text: each widget's rows as the compositor
drew them (after markup, wrapping and cropping), for tests that check what a user sees rather
than what a widget was given."""

from __future__ import annotations

from textual.widget import Widget


def screen_rows(app) -> list:
    """Every row of the screen as drawn, as Strips."""
    return app.screen._compositor.render_strips()


def shown(app, widget: Widget) -> list[str]:
    """The rows of ``widget``'s region as drawn on the screen (its border and padding included),
    right-stripped."""
    region = widget.region
    rows = screen_rows(app)
    return [rows[y].crop(region.x, region.right).text.rstrip()
            for y in range(region.y, min(region.bottom, len(rows)))]


def content_rows(app, widget: Widget) -> list[str]:
    """The rows of ``widget``'s content region (inside its border and padding, the scrollbar
    gutter left out) as drawn on the screen, right-stripped."""
    region = widget.scrollable_content_region
    rows = screen_rows(app)
    return [rows[y].crop(region.x, region.right).text.rstrip()
            for y in range(region.y, min(region.bottom, len(rows)))]
