"""The engine's side of a target group: its rank processes (TargetGroup) and one worker per
batch stream (GroupStage), which the pipeline runs as it runs a one-GPU TargetStage: it takes
batches from its prefetcher and puts features on the hs queue. Only the memory plan and the
screen's rows know that a copy spans several processes.

Features come back GPU to GPU on CUDA (CUDA IPC through torch.multiprocessing) and through
shared memory on the CPU. The engine copies them into memory of its own on the same device and
then acknowledges them, so the rank frees its buffer (at most ``RING`` held) and everything
downstream (the hs queue, the drafters' copies on side streams) handles tensors this process's
allocator owns, as it does for a one-GPU target.

A rank that fails sends its traceback; one that dies without a word (SIGKILL, the OOM killer) is
seen by the process watch within a second. Either fails the run naming the rank and its GPU, and
the teardown ends every rank of every group (stop, then terminate, then kill).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from dflash_core.models.target.config import load_target_config
from dflash_core.observe.events import LoadProgress, Log, WORKER_LOADING, WORKER_WARMUP
from dflash_core.pipeline.target_stage import TargetStage
from dflash_core.pipeline.workers import POLL_S, Stopped, use_device
from dflash_core.target_group.rank import RankArgs, main as rank_main
from dflash_core.target_group.split import SHARDED, GroupSplit

RING = 2  # features a rank keeps sent and unacknowledged (the engine acks after its copy)
INIT_TIMEOUT_S = 120.0  # the group forms within this, or the rank that is missing is named
STOP_GRACE_S = 3.0  # a rank asked to stop ends within this, else it is terminated, then killed


class GroupRankFailed(RuntimeError):
    """A rank of a target group failed or died; names the rank and its GPU."""

    def __init__(self, message: str, kind: str = "internal", hint: str = ""):
        super().__init__(message)
        self.error_kind = kind
        self.hint = hint or ("the rank's log in the run folder has its whole output; "
                             "restart the run (r) once the cause is fixed")


class RankTraceback(Exception):
    """The traceback a rank sent, chained below GroupRankFailed so the error pane shows it."""


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class TargetHeads:
    """What the engine keeps of a target whose layers run in a group: its config, and the
    embedding and lm_head the drafter borrows (gathered whole by the ranks)."""

    def __init__(self, config, embed: torch.Tensor, head: torch.Tensor):
        self.model = SimpleNamespace(config=config)
        self.text_config = config.get_text_config()
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(head, requires_grad=False)
        self.hidden_size = self.text_config.hidden_size
        self.vocab_size = self.text_config.vocab_size
        self.num_layers = self.text_config.num_hidden_layers
        self.quantized = None
        self.runs_here = False  # no forward of the target runs in this process


class TargetGroup:
    """The k rank processes of one copy of the target."""

    def __init__(self, index: int, devices: list[torch.device], split: GroupSplit, *,
                 target_path: Path, dtype: str, attn_implementation: str, layer_ids: list[int],
                 last_hidden: bool, trust_remote_code: bool, distributed: dict, run_dir: Path,
                 publish):
        self.index, self.devices, self.split = index, devices, split
        self.publish = publish
        self.target_path, self.trust_remote_code = Path(target_path), trust_remote_code
        self.dtype = dtype if devices[0].type == "cuda" else "float32"
        self.attn, self.layer_ids, self.last_hidden = attn_implementation, layer_ids, last_hidden
        self.distributed, self.run_dir = distributed, Path(run_dir)
        self.procs: list = []
        self.requests: list = []
        self.replies: list = []
        self.closing = False
        self.heads: TargetHeads | None = None
        self.heads_ready = threading.Event()
        self.store_path = self.run_dir / f".target-group-{index}-{os.getpid()}-{time.time_ns()}"

    def gpu_label(self, rank: int) -> str:
        d = self.devices[rank]
        return f"cuda:{d.index}" if d.type == "cuda" else f"cpu:{self.index}.{rank}"

    def label(self, rank: int) -> str:
        """The screen's device column: the GPU, and which copy and rank it is."""
        return f"{self.gpu_label(rank)} copy {self.index} rank {rank}/{self.split.k}"

    def log_path(self, rank: int) -> Path:
        return self.run_dir / f"target-group-{self.index}-rank-{rank}.log"

    def start(self) -> None:
        """Spawn the ranks (from the run's supervisor thread, which outlives them)."""
        ctx = torch.multiprocessing.get_context("spawn")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for rank, dev in enumerate(self.devices):
            args = RankArgs(
                rank=rank, world=self.split.k, gpu=dev.index if dev.type == "cuda" else None,
                store_path=str(self.store_path), init_timeout_s=INIT_TIMEOUT_S,
                target_path=str(self.target_path), dtype=self.dtype,
                attn_implementation=self.attn, layer_ids=list(self.layer_ids),
                last_hidden=self.last_hidden, trust_remote_code=self.trust_remote_code,
                mode=self.split.mode, distributed=self.distributed, parent_pid=os.getpid(),
                log_path=str(self.log_path(rank)), ring=RING)
            req, rep = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=rank_main, args=(args, req, rep),
                               name=f"target-group-{self.index}-rank-{rank}", daemon=True)
            proc.start()
            self.procs.append(proc)
            self.requests.append(req)
            self.replies.append(rep)
        self.publish(Log(level="info", source=f"group-{self.index}", message=(
            f"target group {self.index}: {self.split.k} ranks on "
            f"{', '.join(self.gpu_label(r) for r in range(self.split.k))}, split "
            f"{self.split.describe('ep_size' in self.distributed)}, pids "
            f"{[p.pid for p in self.procs]} (logs: {self.log_path(0).name} ...)")))

    def dead_rank(self, besides: int | None = None) -> GroupRankFailed | None:
        """A rank (other than ``besides``) that has ended while the group was not being
        closed."""
        if self.closing:
            return None
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None and rank != besides:
                return GroupRankFailed(
                    f"target group {self.index} rank {rank} ({self.gpu_label(rank)}, pid "
                    f"{p.pid}) {_exit_text(p.exitcode)}", kind="cuda" if self.devices[0].type
                    == "cuda" and p.exitcode < 0 else "internal")
        return None

    def rank_error(self, rank: int, msg: tuple) -> GroupRankFailed:
        _, kind, message, tb, hint = msg
        # One rank's death makes the others fail inside their collectives (a reset connection,
        # a timeout): the dead one is the cause, so it is the one named.
        time.sleep(POLL_S)
        dead = self.dead_rank(besides=rank)
        if dead is not None:
            dead.args = (f"{dead.args[0]}; rank {rank} then failed: {message}",)
            dead.__cause__ = RankTraceback(tb)
            return dead
        err = GroupRankFailed(f"target group {self.index} rank {rank} ({self.gpu_label(rank)}) "
                              f"failed: {message}", kind=kind, hint=hint)
        err.__cause__ = RankTraceback(tb)
        return err

    def shutdown(self) -> list[str]:
        """End every rank: ask, then terminate, then kill. Returns what had to be forced."""
        self.closing = True
        forced = []
        for req in self.requests:
            try:
                req.put(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for rank, p in enumerate(self.procs):
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(1.0)
                forced.append(f"rank {rank} terminated")
            if p.is_alive():
                p.kill()
                p.join(1.0)
                forced[-1] = f"rank {rank} killed"
        for q in self.requests + self.replies:
            q.cancel_join_thread()
            q.close()
        try:
            self.store_path.unlink()
        except OSError:
            pass
        return forced


class GroupStage(TargetStage):
    """One batch stream of a target group, to the pipeline a target worker like any other: in
    sharded mode one per rank (``ranks`` = [r]), in shared mode one per copy (all its ranks get
    each batch, rank 0 sends the features)."""

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

    def row_name(self, rank: int) -> str:
        """The screen's row of a rank: this stream's name, or a sub-row for the other ranks of
        a shared copy."""
        return self.name if rank == self.ranks[0] else f"{self.name}.r{rank}"

    def run(self) -> str:
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
        from dflash_core.observe.events import WorkerStatus
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
            raise dead

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
