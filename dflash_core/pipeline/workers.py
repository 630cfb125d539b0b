"""What every worker thread of the engine shares: the stop exception, the poll interval, its
CUDA device, and a way to name the stage at fault when a failure surfaces in another one."""

from __future__ import annotations

import torch

POLL_S = 0.1  # every blocking wait is at most this long, then the stop flag is checked


class Stopped(Exception):
    """Raised inside a worker when the stop flag ends a wait."""


class UpstreamFailed(Exception):
    """A stage saw the failure of the stage that feeds it (a target, of its loader thread):
    the error is reported under the upstream stage's name, not the one that noticed it."""

    def __init__(self, source: str, role: str, cause: BaseException, device: str | None = None):
        super().__init__(f"{source} failed: {cause}")
        self.source, self.role, self.cause = source, role, cause
        self.device = device  # the failed stage's device, where it differs from the noticer's


def use_device(dev: torch.device) -> None:
    """Make ``dev`` this thread's current CUDA device (a per-thread setting): kernels that launch
    on the current device (Triton's, e.g. flash-linear-attention's) then run where the tensors
    are."""
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
