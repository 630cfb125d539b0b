"""The engine's side of a target group: its rank processes (TargetGroup), started, watched
and ended here, and what the engine keeps of the target they run (TargetHeads). The pipeline
reads a group's batch streams through pipeline/group_stage.GroupStage, a target worker like any
other; only the memory plan and the screen's rows know that a copy spans several processes.

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
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from dflash_core.observe.events import Log
from dflash_core.target_group.rank import POLL_S, RESUME, RankArgs, main as rank_main
from dflash_core.target_group.split import GroupSplit
from dflash_core.target_group.tracker import ensure_resource_tracker

RING = 2  # features a rank keeps sent and unacknowledged (the engine acks after its copy)
INIT_TIMEOUT_S = 120.0  # the group forms within this, or the rank that is missing is named
STOP_GRACE_S = 3.0  # a rank asked to stop ends within this, else it is terminated, then killed


class GroupRankFailed(RuntimeError):
    """A rank of a target group failed or died; names the rank and its GPU."""

    def __init__(self, message: str, kind: str = "internal", hint: str = "",
                 rank: int | None = None):
        super().__init__(message)
        self.rank = rank  # the rank that failed or died (None: the group as a whole)
        self.error_kind = kind
        self.hint = hint or ("the rank's log in the run folder has its whole output; "
                             f"{RESUME} once the cause is fixed")


def _death(code: int, cuda: bool) -> tuple[str, str]:
    """(error_kind, hint) of a rank that ended with exit code ``code`` unasked. SIGKILL is
    most often the kernel's out-of-memory killer: memory, not a bug (no traceback to show:
    the process had no chance to write one)."""
    if code == -signal.SIGKILL:
        return "oom", ("SIGKILL: on Linux most often the kernel's out-of-memory killer (dmesg "
                       f"says; the host's memory, not the GPU's), or a kill -9; {RESUME}")
    if cuda and code < 0:
        return "cuda", ""
    return "internal", ""


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


STORE_PREFIX = ".target-group-"


def remove_stale_stores(run_dir: Path) -> list[Path]:
    """Remove the rendezvous files (``STORE_PREFIX``-G-PID-NS) of engines no longer alive:
    a clean end removes its own, an engine killed (SIGKILL) cannot. Returns those removed."""
    removed = []
    for path in run_dir.glob(f"{STORE_PREFIX}*"):
        parts = path.name[len(STORE_PREFIX):].split("-")
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            os.kill(pid, 0)
            continue  # alive (or another's process of that number): left alone
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


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
        self.failed = False  # a stream reported the group's failure: the others just stop
        self._failed_lock = threading.Lock()
        self.heads: TargetHeads | None = None
        self.heads_ready = threading.Event()
        self.rows: dict[int, tuple[str, str]] = {}  # rank -> (the screen's row, its device)
        self.verified = None  # the verify queue: rank 0's answers, any rank's failure (remote.py)
        self.store_path = self.run_dir / f"{STORE_PREFIX}{index}-{os.getpid()}-{time.time_ns()}"

    def first_failure(self) -> bool:
        """True for the first stream to report this group's failure: one rank's death fails
        every stream of the copy, and one error says it."""
        with self._failed_lock:
            first, self.failed = not self.failed, True
            return first

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
        ensure_resource_tracker()  # before the first queue: under the dashboard stderr has no fd
        self.run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_stores(self.run_dir)
        self.verified = ctx.Queue()
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
            proc = ctx.Process(target=rank_main, args=(args, req, rep, self.verified),
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
        ended = [(rank, p) for rank, p in enumerate(self.procs)
                 if p.exitcode is not None and rank != besides]
        if not ended:
            return None
        # One rank's death makes the others fail in their collectives and exit 1 (their error
        # sent): a rank killed by a signal is the cause, whichever rank number ended first.
        rank, p = min(ended, key=lambda rp: (rp[1].exitcode >= 0, rp[0]))
        kind, hint = _death(p.exitcode, self.devices[0].type == "cuda")
        return GroupRankFailed(
            f"target group {self.index} rank {rank} ({self.gpu_label(rank)}, pid "
            f"{p.pid}) {_exit_text(p.exitcode)}", kind=kind, hint=hint, rank=rank)

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
                              f"failed: {message}", kind=kind, hint=hint, rank=rank)
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
