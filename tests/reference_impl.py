"""The public reference implementation of the drafter (PyPI ``dflash==0.1.0``), for the tests that
compare with it: used where importable (a GPU node carries it in as a wheel), else installed
without its dependencies into a folder beside the environment when pip can reach an index."""

import importlib
import subprocess
import sys
from pathlib import Path

REFERENCE = "dflash==0.1.0"


def find_reference() -> tuple[type | None, str]:
    """(``DFlashDraftModel``, how it was found) or (None, why it cannot be had)."""
    try:
        return importlib.import_module("dflash.model").DFlashDraftModel, "importable"
    except ImportError:
        pass
    folder = Path(sys.prefix) / "reference-dflash-0.1.0"
    if not (folder / "dflash" / "model.py").exists():
        # A node without network must answer in seconds, not after pip's retries.
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                               "--retries", "0", "--timeout", "15", "--target", str(folder),
                               REFERENCE], capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return None, (f"{REFERENCE} is not importable and pip could not install it ({last}); "
                          f"on a machine without network install its wheel first "
                          f"(pip download --no-deps {REFERENCE} where there is one)")
    sys.path.insert(0, str(folder))
    return importlib.import_module("dflash.model").DFlashDraftModel, f"installed in {folder.name}"
