"""Training data: tokenized shards on disk -> length-bucketed, token-budget batches -> a bounded
prefetch queue. Plain numpy/torch on the CPU; nothing here imports the engine.

- ``shards``: open and validate a data folder (Arrow memory-mapped, Parquet by row group);
- ``writing``: write shards in those layouts (the demo and the tests make their data so);
- ``batching``: the held-out split, per-epoch batch plans, padded ``Batch`` tensors, the
  resumable stream of a run's batches;
- ``prefetch``: the daemon thread that keeps ready batches ahead of the target workers.
"""

from dflash_core.data.batching import (
    Batch, BatchStream, collate, padding_fraction, plan_epoch, split_eval,
)
from dflash_core.data.prefetch import Prefetcher
from dflash_core.data.shards import IDS, MASK, MIN_LENGTH, DataError, ShardedDataset
from dflash_core.data.writing import write_shards

__all__ = [
    "Batch", "BatchStream", "DataError", "IDS", "MASK", "MIN_LENGTH", "Prefetcher",
    "ShardedDataset", "collate", "padding_fraction", "plan_epoch", "split_eval",
    "write_shards",
]
