"""Bounded series for the report: a multi-day run's millions of samples become at most ``cap``
points each (``Series``), and its errors or stalls the first and the last few (``FirstLast``)."""

from __future__ import annotations

import math
from collections import deque

DEFAULT_CAP = 2000  # points kept per series


class Series:
    """A bounded series of (x, y) points.

    Points come in order of x. Up to ``cap`` are kept one for one; past that, the series halves
    itself (neighbouring points merged) and from then on takes one point per ``stride`` input
    points, so it keeps between cap/2 and cap points spread over the whole run. ``mean``: a kept
    point is the mean of the points it stands for (loss, throughput, memory); otherwise it is the
    first of them, an exact value. The last, partly filled group is shown as well, so the latest
    value is never lost to the thinning. Non-finite y values (a NaN loss) are counted, not kept.
    """

    __slots__ = ("cap", "mean", "stride", "xs", "ys", "count", "nonfinite",
                 "_n", "_sx", "_sy")

    def __init__(self, cap: int = DEFAULT_CAP, mean: bool = True) -> None:
        self.cap = max(4, cap + (cap % 2))  # even, so a full series halves evenly
        self.mean = mean
        self.stride = 1
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.count = 0  # points added, all of them
        self.nonfinite = 0
        self._n = 0  # points in the group now being filled
        self._sx = self._sy = 0.0

    def add(self, x: float, y: float) -> None:
        if y is None or not math.isfinite(y):
            self.nonfinite += 1
            return
        self.count += 1
        if self.mean:
            self._sx += x
            self._sy += y
        elif self._n == 0:
            self._sx, self._sy = x, y
        self._n += 1
        if self._n < self.stride:
            return
        self.xs.append(self._sx / self._n if self.mean else self._sx)
        self.ys.append(self._sy / self._n if self.mean else self._sy)
        self._n, self._sx, self._sy = 0, 0.0, 0.0
        if len(self.xs) >= self.cap:
            self._halve()

    def _halve(self) -> None:
        if self.mean:
            self.xs = [(a + b) / 2 for a, b in zip(self.xs[::2], self.xs[1::2])]
            self.ys = [(a + b) / 2 for a, b in zip(self.ys[::2], self.ys[1::2])]
        else:
            self.xs, self.ys = self.xs[::2], self.ys[::2]
        self.stride *= 2

    def points(self) -> tuple[list[float], list[float]]:
        """The kept points and the last partial group: at most ``cap`` in all."""
        xs, ys = list(self.xs), list(self.ys)
        if self._n:
            xs.append(self._sx / self._n if self.mean else self._sx)
            ys.append(self._sy / self._n if self.mean else self._sy)
        return xs, ys

    def __len__(self) -> int:
        return len(self.xs) + (1 if self._n else 0)

    def last(self) -> float | None:
        _, ys = self.points()
        return ys[-1] if ys else None


class FirstLast:
    """The first ``first`` and the last ``last`` items of a stream, and how many there were: the
    root cause is usually among the first errors, the state now among the last."""

    def __init__(self, first: int, last: int) -> None:
        self.head: list = []
        self.tail: deque = deque(maxlen=last)
        self.first = first
        self.count = 0

    def add(self, item) -> None:
        self.count += 1
        if len(self.head) < self.first:
            self.head.append(item)
        else:
            self.tail.append(item)

    def items(self) -> list:
        return self.head + list(self.tail)

    @property
    def dropped(self) -> int:
        return self.count - len(self.head) - len(self.tail)

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)
