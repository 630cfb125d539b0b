"""One target worker: load the frozen target on its GPU, then turn prefetched batches into
features of the chosen layers and hand them to the drafters through the hidden-state queue.

It reports as it goes: load progress per chunk, its own status (loading, warm-up, running; its
last one, done or stopped, the engine publishes from what ``run`` returns) and, once a second,
tokens/s and the shares of time it was blocked by a full queue or starved by an empty
prefetcher.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from dflash_core.data import Prefetcher
from dflash_core.observe.events import (
    WORKER_DONE, WORKER_LOADING, WORKER_RUNNING, WORKER_STOPPED, WORKER_WARMUP, LoadProgress, Log,
    TargetMetrics, WorkerStatus,
)
from dflash_core.models.training.handoff import ready_event
from dflash_core.pipeline.hs_queue import Handoff, HiddenStateQueue
from dflash_core.models.target.model import ForwardInterrupted, TargetModel
from dflash_core.models.target.load import load_target
from dflash_core.observe.watchdog import Heartbeats
from dflash_core.pipeline.workers import POLL_S, Stopped, UpstreamFailed, use_device

METRICS_EVERY_S = 1.0


class TargetStage:
    def __init__(self, rank: int, device: torch.device, label: str, *, target_path: Path,
                 dtype: str, attn_implementation: str, layer_ids: list[int],
                 prefetcher: Prefetcher, hs_queue: HiddenStateQueue,
                 publish: Callable[[Any], None], stop: threading.Event,
                 heartbeats: Heartbeats | None = None, last_hidden: bool = False,
                 trust_remote_code: bool = False):
        self.rank, self.device, self.label = rank, device, label
        self.trust_remote_code = trust_remote_code  # target.trust_remote_code
        self.name = f"target-{rank}"
        self.target_path, self.layer_ids = target_path, layer_ids
        # drafter.objective dspark: the features end with the post-norm last hidden state
        self.last_hidden = last_hidden
        # Targets run in the configured dtype on GPUs; CPU kernels want float32.
        self.dtype = dtype if device.type == "cuda" else "float32"
        self.attn_implementation = attn_implementation
        self.prefetcher, self.hs_queue = prefetcher, hs_queue
        self.publish, self.stop = publish, stop
        self.heartbeats = heartbeats or Heartbeats()
        self.model: TargetModel | None = None
        self.loaded = threading.Event()
        self.splits = 1  # row groups per forward; doubled after an out-of-memory error

    def _status(self, status: str, detail: str = "") -> None:
        self.publish(WorkerStatus(worker=self.name, role="target", device=self.label,
                                  status=status, detail=detail))

    def run(self) -> str:
        """Load, then forward until the data ends (returns WORKER_DONE) or the run stops
        (WORKER_STOPPED; a stop inside a forward or a full queue's wait raises Stopped)."""
        use_device(self.device)
        if self.device.type == "cuda":
            # Its own stream (a per-thread setting): on a GPU it shares with a drafter, its
            # forwards neither queue behind the drafter's step nor hold up the drafter's
            # collectives and copies, and the two can overlap.
            torch.cuda.set_stream(torch.cuda.Stream(self.device))
        self._status(WORKER_LOADING)
        self.model = load_target(self.target_path, device=self.device, dtype=self.dtype,
                                 attn_implementation=self.attn_implementation,
                                 trust_remote_code=self.trust_remote_code,
                                 progress=self._progress, stop=self.stop)
        self._say_quantized(self.model.quantized)
        self.loaded.set()
        self._status(WORKER_WARMUP, "first forward (kernel compilation)")
        self._forward_loop()
        self.hs_queue.producer_done()
        return WORKER_STOPPED if self.stop.is_set() else WORKER_DONE

    def _say_quantized(self, note) -> None:
        """What the load learnt of a quantized target's weights beyond preflight's line (which
        matmul runs them, or that they were loaded again dequantized), once per run."""
        if note is None or note.planned or self.rank != 0:
            return
        self.publish(Log(level="info" if note.kept else "warning", source=self.name,
                         message=note.line))

    def _progress(self, **fields) -> None:
        """load_target's progress: the event's fields but this worker's name and device."""
        self.heartbeats.beat("loading weights")
        self.publish(LoadProgress(worker=self.name, device=self.label, **fields))

    def _next_batch(self):
        """The next prefetched batch; None when the data is exhausted or the run stops."""
        while not self.stop.is_set():
            try:
                batch = self.prefetcher.get(timeout=POLL_S)
            except BaseException as exc:
                # The loader thread failed: name it, not this target.
                raise UpstreamFailed(f"loader-{self.rank}", "loader", exc) from exc
            if batch is not None:
                return batch
            self.heartbeats.beat("waiting for data")
            if self.prefetcher.exhausted:
                return None
        return None

    def _check_ids(self, batch) -> None:
        """Token ids outside the target's vocabulary are the data's fault (it was tokenized for
        another model): say so, naming the samples, instead of an embedding's IndexError."""
        vocab = self.model.vocab_size
        top, low = int(batch.input_ids.max()), int(batch.input_ids.min())
        if top < vocab and low >= 0:
            return
        from dflash_core.data import DataError
        bad = [i for i, row in zip(batch.indices, batch.input_ids)
               if int(row.max()) >= vocab or int(row.min()) < 0]
        raise DataError(
            f"token id {top if top >= vocab else low} is outside the target's vocabulary "
            f"(0..{vocab - 1}) in samples {bad[:8]} of data.path",
            hint="the data was tokenized with another tokenizer than the target's: re-tokenize "
                 "it with target.path's tokenizer, or set target.path to the model it was made "
                 "for")

    def _features(self, batch) -> torch.Tensor:
        """The batch's features, in ``self.splits`` row groups. An out-of-memory error doubles
        the split (kept for the rest of the run) and runs the same batch again; only a batch of
        one row that still does not fit fails the run."""
        while True:
            oom = ""
            try:
                return self._features_split(batch, self.splits)
            except torch.OutOfMemoryError as exc:
                oom = str(exc).splitlines()[0] if str(exc) else "out of memory"
                if self.splits >= len(batch.input_ids):
                    raise
            # Outside the except block: the forward's activations held by the traceback are
            # freed before the cache is emptied.
            old, self.splits = self.splits, min(self.splits * 2, len(batch.input_ids))
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.publish(Log(level="warning", source=self.name, message=(
                f"{self.name}: out of memory in a forward of {len(batch.input_ids)} sequences "
                f"split {old} way(s); now split {self.splits} ways, batch retried ({oom})")))

    def _features_split(self, batch, splits: int) -> torch.Tensor:
        if splits == 1:
            return self.model.features(batch.input_ids, batch.attention_mask, self.layer_ids,
                                       stop=self.stop, with_last_hidden=self.last_hidden)
        # Right-padded rows are independent: each group gives the same features it would give
        # inside the whole batch.
        parts = [self.model.features(ids, mask, self.layer_ids, stop=self.stop,
                                     with_last_hidden=self.last_hidden)
                 for ids, mask in zip(batch.input_ids.tensor_split(splits),
                                      batch.attention_mask.tensor_split(splits))]
        return torch.cat(parts)

    def _forward_loop(self) -> None:
        batches, tokens, blocked, starved = 0, 0, 0.0, 0.0
        window_t0 = time.monotonic()
        while not self.stop.is_set():
            t = time.monotonic()
            batch = self._next_batch()
            starved += time.monotonic() - t
            if batch is None:
                break
            self.heartbeats.beat("forward")
            self._check_ids(batch)
            try:
                feats = self._features(batch)
            except ForwardInterrupted:
                raise Stopped() from None
            if batches == 0:
                self._status(WORKER_RUNNING)
            blocked += self.hs_queue.put(Handoff(batch, feats, ready_event(feats)),
                                         producer=self.rank)
            batches += 1
            tokens += batch.num_tokens
            now = time.monotonic()
            if now - window_t0 >= METRICS_EVERY_S:
                span = now - window_t0
                self.publish(TargetMetrics(worker=self.name, device=self.label, batches=batches,
                                           tokens_per_s=tokens / span,
                                           blocked_frac=blocked / span,
                                           starved_frac=starved / span))
                tokens, blocked, starved, window_t0 = 0, 0.0, 0.0, now
