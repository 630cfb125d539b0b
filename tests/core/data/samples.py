"""Random samples and a check that a dataset holds exactly them."""

from __future__ import annotations

import numpy as np

from dflash_core.data import BatchStream, ShardedDataset


def make_samples(n: int, seed: int = 0, max_len: int = 40, min_len: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(min_len, max_len + 1))
        out.append({"input_ids": rng.integers(0, 50_000, k).tolist(),
                    "loss_mask": rng.integers(0, 2, k).tolist()})
    return out


def assert_same(ds: ShardedDataset, samples: list[dict]) -> None:
    assert len(ds) == len(samples)
    assert ds.lengths.tolist() == [len(s["input_ids"]) for s in samples]
    for i, s in enumerate(samples):
        ids, mask = ds.get(i)
        assert ids.dtype == np.int64 and mask.dtype == np.uint8
        assert ids.tolist() == s["input_ids"]
        assert mask.tolist() == s.get("loss_mask", [1] * len(s["input_ids"]))


def make_stream(dataset, **kw) -> BatchStream:
    """A BatchStream over ``dataset`` with small defaults, overridable."""
    args = dict(token_budget=600, max_seqs=8, max_length=100, seed=11, epochs=3)
    args.update(kw)
    return BatchStream(dataset, **args)
