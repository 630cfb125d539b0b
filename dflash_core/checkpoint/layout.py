"""What a checkpoint folder holds, by name, and the error its readers and writers raise.

A checkpoint is ``<run_dir>/checkpoints/step-<N>/`` with
  config.json          the drafter config (interchange format, docs/checkpoint-format.md)
  model.safetensors    the drafter weights in the dtype it is served in (interchange format)
  training_state.json  step, scheduler and trainer state, and the skeleton of the optimizer state
  training_state-<k>-of-<n>.safetensors  float32 master weights, optimizer moments, RNG tensors:
                       n disjoint shards (one per writer, so several write at once)
  checksums.json       each file's size and CRC-32, written last (format 3)
No pickle anywhere. Folders of format 2 (no checksums.json) and format 1 (``training_state.pt``,
float32 ``model.safetensors``) still load, said to be unverifiable. Writing and loading:
save_load.py; the checksums: checksums.py; a run's folders of them: folders.py.
"""

from __future__ import annotations

CHECKPOINTS = "checkpoints"
STATE_JSON = "training_state.json"
FILES = ("config.json", "model.safetensors", STATE_JSON)  # plus the shards STATE_JSON names
CHECKSUMS = "checksums.json"  # every other file's size and CRC-32; written last (format 3)
LEGACY_STATE = "training_state.pt"  # format 1, read only
FORMAT_VERSION = 3
MASTER = "master"  # prefix of the float32 master weights in the shards
# Prefix of tensors written to model.safetensors only, never to the training state: DSpark's
# copies of the target's embed_tokens and lm_head (frozen: no master, no optimizer state).
SERVED = "served"


class CheckpointError(OSError):
    """A checkpoint could not be written or read (disk full, permissions, damaged files)."""

    error_kind = "io"

    def __init__(self, message: str, hint: str = "", errno: int | None = None):
        super().__init__(message)
        self.hint = hint
        self.errno = errno
