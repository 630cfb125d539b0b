"""A folder that really refuses changes, for tests of what cannot be deleted."""

import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def read_only(tmp_path):
    """Makes a folder really refuse changes: chmod for a user, the immutable flag for root
    (whom chmod does not stop); skipped where neither works. ``undo()`` (and the teardown)
    makes everything under tmp_path writable again, wherever a rename took it."""
    import shutil
    import stat

    def make(folder: Path) -> None:
        if os.geteuid() != 0:
            folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
        elif shutil.which("chattr") is None or subprocess.run(
                ["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("root, and chattr +i does not work here: nothing refuses root")

    def undo() -> None:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-R", "-i", str(tmp_path)], capture_output=True)
        else:
            for d in [tmp_path, *tmp_path.rglob("*")]:
                if d.is_dir():
                    d.chmod(0o755)

    make.undo = undo
    yield make
    undo()
