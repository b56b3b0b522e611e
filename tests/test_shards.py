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


def test_each_rank_reads_only_its_own_rows_in_every_epoch_whatever_the_epochs_length(tmp_path):
    """Row groups end at the stream's multiples of rows_per_row_group, not at each shard's: an epoch of 1,000
    rows puts the second epoch's shards 8 rows off a 16-row grid, where groups cut from each shard's start
    made every rank slice of that epoch straddle two groups (each rank read and decompressed ~2x its rows)."""
    from common.config import GenerateConfig
    from common.plan import plan_tasks
    from train.data import ShardStream, rank_slice
    cfg = GenerateConfig(epochs=2, rows_per_epoch=1000, rows_per_shard=256, rows_per_row_group=16, valid_rows=0)
    tasks = [t for t in plan_tasks(1000, 0, cfg, seed=0) if t.split == "train"]
    assert [t.stream_start for t in tasks][3:6] == [768, 1000, 1256]  # the second epoch starts off the grid
    rng, records = np.random.default_rng(0), []
    for t in tasks:
        ids = [rng.integers(5, 300, size=8).astype(np.int32) for _ in range(t.count)]
        info = write_parquet(tmp_path / t.path, {
            "stream_index": pa.array(np.arange(t.stream_start, t.stream_start + t.count, dtype=np.int64)),
            "row_id": pa.array(np.arange(t.count, dtype=np.int64)),
            "temperature": pa.array(np.ones(t.count, np.float32)),
            "input_ids": int_lists(ids, pa.int32()), "labels": int_lists([i > 100 for i in ids], pa.bool_()),
        }, SHARD_SCHEMA, SHARD_ENCODING, 3, cfg.rows_per_row_group, t.stream_start)
        records.append({"path": t.path, "rows": t.count, **info})
    batch, world = 128, 8
    for rank in (0, 6):  # rank 6's slice of step 7 (rows 992..1007) spans the two epochs
        stream, loaded = ShardStream(tmp_path, records), {}
        real = stream._row_group

        def counted(k, g, real=real, loaded=loaded):  # rows of each row group the rank decompresses
            data = real(k, g)
            loaded[k, g] = len(data["stream_index"])
            return data
        stream._row_group = counted
        wanted = 0
        for step in range(2000 // batch):
            start, stop = rank_slice(step, batch, rank, world)
            assert stream.rows(start, stop)["stream_index"].tolist() == list(range(start, stop))
            wanted += stop - start
        assert sum(loaded.values()) == wanted  # rows decompressed = the rank's own, both epochs
