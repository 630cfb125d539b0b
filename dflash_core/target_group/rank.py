"""One rank of a target group: a process of its own, started by the engine (group.py) with
``torch.multiprocessing`` (spawn). It joins its group's own process world (a FileStore in the
run's folder, not a fixed port two runs could both take; its collectives still use TCP, on the
loopback only, on ports the kernel picks), loads its share of the target
through transformers' DistributedConfig, then turns the batches the engine sends into features
and sends them back.

Messages, engine -> rank (its request queue): ("batch", seq, input_ids, attention_mask),
("end",) when its batch stream is over, ("ack", seq) once the engine holds its own copy of
features ``seq``, ("stop",). Rank -> engine (its reply queue): ("progress", fields),
("loaded", bytes, seconds, note) (note: how rank 0 holds a quantized checkpoint's weights, a
models/target/fp8.QuantizedNote, else None), ("heads", config, embedding, lm_head) from rank 0,
("features", seq, tensor), ("done",), ("error", kind, message, traceback, hint).
Verify requests, ("verify", vseq, op, args), come on the same request queue at any time, during
the batch streams or after them; they are answered on the group's verify queue (verify.py).

Sharded mode: every rank its own batches, in lockstep, since FSDP gathers each layer from every
rank: each tick the ranks agree (one all-reduce on a gloo group) whether any has a batch; a rank
with none left runs a one-row dummy forward while the others finish. (No row groups: an
out-of-memory error inside a rank ends the run, since the others would be left inside a
collective.) Shared mode: every rank gets the same batch; rank 0 sends the features.

In either mode a tick first agrees whether any rank holds a verify request; if one does, every
rank takes its own copy of it (the engine sends each request to every rank) and they run it
together before any batch: a rank never waits for anything but its next request outside that
agreement (a batch is taken only once the ring has room for its features), so a verify is served
whether the engine is reading features or busy evaluating.

A rank never outlives the engine: the kernel kills it when the engine dies (PR_SET_PDEATHSIG on
Linux), and a watcher thread ends it if its parent changes.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

POLL_S = 0.25
EXIT_FLUSH_S = 1.0  # at most this long for the last messages to reach the engine's pipe
DUMMY_TOKENS = 8  # the dummy forward's length: any shape keeps FSDP's gathers in step


@dataclass
class RankArgs:
    """What a rank needs to start; pickled to the child."""

    rank: int
    world: int
    gpu: int | None  # None on the CPU
    store_path: str
    init_timeout_s: float
    target_path: str
    dtype: str
    attn_implementation: str
    layer_ids: list
    last_hidden: bool
    trust_remote_code: bool
    mode: str  # split.SHARDED | split.SHARED
    distributed: dict  # DistributedConfig's fields
    parent_pid: int
    log_path: str
    ring: int  # features sent and not yet acknowledged, at most


def _die_with_parent(parent_pid: int) -> None:
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the watcher below is the guard
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(POLL_S)
            if os.getppid() != parent_pid:
                os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _to_log(path: str) -> None:
    """transformers' progress bars and warnings go to the rank's log file, not the terminal the
    dashboard draws on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)


def _thread_lock_for_progress_bars() -> None:
    """tqdm (transformers' loading bars) takes a multiprocessing lock by default: a semaphore
    the rank's fast exit would leave to the resource tracker, which then warns of it on the
    terminal the dashboard draws on. A rank is one process: a thread lock does."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def main(args: RankArgs, requests, replies, verified=None) -> None:
    """The rank process's entry point; ``verified``: the group's verify queue (verify.py)."""
    _die_with_parent(args.parent_pid)
    _to_log(args.log_path)
    _thread_lock_for_progress_bars()
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stack, on request
    try:
        Rank(args, requests, replies, verified).run()
    except _Stopped:
        pass
    except BaseException as exc:  # noqa: BLE001: every failure goes to the engine, then exit 1
        kind = getattr(exc, "error_kind", None) or ("oom" if "OutOfMemoryError" in
                                                    type(exc).__name__ else "internal")
        error = ("error", kind, f"{type(exc).__name__}: {exc}", traceback.format_exc(),
                 getattr(exc, "hint", ""))
        replies.put(error)
        if verified is not None:  # the engine may be waiting on a verify reply, not on this
            verified.put(("rank-error", args.rank, error))
        print(traceback.format_exc(), flush=True)
        _exit((replies, verified), 1)
    _exit((replies, verified), 0)


def _exit(queues, code: int) -> None:
    """End the process once what it sent has reached the pipes, without the interpreter's
    teardown: that teardown (torch's and gloo's threads) takes seconds, past the engine's grace
    time, and a rank has nothing else to keep."""
    flushers = []
    for q in queues:
        if q is not None:
            q.close()
            flushers.append(threading.Thread(target=q.join_thread, daemon=True))
            flushers[-1].start()
    deadline = time.monotonic() + EXIT_FLUSH_S  # the engine may no longer read: a full pipe
    for t in flushers:                          # never holds us
        t.join(max(0.0, deadline - time.monotonic()))
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class _Stopped(Exception):
    pass


RESUME = "--resume (r on the dashboard) continues from the last checkpoint"


class GroupFormError(RuntimeError):
    error_kind = "cuda"

    def __init__(self, message: str):
        super().__init__(message)
        self.hint = ("a rank could not start (its log in the run folder says why: a GPU it "
                     f"cannot bind, memory); {RESUME} once the cause is fixed")


def form(store, rank: int, world: int, timeout_s: float) -> None:
    """Wait until every rank of the group has joined ``store``, at most ``timeout_s``: a rank
    that never comes is named by count, instead of a collective's timeout much later."""
    store.add("joined", 1)
    deadline = time.monotonic() + timeout_s
    while (joined := store.add("joined", 0)) < world:
        if time.monotonic() > deadline:
            raise GroupFormError(f"rank {rank}: the group did not form within {timeout_s:.0f} s:"
                                 f" {joined} of {world} ranks joined")
        time.sleep(0.05)


VERIFY = "verify"  # _next's answer while a verify request is pending


class Rank:
    def __init__(self, args: RankArgs, requests, replies, verified=None):
        self.args, self.requests, self.replies = args, requests, replies
        self.verified = verified
        self.held: dict[int, object] = {}  # features sent, kept until acknowledged
        self.ended = False  # this rank's batch stream is over
        self.stash: deque = deque()  # batches (and the stream's end) taken, not yet run
        self.verifies: deque = deque()  # verify requests taken, not yet run
        self.verifier = None  # verify.Verifier, once the model is loaded
        self.answer = None  # the last verify reply: kept until the engine asks again

    def run(self) -> None:
        import torch
        import torch.distributed as dist

        a = self.args
        os.environ.update(RANK=str(a.rank), WORLD_SIZE=str(a.world),
                          # transformers binds its device by LOCAL_RANK: the GPU's own index, so
                          # the engine and the rank number the GPUs alike (CUDA IPC needs it)
                          LOCAL_RANK=str(a.gpu if a.gpu is not None else a.rank),
                          LOCAL_WORLD_SIZE=str(a.world))
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(2, a.world * 2)))
        device = torch.device("cuda", a.gpu) if a.gpu is not None else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # The ranks' own connections (gloo's pairs, NCCL's bootstrap) on the loopback only:
        # nothing of a group listens beyond 127.0.0.1.
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, "lo")
        # Collectives wait on each other for long (a rank's stream may wait on a full hs queue);
        # the engine watches the processes themselves, and the rendezvous has its own limit.
        timeout = datetime.timedelta(days=1)
        store = dist.FileStore(a.store_path, a.world)
        form(store, a.rank, a.world, a.init_timeout_s)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store,
                                rank=a.rank, world_size=a.world, timeout=timeout,
                                **({"device_id": device} if device.type == "cuda" else {}))
        # Agreement between ticks is a few integers: on the CPU whatever the GPUs use.
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        from dflash_core.models.target.load import load_target
        t0 = time.monotonic()
        self.model = load_target(
            a.target_path, device=device, dtype=a.dtype,
            attn_implementation=a.attn_implementation, trust_remote_code=a.trust_remote_code,
            progress=lambda **f: self.replies.put(("progress", f)), distributed=a.distributed)
        # FSDP2's parameters cannot be used under inference mode
        self.model.inference_mode_ok = a.distributed.get("fsdp_size", 1) == 1
        if not self.model.inference_mode_ok:
            # FSDP settles its root at the first forward: through the whole model once (every
            # rank), or a first forward of the decoder alone finds several roots (the final norm
            # and lm_head are units of their own) and fails
            dummy = torch.zeros(1, DUMMY_TOKENS, dtype=torch.long, device=device)
            with torch.no_grad():
                self.model.model(input_ids=dummy, use_cache=False)
        self._send_heads()
        from dflash_core.target_group.verify import Verifier
        self.verifier = Verifier(self.model)
        self.replies.put(("loaded", self.model.memory_bytes(), time.monotonic() - t0,
                          self.model.quantized if a.rank == 0 else None))
        self.device = device
        if a.mode == "sharded":
            self._sharded_loop()
        else:
            self._shared_loop()
        self.replies.put(("done",))
        self._wait_stop()

    def _send_heads(self) -> None:
        """The embedding and lm_head, whole, for the drafter the engine builds (every rank takes
        part in gathering a sharded one; rank 0 sends)."""
        def whole(t):
            full = getattr(t, "full_tensor", None)
            return (full() if full is not None else t).detach().to("cpu").clone()
        embed = whole(self.model.embed_tokens.weight)
        head = whole(self.model.lm_head.weight)
        if self.args.rank == 0:
            self.replies.put(("heads", self.model.model.config.to_dict(), embed, head))

    # -- requests ------------------------------------------------------------------------------
    def _take(self, msg) -> None:
        """A request taken off the queue: acks and stop at once, the rest kept in order."""
        kind = msg[0]
        if kind == "ack":
            self.held.pop(msg[1], None)
        elif kind == "stop":
            raise _Stopped()
        elif kind == VERIFY:
            self.verifies.append(msg)
        else:  # a batch, or the stream's end
            self.stash.append(msg)

    def _next(self):
        """The next batch request once the ring has room for its features, None once this
        rank's stream is over (from then on at once: the other ranks may still have batches),
        or VERIFY while a verify request is pending; acks in between."""
        while True:
            if self.verifies:
                return VERIFY
            if self.stash and self.stash[0][0] == "end":
                self.stash.popleft()
                self.ended = True
            if self.stash and len(self.held) < self.args.ring:
                return self.stash.popleft()
            try:
                msg = self.requests.get(timeout=0 if self.ended and not self.stash else POLL_S)
            except queue.Empty:
                if self.ended and not self.stash:
                    return None
                continue
            self._take(msg)

    def _wait_stop(self) -> None:
        """After the streams: verify requests until stop."""
        while True:
            if self.verifies:
                self._verify()
                continue
            self._take(self.requests.get())

    def _verify(self) -> None:
        """Run the next verify request with the other ranks (each has its own copy of it; one
        not taken yet is waited for); rank 0 answers. The last answer is kept until the next
        request: the engine copies it first (CUDA IPC needs the sender's tensor alive)."""
        import torch

        while not self.verifies:
            self._take(self.requests.get())
        _, vseq, op, args = self.verifies.popleft()
        result = self.verifier.run(op, args)
        if self.args.rank != 0:
            return
        from dflash_core.target_group.verify import NO_REPLY
        if result is NO_REPLY:
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.answer = result
        self.verified.put(("verified", vseq, result))

    def _agree(self, msg):
        """This tick's agreement: (any rank has a batch, any has a verify pending); a batch
        taken before a verify goes back to wait for the next tick."""
        import torch
        import torch.distributed as dist

        verify = msg is VERIFY
        flags = torch.tensor([int(msg is not None and not verify), int(verify)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control)
        if flags[1] and msg is not None and not verify:
            self.stash.appendleft(msg)
        return bool(flags[0]), bool(flags[1])

    # -- forwards ------------------------------------------------------------------------------
    def _forward(self, ids, mask):
        return self.model.features(ids, mask, self.args.layer_ids,
                                   with_last_hidden=self.args.last_hidden)

    def _send(self, seq: int, feats) -> None:
        import torch
        if feats.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the engine's copy reads finished data
        self.held[seq] = feats
        self.replies.put(("features", seq, feats))

    def _sharded_loop(self) -> None:
        import torch

        while True:
            msg = self._next()
            batches, verify = self._agree(msg)
            if verify:
                self._verify()
                continue
            if not batches:
                return  # every rank's stream is over
            if msg is None:  # the others still have batches: one forward in step with theirs
                dummy = torch.zeros(1, DUMMY_TOKENS, dtype=torch.long)
                self._forward(dummy, torch.ones_like(dummy))
                continue
            _, seq, ids, mask = msg
            self._send(seq, self._forward(ids, mask))

    def _shared_loop(self) -> None:
        while True:
            msg = self._next()
            batches, verify = self._agree(msg)
            if verify:
                self._verify()
                continue
            if msg is None:
                if batches:  # every rank gets the same stream: one without a batch is a bug
                    raise RuntimeError(f"rank {self.args.rank}: the stream ended here while "
                                       "another rank of the copy has a batch")
                return
            _, seq, ids, mask = msg
            feats = self._forward(ids, mask)
            if self.args.rank == 0:
                self._send(seq, feats)
