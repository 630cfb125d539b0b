"""A small Arrow data set shared by the batching and prefetch tests."""

from __future__ import annotations

import pytest

from dflash_core.data import ShardedDataset, write_shards

from tests.core.data.samples import make_samples


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data") / "ds"
    write_shards(make_samples(400, seed=5, max_len=120), folder, samples_per_shard=150,
                 batch_rows=64)
    return ShardedDataset.open(folder)
