"""One formatter of sizes, for the log (train.log, preflight) and the dashboard's columns."""

from dflash_core.units import GiB, MiB, size_text
from dflash_tui import fmt


def test_sizes_read_in_gib_and_small_ones_keep_a_unit_that_says_something():
    assert size_text(80.14 * GiB) == "80.1 GiB" and size_text(0) == "0.0 GiB"
    assert size_text(50 * MiB) == "50.0 MiB" and size_text(5000) == "4.9 KiB"
    assert size_text(None) == "-"
    assert (size_text(80.14 * GiB, short=True), size_text(50 * MiB, short=True)) == ("80.1G", "50M")
    assert fmt.gib(3 * GiB) == size_text(3 * GiB, short=True)
