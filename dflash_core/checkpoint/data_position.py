"""Where a run stands in its data: the batches each epoch has trained, the batches drafters hold
in a step not yet taken, and the position a resume starts from."""

from __future__ import annotations

from collections import defaultdict


class DataPosition:
    def __init__(self, batches_in_epoch, ranks: int, trainer_state: dict | None = None):
        """``batches_in_epoch(epoch)``: the number of batches of that epoch's plan.
        ``trainer_state``: a checkpoint's, to resume from (None: the start of epoch 0)."""
        self._batches_in_epoch = batches_in_epoch
        self._done: dict[int, set[int]] = defaultdict(set)
        # One list per drafter rank, each touched only by its own thread until the step.
        self._pending: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
        self.start_epoch, self.start_done = 0, set()
        if trainer_state is not None:
            self.start_epoch = int(trainer_state["epoch"])
            self.start_done = {int(i) for i in trainer_state["done"]}
            self._done[self.start_epoch] |= self.start_done

    def taken(self, rank: int, epoch: int, batch_index: int) -> None:
        """A drafter accumulated this batch into the step it is building."""
        self._pending[rank].append((epoch, batch_index))

    def commit(self) -> None:
        """The optimizer step happened: the batches it used are trained."""
        for pend in self._pending:
            for epoch, bi in pend:
                self._done[epoch].add(bi)
            pend.clear()

    def pending_batches(self) -> list[list[int]]:
        """[epoch, batch index] of every batch this process's drafters hold for the next step
        (what a node tells the others at the step boundary)."""
        return [[e, bi] for pend in self._pending for e, bi in pend]

    def mark_done(self, batches) -> None:
        """Batches other nodes trained in the step just taken: the position (and so the
        checkpoint node 0 writes) covers the whole run, not this node's share alone."""
        for epoch, bi in batches:
            self._done[int(epoch)].add(int(bi))

    def current_epoch(self) -> int:
        return max(self._done) if self._done else 0

    def resume_position(self) -> tuple[int, list[int]]:
        """The first epoch not fully trained and the batches of it already done."""
        for epoch in sorted(self._done):
            done = self._done[epoch]
            if len(done) < self._batches_in_epoch(epoch):
                return epoch, sorted(done)
        nxt = max(self._done) + 1 if self._done else 0
        return nxt, []
