"""A target group's batch stream as a target worker (target_group/ holds the group's
processes): to the pipeline it is a TargetStage, taking batches from its prefetcher and putting
features on the hs queue. In sharded mode there is one per rank (``ranks`` = [r]); in shared mode
one per copy (all its ranks get each batch, rank 0 sends the features).

Features arrive as the rank's tensors (CUDA IPC on a GPU, shared memory on the CPU); the stage
copies them into memory of this process on the same device and then acknowledges them, so the
rank frees its buffer and everything downstream handles tensors this process's allocator owns.
"""

from __future__ import annotations

import queue
import time

import torch

from dflash_core.models.target.config import load_target_config
from dflash_core.observe.events import (
    WORKER_FAILED, WORKER_LOADING, WORKER_WARMUP, LoadProgress, WorkerStatus,
)
from dflash_core.pipeline.target_stage import TargetStage
from dflash_core.pipeline.workers import POLL_S, Stopped, UpstreamFailed, use_device
from dflash_core.target_group.group import GroupRankFailed, TargetGroup, TargetHeads


class GroupStage(TargetStage):
    """One batch stream of a target group (the module's docstring says which ranks)."""

    def __init__(self, rank: int, group: TargetGroup, ranks: list[int], *, prefetcher, hs_queue, publish, stop, heartbeats):
        first = ranks[0]
        super().__init__(rank, group.devices[first], group.label(first),
                         target_path=group.target_path, dtype=group.dtype,
                         attn_implementation=group.attn, layer_ids=group.layer_ids,
                         prefetcher=prefetcher, hs_queue=hs_queue, publish=publish, stop=stop,
                         heartbeats=heartbeats, last_hidden=group.last_hidden,
                         trust_remote_code=group.trust_remote_code)
        self.group, self.ranks = group, ranks
        self.seq = 0
        for r in ranks:
            group.rows[r] = (self.row_name(r), group.label(r))

    def row_name(self, rank: int) -> str:
        """The screen's row of a rank: this stream's name, or a sub-row for the other ranks of
        a shared copy."""
        return self.name if rank == self.ranks[0] else f"{self.name}.r{rank}"

    def run(self) -> str:
        try:
            return self._run()
        except GroupRankFailed as exc:
            if not self.group.first_failure():
                raise Stopped() from None  # the copy's other stream said it already
            row, device = self.group.rows.get(exc.rank, (self.name, ""))
            if row == self.name:
                raise
            # another stream's rank died: the error and the failed row are that rank's
            self.publish(WorkerStatus(worker=row, role="target", device=device,
                                      status=WORKER_FAILED, detail=str(exc)[:200]))
            raise UpstreamFailed(row, "target", exc, device=device) from None

    def _run(self) -> str:
        use_device(self.device)
        if self.device.type == "cuda":
            torch.cuda.set_stream(torch.cuda.Stream(self.device))
        for r in self.ranks:
            self._rank_status(r, WORKER_LOADING)
        waiting = set(self.ranks)
        while waiting:
            for r in list(waiting):
                msg = self._reply(r)
                if msg is not None and msg[0] == "loaded":
                    waiting.discard(r)
                    self._say_quantized(msg[3] if len(msg) > 3 else None)
        while not self.group.heads_ready.is_set():  # rank 0's stream receives them
            self._check_group()
            self.heartbeats.beat("waiting for rank 0's embedding and lm_head")
            if 0 in self.ranks:
                self._reply(0)
            else:
                self.group.heads_ready.wait(POLL_S)
        self.model = self.group.heads
        self.loaded.set()
        for r in self.ranks:
            self._rank_status(r, WORKER_WARMUP, "first forward")
        self._forward_loop()
        for r in self.ranks:
            self._send(r, ("end",))
        self.hs_queue.producer_done()
        return "stopped" if self.stop.is_set() else "done"

    def _rank_status(self, rank: int, status: str, detail: str = "") -> None:
        self.publish(WorkerStatus(worker=self.row_name(rank), role="target",
                                  device=self.group.label(rank), status=status, detail=detail))

    def _check_group(self) -> None:
        if self.stop.is_set():
            raise Stopped()
        dead = self.group.dead_rank()
        if dead is not None:
            time.sleep(POLL_S)  # its last words (a traceback) may still be in its queue
            for r in self.ranks:
                try:
                    msg = self.group.replies[r].get_nowait()
                except (queue.Empty, OSError, ValueError):
                    continue
                if msg[0] == "error":
                    raise self.group.rank_error(r, msg)
            raise self.group.dead_rank() or dead  # the one killed, if it has been seen since

    def _send(self, rank: int, msg: tuple) -> None:
        try:
            self.group.requests[rank].put(msg)
        except (OSError, ValueError):  # the group is being closed
            pass

    def _reply(self, rank: int):
        """One message from ``rank`` (None after a poll without one); progress, heads and
        errors are handled here."""
        self._check_group()
        try:
            msg = self.group.replies[rank].get(timeout=POLL_S)
        except queue.Empty:
            # no beat: a rank that hangs (no progress, no exit) must show as this worker's stall,
            # as a one-GPU target's hung forward does
            return None
        except (OSError, EOFError, ValueError):
            # the rank ended while handing over a tensor (or the queue was closed): the teardown
            # ended the group, or the rank died
            time.sleep(POLL_S)
            self._check_group()
            raise GroupRankFailed(f"target group {self.group.index} rank {rank}: its reply "
                                  "queue broke while the rank was alive") from None
        kind = msg[0]
        if kind == "error":
            raise self.group.rank_error(rank, msg)
        if kind == "progress":
            self.heartbeats.beat("loading weights")
            self.publish(LoadProgress(worker=self.row_name(rank),
                                      device=self.group.label(rank), **msg[1]))
            return None
        if kind == "heads":
            config = load_target_config(self.group.target_path, self.group.trust_remote_code)
            self.group.heads = TargetHeads(config, msg[2], msg[3])
            self.group.heads_ready.set()
            return None
        return msg

    def _features_split(self, batch, splits: int) -> torch.Tensor:
        """The batch's features from the group (``splits`` is the ranks' own business: they
        agree on it among themselves)."""
        self.seq += 1
        self.heartbeats.beat(f"forward on ranks {self.ranks} of target group {self.group.index}")
        ids, mask = batch.input_ids.clone(), batch.attention_mask.clone()
        for r in self.ranks:
            self._send(r, ("batch", self.seq, ids, mask))
        source = self.ranks[0]
        while True:
            msg = self._reply(source)
            if len(self.ranks) > 1:
                for r in self.ranks[1:]:  # the others speak only to fail
                    try:
                        other = self.group.replies[r].get_nowait()
                    except queue.Empty:
                        continue
                    if other[0] == "error":
                        raise self.group.rank_error(r, other)
            if msg is None:
                continue
            if msg[0] != "features" or msg[1] != self.seq:
                raise GroupRankFailed(f"target group {self.group.index} rank {source}: "
                                      f"expected features {self.seq}, got {msg[:2]}")
            received = msg[2]
            own = torch.empty_like(received)
            own.copy_(received)
            if own.is_cuda:
                torch.cuda.current_stream(own.device).synchronize()
            del received, msg
            self._send(source, ("ack", self.seq))
            return own
