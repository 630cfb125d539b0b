"""From samples to batches: the held-out split, length-bucketed token-budget plans per epoch, padded
``Batch`` tensors, and the resumable stream of a run's batches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from dflash_core.anchor_counts import anchors_for
from dflash_core.data.shards import MIN_LENGTH, DataError, ShardedDataset


def _rng(*keys: int) -> np.random.Generator:
    # masking keeps negative seeds valid for SeedSequence
    return np.random.default_rng([k & 0xFFFF_FFFF_FFFF_FFFF for k in keys])


def split_eval(dataset_len: int, n_eval: int, seed: int, *, lengths: np.ndarray | None = None,
               min_length: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic hold-out: (train_indices, eval_indices), both sorted, disjoint, covering all.

    With ``lengths``, eval samples are drawn only among samples of at least ``min_length`` tokens
    (long enough for a prompt plus something to decode)."""
    pool = np.arange(dataset_len)
    if lengths is not None and min_length > 0:
        pool = pool[np.asarray(lengths)[:dataset_len] >= min_length]
    if n_eval < 0:
        raise ValueError(f"n_eval must be >= 0, got {n_eval}")
    if n_eval > len(pool) or (n_eval and n_eval >= dataset_len):  # keep something to train on
        raise DataError(
            f"cannot hold out {n_eval} eval samples from {len(pool)} eligible of {dataset_len}",
            hint="lower data.eval_prompts, or use a larger data set")
    chosen = np.sort(_rng(seed, 0xE7A1).choice(pool, size=n_eval, replace=False))
    train = np.setdiff1d(np.arange(dataset_len), chosen, assume_unique=True)
    return train, chosen


def plan_epoch(lengths: np.ndarray, *, token_budget: int, max_seqs: int, max_length: int,
               seed: int, epoch: int, shard: tuple[int, int] = (0, 1),
               indices: np.ndarray | None = None, window: int = 8192,
               balance: int = 1, anchors: int = 0, per_1k: float = 0.0) -> list[list[int]]:
    """Length-bucketed batches of sample ids for one epoch.

    Samples (``indices``, default all) are shuffled, cut into windows of ``window`` samples, sorted
    by length inside each window (similar lengths -> little padding, while the window keeps the
    order random), and grouped greedily so that ``n * longest <= token_budget`` and
    ``n <= max_seqs``, with lengths truncated to ``max_length``. Samples shorter than 2 tokens are
    skipped. Batch order is shuffled; with ``balance`` > 1 (the batches one optimizer step takes
    across all drafters) it is shuffled in runs of similar drafter cost (``balanced_order``).
    Deterministic for (seed, epoch); ``shard=(rank, world)`` keeps global batches
    ``rank, rank + world, ...``.
    """
    if max_length > token_budget:
        raise ValueError(f"max_length {max_length} exceeds token_budget {token_budget}")
    if max_seqs <= 0 or token_budget <= 0 or window <= 0:
        raise ValueError("token_budget, max_seqs and window must be > 0")
    rank, world = shard
    lengths = np.asarray(lengths)
    ids = np.arange(len(lengths)) if indices is None else np.asarray(indices, dtype=np.int64)
    eff = np.minimum(lengths[ids], max_length)
    ids = ids[eff >= MIN_LENGTH]
    rng = _rng(seed, epoch)
    ids = ids[rng.permutation(len(ids))]
    eff = np.minimum(lengths[ids], max_length)

    batches: list[list[int]] = []
    for w0 in range(0, len(ids), window):
        w_ids, w_len = ids[w0:w0 + window], eff[w0:w0 + window]
        order = np.argsort(-w_len, kind="stable")  # longest first; ties keep the random order
        w_ids, w_len = w_ids[order], w_len[order]
        i = 0
        while i < len(w_ids):
            # the first sample is the longest of its batch, so it alone sets the padded width
            k = min(max_seqs, token_budget // int(w_len[i]))
            batches.append(w_ids[i:i + k].tolist())
            i += k
    order = rng.permutation(len(batches))
    if balance > 1:
        cost = [drafter_cost(len(b), int(lengths[b[0]]) if b else 0, max_length, anchors,
                             per_1k) for b in batches]
        order = balanced_order(order, np.asarray(cost), balance, _rng(seed, epoch, 0xBA1A))
    return [batches[j] for j in order][rank::world]


# Runs of similar-cost batches span this many optimizer steps, so targets a batch or two apart
# still hand the drafters of one step batches of the same run.
RUN_STEPS = 4


# A block position of a row of L tokens costs the drafter about (1 + L / CONTEXT_SCALE) times
# one of a very short row: its blocks attend to more context. Fitted to the 8B-shaped drafter's
# step times on an H200 at 256..3072 tokens (bench/BENCHMARKS.md, "Balanced steps").
CONTEXT_SCALE = 5800


def drafter_cost(rows: int, longest: int, max_length: int, anchors: int,
                 per_1k: float = 0.0) -> float:
    """A batch's drafter work, in block positions of a very short row: every row gets as many
    blocks as the batch's most-anchored row (up to ``anchors`` each, 0 = no cap; with a density
    ``per_1k``, anchor_counts.anchors_for of the longest), so rows x min(anchors, longest),
    each weighted by its context. Token-budget batches of short samples
    hold many rows: at the same budget they cost the drafter up to ~4x what batches of long
    samples do."""
    longest = min(longest, max_length)
    positions = rows * anchors_for(longest, anchors if anchors > 0 else longest, per_1k)
    return positions * (1.0 + longest / CONTEXT_SCALE)


def balanced_order(order: np.ndarray, cost: np.ndarray, group: int,
                   rng: np.random.Generator) -> np.ndarray:
    """``order`` (a random permutation of batch ids) rearranged so that every ``group``
    consecutive batches cost about the same: data-parallel drafters step together, so each step
    lasts as long as its dearest batch. Batches are sorted by cost (ties keep the random order),
    cut into runs of ``RUN_STEPS * group``, and the runs, and the batches inside each, shuffled."""
    by_cost = order[np.argsort(cost[order], kind="stable")]
    size = RUN_STEPS * group
    runs = [by_cost[i:i + size] for i in range(0, len(by_cost), size)]
    return np.concatenate([rng.permutation(runs[k]) for k in rng.permutation(len(runs))]) \
        if runs else order


def padding_fraction(batches: list[list[int]], lengths: np.ndarray, max_length: int) -> float:
    """Share of padded token slots that hold padding, over a plan."""
    lengths = np.asarray(lengths)
    useful = padded = 0
    for b in batches:
        eff = np.minimum(lengths[b], max_length)
        useful += int(eff.sum())
        padded += len(b) * int(eff.max())
    return 1.0 - useful / padded if padded else 0.0


@dataclass
class Batch:
    input_ids: torch.Tensor  # [n, L] int64, right-padded with 0
    loss_mask: torch.Tensor  # [n, L] int64 0/1, 0 on padding
    attention_mask: torch.Tensor  # [n, L] int64, 1 on real tokens
    lengths: torch.Tensor  # [n] int64, after truncation to max_length
    indices: list[int]  # sample ids in the data set
    epoch: int
    batch_index: int  # global index in the epoch's plan (shared by all workers)
    num_tokens: int  # real tokens
    padded_tokens: int  # n * L
    padding_frac: float
    # Made by the loader thread for the drafter (replica.prepare_batch): [n, A] anchors, -1
    # padded, and their [n, A, B] block labels, so the drafter's GPU never waits for host work.
    anchors: torch.Tensor | None = None
    labels: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Batch":
        opt = lambda t: None if t is None else fn(t)  # noqa: E731
        return replace(self, input_ids=fn(self.input_ids), loss_mask=fn(self.loss_mask),
                       attention_mask=fn(self.attention_mask), lengths=fn(self.lengths),
                       anchors=opt(self.anchors), labels=opt(self.labels))

    def pin(self) -> "Batch":
        """A copy in pinned memory (fast, asynchronous host-to-GPU copies); no-op without CUDA."""
        if not torch.cuda.is_available():
            return self
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))


def collate(dataset: ShardedDataset, indices: list[int], *, max_length: int, epoch: int = 0,
            batch_index: int = 0) -> Batch:
    """Read, truncate and right-pad samples into one Batch."""
    rows = [dataset.get(i) for i in indices]
    lens = np.array([min(len(ids), max_length) for ids, _ in rows], dtype=np.int64)
    n, width = len(rows), int(lens.max()) if rows else 0
    ids_np = np.zeros((n, width), np.int64)
    mask_np = np.zeros((n, width), np.int64)
    for r, ((ids, mask), k) in enumerate(zip(rows, lens)):
        ids_np[r, :k] = ids[:k]
        mask_np[r, :k] = mask[:k]
    attn = (np.arange(width)[None, :] < lens[:, None]).astype(np.int64)
    num, padded = int(lens.sum()), n * width
    return Batch(
        input_ids=torch.from_numpy(ids_np), loss_mask=torch.from_numpy(mask_np),
        attention_mask=torch.from_numpy(attn), lengths=torch.from_numpy(lens),
        indices=[int(i) for i in indices], epoch=epoch, batch_index=batch_index,
        num_tokens=num, padded_tokens=padded,
        padding_frac=1.0 - num / padded if padded else 0.0,
    )


class BatchStream:
    """The epochs of a run as Batches, resumable at batch granularity.

    Every worker plans the same global epoch (same seed, same lengths) and takes the batches with
    ``batch_index % world == rank``. Resuming with the set of batch indices already done in the
    start epoch gives the same sample order with nothing repeated and nothing lost.
    """

    def __init__(self, dataset: ShardedDataset, *, token_budget: int, max_seqs: int,
                 max_length: int, seed: int, epochs: int,
                 exclude: Iterable[int] | np.ndarray = (), window: int = 8192,
                 balance: int = 1, anchors: int = 0, per_1k: float = 0.0):
        self.dataset = dataset
        self.token_budget, self.max_seqs, self.max_length = token_budget, max_seqs, max_length
        self.seed, self.epochs, self.window = seed, epochs, window
        # plan_epoch's: batches per step, and the anchors that weigh a batch's cost
        self.balance, self.anchors, self.per_1k = balance, anchors, per_1k
        excl = np.fromiter(exclude, dtype=np.int64) if not isinstance(exclude, np.ndarray) \
            else exclude.astype(np.int64)
        self.indices = np.setdiff1d(np.arange(len(dataset)), excl)
        self._plans: OrderedDict[int, list[list[int]]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, dataset: ShardedDataset, data_cfg: Any, *, seed: int, epochs: int,
                    exclude: Iterable[int] | np.ndarray = (), step_batches: int = 1,
                    anchors: int = 0, per_1k: float = 0.0) -> "BatchStream":
        """From a ``DataConfig`` (token_budget, max_seqs_per_batch, max_length, balance_steps);
        ``step_batches``: batches one optimizer step takes over all drafters of all nodes."""
        return cls(dataset, token_budget=data_cfg.token_budget,
                   max_seqs=data_cfg.max_seqs_per_batch, max_length=data_cfg.max_length,
                   seed=seed, epochs=epochs, exclude=exclude,
                   balance=step_batches if data_cfg.balance_steps else 1, anchors=anchors,
                   per_1k=per_1k)

    def use_balance(self, balance: int) -> None:
        """Plan with another ``balance`` (a resumed run keeps the order its checkpoint's data
        position refers to). The batches are the same; only their order changes."""
        with self._lock:
            if balance != self.balance:
                self.balance = balance
                self._plans.clear()

    def plan(self, epoch: int) -> list[list[int]]:
        """The global plan of one epoch (cached: several workers ask for the same one)."""
        with self._lock:
            if epoch not in self._plans:
                self._plans[epoch] = plan_epoch(
                    self.dataset.lengths, token_budget=self.token_budget, max_seqs=self.max_seqs,
                    max_length=self.max_length, seed=self.seed, epoch=epoch,
                    indices=self.indices, window=self.window, balance=self.balance,
                    anchors=self.anchors, per_1k=self.per_1k)
                while len(self._plans) > 3:
                    self._plans.popitem(last=False)
            return self._plans[epoch]

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in epoch 0; later epochs differ by a few (windows are re-drawn)."""
        return len(self.plan(0))

    def total_batches(self) -> int:
        """Global batches over all epochs (plans every epoch: for LR schedules)."""
        return sum(len(self.plan(e)) for e in range(self.epochs))

    def padding_frac(self, epoch: int = 0) -> float:
        return padding_fraction(self.plan(epoch), self.dataset.lengths, self.max_length)

    def iter_batches(self, start_epoch: int = 0, done: set[int] | None = None,
                     worker: tuple[int, int] = (0, 1)) -> Iterator[Batch]:
        """This worker's batches from ``start_epoch`` on, skipping batch indices in ``done``
        (those of ``start_epoch`` already trained) for the start epoch only."""
        for epoch, bi in self.positions(start_epoch, done, [worker[0]], worker[1]):
            yield collate(self.dataset, self.plan(epoch)[bi], max_length=self.max_length,
                          epoch=epoch, batch_index=bi)

    def positions(self, start_epoch: int = 0, done: set[int] | None = None,
                  ranks: Iterable[int] = (0,), world: int = 1) -> Iterator[tuple[int, int]]:
        """(epoch, batch index) of every batch that workers ``ranks`` of ``world`` take
        (iter_batches of each), merged in plan order: the order a node's drafters should
        train them in."""
        done, ranks = done or set(), set(ranks)
        for epoch in range(start_epoch, self.epochs):
            for bi in range(len(self.plan(epoch))):
                if bi % world in ranks and not (epoch == start_epoch and bi in done):
                    yield epoch, bi
