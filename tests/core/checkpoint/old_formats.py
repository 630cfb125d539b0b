"""Turn a folder this engine writes (format 4) into one of an older format, as the engine of
that time wrote it: format 3 kept the training state at the top level beside the served files,
format 2 also had no checksums.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_core.checkpoint.layout import CHECKSUMS, STATE_DIR, STATE_JSON


def to_format(folder: Path, fmt: int) -> Path:
    sub = folder / STATE_DIR
    for p in sorted(sub.iterdir()):
        os.rename(p, folder / p.name)
    sub.rmdir()
    state = json.loads((folder / STATE_JSON).read_text())
    state["format"] = fmt
    (folder / STATE_JSON).write_text(json.dumps(state))  # its checksum written again below
    if fmt < 3:
        (folder / CHECKSUMS).unlink()
        return folder
    import zlib

    files = {}
    for p in sorted(folder.iterdir()):
        if p.name != CHECKSUMS:
            raw = p.read_bytes()
            files[p.name] = {"bytes": len(raw), "crc32": f"{zlib.crc32(raw):08x}"}
    (folder / CHECKSUMS).write_text(json.dumps({"format": fmt, "algorithm": "crc32",
                                                "files": files}))
    return folder
