"""Units of size. Sizes are counted in bytes everywhere; these turn them into what people read."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def size_text(n: float | None, *, short: bool = False) -> str:
    """Bytes as people read them, the one formatter of sizes: GiB with one decimal ("80.1 GiB"),
    a size under a tenth of a GiB in MiB or KiB so it does not read 0.0; None is "-".
    ``short``: the dashboard's narrow columns, "80.1G" and "300M"."""
    if n is None:
        return "-"
    if n >= GiB / 10 or n == 0:
        return f"{n / GiB:.1f}{'G' if short else ' GiB'}"
    if short:
        return f"{n / MiB:.0f}M"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / KiB:.1f} KiB"
