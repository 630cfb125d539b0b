"""A small corpus of made-up installed packages, for the lab chain's fast tests."""

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODULE = '''"""Tools for module {k}: counting, naming and joining things."""

import os


class Counter{k}:
    """Count the items of a sequence, one by one."""

    def __init__(self, items):
        self.items = list(items)

    def count(self, value):
        """How many times value occurs."""
        total = 0
        for item in self.items:
            if item == value:
                total += 1
        return total


def join_{k}(parts, sep=", "):
    """Join the parts with sep, skipping empty ones."""
    return sep.join(p for p in parts if p)
'''


def write_site(site: Path, modules: int = 24) -> Path:
    """Two packages: ``labfake_pkg`` (a folder of modules, a README, files that are left out) and
    ``labfake_single`` (one module file)."""
    pkg = site / "labfake_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")  # empty: left out
    for k in range(modules):
        where = pkg / "sub" if k % 3 == 0 else pkg
        (where / f"mod{k}.py").write_text(MODULE.format(k=k))
    (pkg / "README.md").write_text("# labfake\n\nA package made up for tests.\n")
    (pkg / "latin1.py").write_bytes(b"# caf\xe9\n")  # not UTF-8: left out
    (pkg / "huge.py").write_text("x = 1\n" * 100_000)  # too large: left out
    (pkg / "data.bin").write_bytes(b"\0\1")  # not a text suffix
    (site / "labfake_single.py").write_text(MODULE.format(k=99))
    return site


@pytest.fixture
def fake_site(tmp_path, monkeypatch) -> Path:
    site = write_site(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site
