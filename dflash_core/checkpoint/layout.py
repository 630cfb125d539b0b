"""What a checkpoint folder holds, by name, and the error its readers and writers raise.

A checkpoint is ``<run_dir>/checkpoints/step-<N>/`` with
  config.json          the drafter config (interchange format, docs/checkpoint-format.md)
  model.safetensors    the drafter weights in the dtype it is served in (interchange format)
  checksums.json       each file's size and CRC-32 (paths relative to the folder), written last
  training_state/      what only a resume reads, where no server looks (format 4):
    training_state.json  step, scheduler and trainer state, and the skeleton of the optimizer
                         state; its "shards" are named relative to this subfolder
    training_state-<k>-of-<n>.safetensors  float32 master weights, optimizer moments, RNG
                         tensors: n disjoint shards (one per writer, so several write at once)
The top level is what vLLM's and SGLang's loaders read (every ``*.safetensors`` there): the
served weights and nothing else, so the folder is servable as it is. No pickle anywhere. Older
folders still load: format 3 (the training state at the top level), format 2 (also no
checksums.json) and format 1 (``training_state.pt``, float32 ``model.safetensors``), the last
two said to be unverifiable; readers find the training state with ``state_json``. Writing and
loading: save_load.py; the checksums: checksums.py; a run's folders of them: folders.py.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

CHECKPOINTS = "checkpoints"
STATE_DIR = "training_state"  # the training state's subfolder (format 4)
STATE_JSON = "training_state.json"
STATE_PATH = f"{STATE_DIR}/{STATE_JSON}"  # its path in a format-4 folder
SERVED_FILES = ("config.json", "model.safetensors")  # the top level: what a server reads
FILES = (*SERVED_FILES, STATE_PATH)  # plus the shards STATE_JSON names
CHECKSUMS = "checksums.json"  # every other file's size and CRC-32; written last (format 3 on)
LEGACY_STATE = "training_state.pt"  # format 1, read only
FORMAT_VERSION = 4
MASTER = "master"  # prefix of the float32 master weights in the shards
# Prefix of tensors written to model.safetensors only, never to the training state: DSpark's
# copies of the target's embed_tokens and lm_head (frozen: no master, no optimizer state).
SERVED = "served"


def state_json(folder: str | Path) -> Path:
    """A step folder's training_state.json: in its subfolder (format 4), else at its top level
    (formats 2 and 3). Where neither is, the name a missing file is given: the top level's when
    shards lie there and no subfolder does (an older folder), else the subfolder's."""
    folder = Path(folder)
    sub, top = folder / STATE_PATH, folder / STATE_JSON
    if sub.is_file():
        return sub
    if top.is_file():
        return top
    older = not sub.parent.is_dir() and any(folder.glob("training_state-*.safetensors"))
    return top if older else sub


def shard_path(state_rel: str, shard: str) -> str:
    """The path, relative to the step folder, of a shard training_state.json names; ``state_rel``
    is that json's own relative path (STATE_PATH, or STATE_JSON in a format-3 folder)."""
    return (PurePosixPath(state_rel).parent / shard).as_posix()


class CheckpointError(OSError):
    """A checkpoint could not be written or read (disk full, permissions, damaged files)."""

    error_kind = "io"

    def __init__(self, message: str, hint: str = "", errno: int | None = None):
        super().__init__(message)
        self.hint = hint
        self.errno = errno
