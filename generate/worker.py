"""The generator's unit of work: one (epoch, shard) task -> one Parquet file.

`ShardWriter` reads a task's rows, corrupts them with `common.corrupt.Corruptor` and
writes the shard. The Ray actor in `generate/job.py` only wraps it.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from common.corrupt import Corruptor
from common.plan import ShardTask
from common.shards import SHARD_ENCODING, SHARD_SCHEMA, int_lists, write_parquet
from common.storage import location


class ShardWriter:
    """Holds the corpus rows ({"train": rows, "valid": rows}, each indexable by row id: a list, or the
    read by position: `common.corpus.SplitRows`) and a Corruptor; turns a ShardTask into a Parquet file."""

    def __init__(self, corpus_rows: dict, corruptor: Corruptor, out_dir: str | Path, zstd_level: int = 19,
                 row_group_rows: int = 0):
        self.rows = corpus_rows
        self.corruptor = corruptor
        self.out_dir = location(out_dir)  # a folder, or object storage (common.storage)
        self.zstd_level = zstd_level
        self.row_group_rows = row_group_rows

    def __call__(self, task: ShardTask, device_lock=None) -> dict:
        """Read, corrupt and write one shard. With `device_lock` (a GPU actor running two tasks at once),
        only the aux forward and sampling hold the lock: this shard's masking, labels and Parquet writing
        overlap with the other shard's model work. The record's `phase_seconds` says where the time went."""
        t0 = time.time()
        phases, last = {}, time.perf_counter()

        def phase(name):  # seconds since the previous phase ended
            nonlocal last
            now = time.perf_counter()
            phases[name], last = now - last, now

        source = self.rows[task.split]
        row_ids, (temperatures, gammas) = task.row_ids, task.curriculum()  # derived here, not held by the driver
        rows = [source[i] for i in row_ids]
        phase("read")
        prepared = self.corruptor.prepare(rows, row_ids, task.epoch, gammas)
        phase("prepare")
        with device_lock or contextlib.nullcontext():
            phase("wait")  # for the other shard's turn on the device
            sampled, top1_hits = self.corruptor.sample(prepared, rows, row_ids, task.epoch, temperatures, gammas)
            phase("device")
        out = self.corruptor.finish(rows, prepared, sampled, top1_hits)
        phase("finish")
        num = len(rows)
        columns = {
            "stream_index": pa.array(np.arange(task.stream_start, task.stream_start + num, dtype=np.int64)),
            "row_id": pa.array(np.asarray(row_ids, dtype=np.int64)),
            "temperature": pa.array(temperatures.astype(np.float32)),
            "input_ids": int_lists(out["input_ids"], pa.int32()),
            "labels": int_lists(out["labels"], pa.bool_()),
        }
        info = write_parquet(self.out_dir / task.path, columns, SHARD_SCHEMA, SHARD_ENCODING, self.zstd_level,
                             self.row_group_rows, task.stream_start)
        phase("write")
        tokens = int(sum(len(r) for r in rows))
        return {
            "path": task.path, "epoch": task.epoch, "shard_index": task.shard_index,
            "rows": num, "tokens": tokens, **info,
            "stream_start": task.stream_start,
            "temperature_min": float(temperatures.min()), "temperature_max": float(temperatures.max()),
            **({} if gammas is None else {"gamma_min": float(gammas.min()), "gamma_max": float(gammas.max())}),
            "masked": out["masked"], "replaced": out["replaced"], "aux_top1": out["aux_top1"],
            "seconds": time.time() - t0, "started_at": t0, "finished_at": time.time(),
            # where the shard's time went: reading its rows, masking, waiting for the device, the aux model and
            # sampling (device), labels, Parquet (columns, encoding, compression, hashing)
            "phase_seconds": phases,
        }


def mean_phases(records: list[dict]) -> dict:
    """Seconds a shard spent in each of ShardWriter's phases (its record's `phase_seconds`), the mean over
    `records` (those of an older run, without them, left out); {} if none has them."""
    timed = [r["phase_seconds"] for r in records if "phase_seconds" in r]
    return {name: sum(p[name] for p in timed) / len(timed) for name in timed[0]} if timed else {}
