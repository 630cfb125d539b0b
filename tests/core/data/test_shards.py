"""Shards written in every layout read back exactly; bad data is refused with the file named."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_core.data import DataError, ShardedDataset, write_shards

from tests.core.data.samples import assert_same, make_samples


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
