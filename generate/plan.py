"""What the generator must write: the (epoch, shard) tasks, their rows and temperatures.

A pure function of (corpus size, config, seed): the same plan on every machine,
for any worker count. Paper section 3 / DESIGN.md: T(u) = 1 + (T0-1) exp(-u/tau)
with u = global row index in the training stream / total rows of all epochs.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from common.config import GenerateConfig
from common.curriculum import VALID_EPOCH, row_fraction, temperature_at
from generate.worker import ShardTask


def rows_per_epoch(num_train_rows: int, cfg: GenerateConfig) -> int:
    return min(cfg.rows_per_epoch, num_train_rows) if cfg.rows_per_epoch else num_train_rows


def epoch_order(num_train_rows: int, epoch: int, num_rows: int, seed: int) -> np.ndarray:
    """The corpus rows of `epoch` in stream order: a seeded permutation, cut to `num_rows`."""
    return np.random.default_rng([seed, epoch, 0xE90C]).permutation(num_train_rows)[:num_rows]


def epoch_temperatures(cfg: GenerateConfig, epoch: int, stream_index: np.ndarray, total_rows: int) -> np.ndarray:
    """Temperature of each row: per row (default) or, the paper's coarser option, per epoch."""
    if cfg.temperature_granularity == "row":
        u = row_fraction(stream_index, total_rows)
    else:
        u = np.full(len(stream_index), epoch / cfg.epochs, dtype=np.float64)
    return temperature_at(u, cfg.t0, cfg.tau)


def plan_tasks(num_train_rows: int, num_valid_rows: int, cfg: GenerateConfig, seed: int) -> list[ShardTask]:
    """Validation shard first (T = 1), then every epoch's shards in stream order."""
    per_epoch = rows_per_epoch(num_train_rows, cfg)
    total = cfg.epochs * per_epoch
    valid_count = min(cfg.valid_rows, num_valid_rows) if cfg.valid_rows else num_valid_rows
    tasks = []
    for shard, start in enumerate(range(0, valid_count, cfg.rows_per_shard)):
        ids = np.arange(start, min(start + cfg.rows_per_shard, valid_count))
        tasks.append(ShardTask(VALID_EPOCH, shard, "valid", start, ids, np.ones(len(ids)),
                               f"valid/shard-{shard:05d}.parquet"))
    for epoch in range(cfg.epochs):
        order = epoch_order(num_train_rows, epoch, per_epoch, seed)
        for shard, start in enumerate(range(0, per_epoch, cfg.rows_per_shard)):
            ids = order[start:start + cfg.rows_per_shard]
            stream = epoch * per_epoch + start + np.arange(len(ids))
            tasks.append(ShardTask(epoch, shard, "train", int(stream[0]), ids,
                                   epoch_temperatures(cfg, epoch, stream, total),
                                   f"epoch-{epoch:03d}/shard-{shard:05d}.parquet"))
    return tasks


def generation_key(seed: int, cfg: GenerateConfig, corpus_meta: dict, aux_sha256: str) -> str:
    """Everything a shard's bytes depend on (DESIGN.md, determinism), hashed."""
    import dataclasses
    generate = dataclasses.asdict(cfg)  # threads_per_worker included: CPU kernels may round differently
    parts = {split: [p["sha256"] for p in corpus_meta[split]["parts"]] for split in ("train", "valid")}
    blob = {"seed": seed, "generate": generate, "tokenizer": corpus_meta["tokenizer_sha256"],
            "corpus_parts": parts, "aux": aux_sha256}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()
