"""Data: shard round trips, validation errors, batch planning, resume, prefetch."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflash_core.data import (
    Batch, BatchStream, DataError, Prefetcher, ShardedDataset, collate, padding_fraction,
    plan_epoch, split_eval, write_shards,
)


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


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------

def test_roundtrip_save_to_disk_layout(tmp_path):
    samples = make_samples(25)
    files = write_shards(samples, tmp_path / "ds", samples_per_shard=7, batch_rows=3)
    assert [f.name for f in files] == [f"data-{k:05d}-of-00004.arrow" for k in range(4)]
    state = json.loads((tmp_path / "ds" / "state.json").read_text())
    assert [d["filename"] for d in state["_data_files"]] == [f.name for f in files]
    info = json.loads((tmp_path / "ds" / "dataset_info.json").read_text())
    assert set(info["features"]) == {"input_ids", "loss_mask"}
    # IPC stream format, as datasets writes it
    with pa.memory_map(str(files[0])) as src:
        assert pa.ipc.open_stream(src).read_all().num_rows == 7

    ds = ShardedDataset.open(tmp_path / "ds")
    assert ds.files == files
    assert ds.has_loss_mask
    assert_same(ds, samples)
    with pytest.raises(IndexError):
        ds.get(len(samples))


@pytest.mark.parametrize("fmt", ["arrow-file", "parquet"])
def test_roundtrip_other_formats(tmp_path, fmt):
    samples = make_samples(30, seed=1)
    files = write_shards(samples, tmp_path / "ds", samples_per_shard=11, batch_rows=4, fmt=fmt)
    assert len(files) == 3 and not (tmp_path / "ds" / "state.json").exists()
    if fmt == "arrow-file":
        with pa.memory_map(str(files[0])) as src:
            assert pa.ipc.open_file(src).num_record_batches == 3
    else:
        assert pq.ParquetFile(files[0]).num_row_groups == 3
    ds = ShardedDataset.open(tmp_path / "ds")
    assert_same(ds, samples)
    # random access order (parquet: row-group cache eviction) gives the same rows
    for i in np.random.default_rng(0).permutation(len(samples)):
        assert ds.get(i)[0].tolist() == samples[i]["input_ids"]


def test_missing_loss_mask_means_all_ones_and_bool_mask(tmp_path):
    # hand-written with pyarrow: int64 ids and no loss_mask, a single file path
    ids = [[5, 6, 7], [1], [2, 3]]
    t = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int64()))})
    pq.write_table(t, tmp_path / "a.parquet")
    ds = ShardedDataset.open(tmp_path / "a.parquet")
    assert not ds.has_loss_mask
    assert_same(ds, [{"input_ids": x} for x in ids])

    # a boolean loss_mask cannot be memory-viewed; it is still read correctly
    t = pa.table({"input_ids": pa.array(ids, pa.large_list(pa.int32())),
                  "loss_mask": pa.array([[True, False, True], [False], [True, True]])})
    with pa.OSFile(str(tmp_path / "b.arrow"), "wb") as f, pa.ipc.new_stream(f, t.schema) as w:
        w.write_table(t)
    ds = ShardedDataset.open(tmp_path / "b.arrow")
    assert ds.get(0)[1].tolist() == [1, 0, 1] and ds.get(2)[1].tolist() == [1, 1]


def test_open_memory_maps_instead_of_reading(tmp_path):
    samples = make_samples(20_000, seed=2, max_len=60)
    write_shards(samples, tmp_path / "ds", samples_per_shard=5000)
    before = pa.total_allocated_bytes()
    ds = ShardedDataset.open(tmp_path / "ds")
    size = sum(f.stat().st_size for f in ds.files)
    # Zero-copy views of the memory map: opening allocates (almost) nothing in Arrow's pool,
    # where reading the files would allocate about their size.
    assert pa.total_allocated_bytes() - before < size // 20
    assert ds.lengths.tolist() == [len(s["input_ids"]) for s in samples]
    for i in (0, 4999, 5000, 12345, 19999):
        ids, mask = ds.get(i)
        assert ids.tolist() == samples[i]["input_ids"]
        assert mask.tolist() == samples[i]["loss_mask"]


# ---------------------------------------------------------------------------------------------
# Bad data
# ---------------------------------------------------------------------------------------------

def _expect_data_error(path, *words):
    with pytest.raises(DataError) as info:
        ShardedDataset.open(path)
    err = info.value
    assert isinstance(err, ValueError) and err.error_kind == "data" and err.hint
    for w in words:
        assert w in str(err), str(err)
    return err


def test_corrupt_shard_is_named(tmp_path):
    write_shards(make_samples(5), tmp_path, fmt="arrow-file")
    (tmp_path / "zz-broken.arrow").write_bytes(np.random.default_rng(0).bytes(4096))
    _expect_data_error(tmp_path, "zz-broken.arrow", "Arrow")
    (tmp_path / "zz-broken.arrow").unlink()
    (tmp_path / "yy.parquet").write_bytes(b"not parquet at all")
    _expect_data_error(tmp_path, "yy.parquet", "Parquet")


def test_truncated_shard_is_named(tmp_path):
    files = write_shards(make_samples(50, max_len=200), tmp_path / "ds", batch_rows=10)
    data = files[0].read_bytes()
    files[0].write_bytes(data[: len(data) // 2])
    _expect_data_error(tmp_path / "ds", files[0].name)


def test_missing_input_ids_column(tmp_path):
    t = pa.table({"tokens": pa.array([[1, 2, 3]])})
    pq.write_table(t, tmp_path / "part-0.parquet")
    _expect_data_error(tmp_path, "part-0.parquet", "input_ids")


def test_mismatched_loss_mask_names_file_and_row(tmp_path):
    t = pa.table({"input_ids": pa.array([[1, 2, 3], [4, 5], [6, 7]]),
                  "loss_mask": pa.array([[1, 1, 1], [1, 1], [1, 1, 0]])})
    with pa.OSFile(str(tmp_path / "data-00000-of-00001.arrow"), "wb") as f, \
            pa.ipc.new_stream(f, t.schema) as w:
        w.write_table(t)
    err = _expect_data_error(tmp_path, "data-00000-of-00001.arrow", "row 2", "loss_mask")
    assert "3" in str(err) and "2" in str(err)


def test_non_integer_tokens(tmp_path):
    pq.write_table(pa.table({"input_ids": pa.array([[1.0, 2.0]])}), tmp_path / "f.parquet")
    _expect_data_error(tmp_path, "f.parquet", "double")
    pq.write_table(pa.table({"input_ids": pa.array(["hello"])}), tmp_path / "f.parquet")
    _expect_data_error(tmp_path, "f.parquet", "input_ids")


def test_empty_folder_and_missing_path(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no shards here")
    _expect_data_error(tmp_path / "empty", "empty", "no .arrow")
    _expect_data_error(tmp_path / "nope", "nope", "does not exist")


def test_state_json_lists_missing_shard(tmp_path):
    files = write_shards(make_samples(10), tmp_path, samples_per_shard=5)
    files[1].unlink()
    _expect_data_error(tmp_path, files[1].name, "missing")


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_respects_budget_and_covers_every_sample_once(seed):
    rng = np.random.default_rng(seed)
    n = 3000
    lengths = rng.integers(0, 900, n)
    lengths[rng.choice(n, 50)] = rng.integers(0, 2, 50)  # too short: skipped
    budget, max_seqs, max_length = int(rng.integers(512, 3000)), int(rng.integers(1, 40)), 512
    kw = dict(token_budget=budget, max_seqs=max_seqs, max_length=max_length, seed=seed,
              window=int(rng.integers(50, 1000)))
    plan = plan_epoch(lengths, epoch=0, **kw)
    eff = np.minimum(lengths, max_length)
    for b in plan:
        assert 1 <= len(b) <= max_seqs
        assert len(b) * eff[b].max() <= budget
    flat = [i for b in plan for i in b]
    assert sorted(flat) == np.flatnonzero(eff >= 2).tolist()  # each eligible sample exactly once

    assert plan_epoch(lengths, epoch=0, **kw) == plan  # deterministic
    assert plan_epoch(lengths, epoch=1, **kw) != plan  # reshuffled each epoch

    world = 3
    parts = [plan_epoch(lengths, epoch=0, shard=(r, world), **kw) for r in range(world)]
    assert all(parts) and sorted(i for p in parts for b in p for i in b) == sorted(flat)
    assert parts[1] == plan[1::world]


def test_plan_buckets_lengths_and_reports_padding():
    lengths = np.random.default_rng(0).integers(2, 2000, 5000)
    kw = dict(token_budget=8192, max_seqs=64, max_length=2048, seed=0, epoch=0)
    bucketed = plan_epoch(lengths, window=5000, **kw)
    # the same batch sizes filled at random, without sorting by length
    perm = np.random.default_rng(1).permutation(len(lengths)).tolist()
    cuts = np.cumsum([0] + [len(b) for b in bucketed])
    unsorted = [perm[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    pb = padding_fraction(bucketed, lengths, 2048)
    pu = padding_fraction(unsorted, lengths, 2048)
    assert 0 <= pb < 0.05 and pu > 0.3
    b = bucketed[0]
    manual = 1 - lengths[b].sum() / (len(b) * lengths[b].max())
    assert padding_fraction([b], lengths, 2048) == pytest.approx(manual)
    with pytest.raises(ValueError):
        plan_epoch(lengths, token_budget=100, max_seqs=4, max_length=200, seed=0, epoch=0)


def test_split_eval():
    train, ev = split_eval(100, 8, seed=3)
    assert len(ev) == 8 and len(train) == 92
    assert sorted(np.concatenate([train, ev]).tolist()) == list(range(100))
    again = split_eval(100, 8, seed=3)
    assert np.array_equal(again[1], ev) and np.array_equal(again[0], train)
    assert not np.array_equal(split_eval(100, 8, seed=4)[1], ev)
    assert len(split_eval(10, 0, seed=0)[0]) == 10
    lengths = np.arange(100)
    _, ev = split_eval(100, 5, seed=0, lengths=lengths, min_length=90)
    assert (ev >= 90).all()
    with pytest.raises(DataError):
        split_eval(10, 10, seed=0)


# ---------------------------------------------------------------------------------------------
# Batches and resume
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data") / "ds"
    write_shards(make_samples(400, seed=5, max_len=120), folder, samples_per_shard=150,
                 batch_rows=64)
    return ShardedDataset.open(folder)


def test_collate_pads_truncates_and_counts(dataset):
    idx = [3, 10, 42]
    b = collate(dataset, idx, max_length=50, epoch=2, batch_index=7)
    lens = [min(len(dataset.get(i)[0]), 50) for i in idx]
    width = max(lens)
    assert b.input_ids.shape == b.loss_mask.shape == b.attention_mask.shape == (3, width)
    assert b.input_ids.dtype == torch.long
    for r, i in enumerate(idx):
        ids, mask = dataset.get(i)
        k = lens[r]
        assert b.input_ids[r, :k].tolist() == ids[:k].tolist()
        assert b.loss_mask[r, :k].tolist() == mask[:k].tolist()
        assert b.input_ids[r, k:].eq(0).all() and b.loss_mask[r, k:].eq(0).all()
        assert b.attention_mask[r].sum().item() == k
    assert b.lengths.tolist() == lens and b.indices == idx
    assert (b.epoch, b.batch_index, b.num_tokens, b.padded_tokens) == (2, 7, sum(lens), 3 * width)
    assert b.padding_frac == pytest.approx(1 - sum(lens) / (3 * width))
    pinned = b.pin()
    assert torch.equal(pinned.input_ids, b.input_ids)
    if not torch.cuda.is_available():
        assert pinned is b


def _stream(dataset, **kw):
    args = dict(token_budget=600, max_seqs=8, max_length=100, seed=11, epochs=3)
    args.update(kw)
    return BatchStream(dataset, **args)


def test_stream_epochs_workers_and_exclude(dataset):
    exclude = {0, 1, 2, 399}
    stream = _stream(dataset, exclude=exclude)
    eligible = {i for i in range(len(dataset)) if dataset.lengths[i] >= 2} - exclude
    for world in (1, 3):
        for epoch in range(3):
            seen = []
            for rank in range(world):
                for b in stream.iter_batches(epoch, worker=(rank, world)):
                    if b.epoch != epoch:
                        break
                    assert b.batch_index % world == rank
                    assert b.indices == stream.plan(epoch)[b.batch_index]
                    assert b.num_tokens <= b.padded_tokens <= 600 and len(b) <= 8
                    seen += b.indices
            assert sorted(seen) == sorted(eligible)  # union over workers: everything, once
    assert stream.batches_per_epoch == len(stream.plan(0))
    assert stream.total_batches() == sum(len(stream.plan(e)) for e in range(3))
    assert 0 <= stream.padding_frac() < 1


def test_resume_yields_exactly_the_remaining_batches(dataset):
    stream = _stream(dataset)
    full = [(b.epoch, b.batch_index, b.indices) for b in stream.iter_batches(0)]
    assert [e for e, _, _ in full].count(0) == stream.batches_per_epoch
    # trained so far in epoch 1: an arbitrary subset (several workers finish out of order)
    n1 = len(stream.plan(1))
    done = set(np.random.default_rng(0).choice(n1, n1 // 2, replace=False).tolist())
    # a fresh stream (a restarted process) must plan the same epochs
    resumed = [(b.epoch, b.batch_index, b.indices)
               for b in _stream(dataset).iter_batches(1, done=done)]
    expected = [x for x in full if x[0] >= 1 and not (x[0] == 1 and x[1] in done)]
    assert resumed == expected


# ---------------------------------------------------------------------------------------------
# Prefetch
# ---------------------------------------------------------------------------------------------

def test_prefetcher_delivers_everything_in_order(dataset):
    depths = []
    stream = _stream(dataset, epochs=1)
    pf = Prefetcher(stream.iter_batches(0), capacity=3, pin=True,
                    on_depth=lambda d, c: depths.append((d, c)))
    got = []
    while True:
        b = pf.get(timeout=5)
        if b is None:
            break
        assert isinstance(b, Batch)
        got.append(b.batch_index)
    assert pf.exhausted and pf.error is None
    assert got == list(range(stream.batches_per_epoch))
    assert depths and all(c == 3 and 0 <= d <= 3 for d, c in depths)
    assert pf.close() and not pf.thread.is_alive()
    assert pf.get(timeout=0.1) is None  # stays exhausted


def test_prefetcher_close_when_blocked_on_full_queue():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    pf = Prefetcher(endless(), capacity=2)
    deadline = time.monotonic() + 5
    while pf.queue.qsize() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pf.queue.full()
    assert pf.get(timeout=1) == 0
    t0 = time.monotonic()
    assert pf.close(timeout=2.0)
    assert time.monotonic() - t0 < 2.0
    assert not pf.thread.is_alive()
    assert pf.thread not in threading.enumerate()


def test_prefetcher_propagates_source_error_and_times_out():
    def failing():
        yield "a"
        yield "b"
        raise DataError("shard went away", file="x.arrow", hint="fix it")

    pf = Prefetcher(failing(), capacity=4)
    items, err = [], None
    try:
        for _ in range(10):
            items.append(pf.get(timeout=2))
    except DataError as exc:
        err = exc
    assert err is not None and "x.arrow" in str(err) and pf.error is err
    assert set(items) <= {"a", "b"}
    assert pf.close()

    slow_started = threading.Event()

    def slow():
        slow_started.set()
        time.sleep(0.3)
        yield 1

    pf = Prefetcher(slow(), capacity=1)
    slow_started.wait(2)
    assert pf.get(timeout=0.05) is None and not pf.exhausted  # timeout, not the end
    assert pf.get() == 1  # no timeout: waits for the slow source
    assert pf.close()
