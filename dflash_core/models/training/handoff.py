"""Features from a target's GPU to a drafter's GPU without either GPU waiting on the other's work.

A plain ``tensor.to(other_gpu)`` runs the copy on the source GPU's current stream, behind the
target's next forward, and makes the drafter's stream wait for it: each side then stalls on the
other (measured: a 27B-shaped drafter step 35% slower). Here the copy runs on a side stream on
each of the two GPUs: it waits only for the event the target recorded when these features were
done, and the drafter's compute stream waits only for the copy. The caching allocator is told
which streams use each tensor (``record_stream``), so neither side reuses memory still in flight.
Where the GPUs have no peer path, the CUDA driver stages the same copy through host memory.
"""

from __future__ import annotations

import torch


def ready_event(t: torch.Tensor) -> torch.cuda.Event | None:
    """On the producer's thread, right after computing ``t``: an event that completes when it is
    done (None off CUDA, where work is synchronous)."""
    if not t.is_cuda:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


class Pending:
    """A copy in flight; ``take()`` makes the caller's stream wait for it and returns the tensor."""

    def __init__(self, tensor: torch.Tensor, done: torch.cuda.Event | None = None):
        self._tensor, self._done = tensor, done

    def take(self) -> torch.Tensor:
        t = self._tensor
        if self._done is not None:
            stream = torch.cuda.current_stream(t.device)
            stream.wait_event(self._done)
            t.record_stream(stream)  # allocated on the copy stream, used on this one
            self._done = None
        return t


class FeatureCopier:
    """One per drafter: moves features to ``device``, keeping a side stream per GPU involved."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._streams: dict[int, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device.index not in self._streams:
            self._streams[device.index] = torch.cuda.Stream(device=device)
        return self._streams[device.index]

    def start(self, src: torch.Tensor, ready: torch.cuda.Event | None) -> Pending:
        if self.device.type != "cuda" or not src.is_cuda:
            return Pending(src.to(self.device))
        if src.device == self.device:
            stream = torch.cuda.current_stream(self.device)
            if ready is not None:  # made on the target's stream
                stream.wait_event(ready)
            src.record_stream(stream)  # not reused by the target before this stream is done
            return Pending(src)
        s_src, s_dst = self._stream(src.device), self._stream(self.device)
        if ready is not None:
            s_src.wait_event(ready)
        # A copy between GPUs is ordered on both devices' current streams: make both side streams.
        with torch.cuda.stream(s_src), torch.cuda.stream(s_dst):
            out = src.to(self.device, non_blocking=True)
        src.record_stream(s_src)  # the target must not reuse this memory before the copy ends
        done = torch.cuda.Event()
        done.record(s_dst)
        return Pending(out, done)
