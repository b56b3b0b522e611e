"""Shard schema and I/O: round trip with the declared schema, atomic writes."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.io import atomic_path, sha256_file
from common.shards import SHARD_ENCODING, SHARD_SCHEMA, int_lists, list_column, read_parquet, write_parquet


def test_shard_round_trip_with_declared_schema(tmp_path):
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 8000, size=n).astype(np.int32) for n in (5, 128, 17)]
    labels = [rng.random(len(i)) < 0.2 for i in ids]
    path = tmp_path / "epoch-000" / "shard-00000.parquet"
    info = write_parquet(path, {
        "stream_index": pa.array(np.arange(10, 13, dtype=np.int64)),
        "row_id": pa.array(np.array([4, 2, 9], dtype=np.int64)),
        "temperature": pa.array(np.array([2.0, 1.5, 1.0], dtype=np.float32)),
        "input_ids": int_lists(ids, pa.int32()),
        "labels": int_lists(labels, pa.bool_()),
    }, SHARD_SCHEMA, SHARD_ENCODING, 19)
    assert info == {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    assert [p.name for p in path.parent.iterdir()] == ["shard-00000.parquet"]  # no temporary left behind
    table = read_parquet(path, SHARD_SCHEMA)
    assert table.schema.equals(SHARD_SCHEMA, check_metadata=False)
    assert all(np.array_equal(a, b) for a, b in zip(list_column(table, "input_ids"), ids))
    got_labels = list_column(table, "labels")
    assert all(a.dtype == bool and np.array_equal(a, b) for a, b in zip(got_labels, labels))
    assert table.column("temperature").to_pylist() == [2.0, 1.5, 1.0]
    assert table.column("stream_index").to_pylist() == [10, 11, 12]


def test_reading_a_file_of_another_schema_fails(tmp_path):
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2]], pa.list_(pa.int64()))}), path)
    with pytest.raises(ValueError, match="schema"):
        read_parquet(path, SHARD_SCHEMA)


def test_a_write_that_fails_midway_leaves_nothing(tmp_path):
    path = tmp_path / "shard-00000.parquet"
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"PAR1 half a file")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []
    with atomic_path(path) as tmp:
        tmp.write_bytes(b"complete")
    assert [p.name for p in tmp_path.iterdir()] == [path.name] and path.read_bytes() == b"complete"
