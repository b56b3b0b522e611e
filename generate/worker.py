"""The generator's work: corrupt rows with the frozen auxiliary model and write one shard.

`Corruptor` loads the aux model once and is then a pure `batch -> batch`
function (paper section 3: mask, aux forward, sample at temperature T, label),
unit-tested without Ray. `ShardWriter` turns one (epoch, shard) task into one
Parquet file. The Ray actor in `generate/job.py` only wraps these two.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from common.batching import attention_mask, length_batches, pad_rows
from common.checkpoint import load_aux
from common.curriculum import choose_masked_positions, row_rng, rtd_labels, sample_replacements
from common.shards import SHARD_ENCODING, SHARD_SCHEMA, int_lists, write_parquet
from common.tokenizer import MASK_ID


@dataclass
class ShardTask:
    """One unit of work: rows `row_ids` of the corpus split, at stream positions
    `stream_start ...`, written to `path` (relative to the output folder)."""
    epoch: int
    shard_index: int
    split: str
    stream_start: int
    row_ids: np.ndarray
    temperatures: np.ndarray
    path: str


class Corruptor:
    """Frozen aux model -> corrupted ids and RTD labels for a batch of rows."""

    def __init__(self, aux_path: str | Path, seed: int, mask_prob: float, batch_tokens: int, device: str = "cpu"):
        self.device = torch.device(device)
        self.model, self.aux_meta = load_aux(aux_path, map_location=self.device)
        self.seed, self.mask_prob, self.batch_tokens = seed, mask_prob, batch_tokens
        # bf16 autocast for the aux forward on GPU; softmax and sampling stay in fp32.
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else None

    def masked_batches(self, rows: list[np.ndarray], row_ids: np.ndarray, epoch: int):
        """Per-row masked positions and uniforms, and the length-grouped model inputs as a list of
        (row indices, input ids, attention mask, masked flags) on the device."""
        positions, uniforms = [], []
        for r, rid in zip(rows, row_ids):
            rng = row_rng(self.seed, epoch, int(rid))
            pos = choose_masked_positions(r, self.mask_prob, rng)
            positions.append(pos)
            uniforms.append(rng.random(len(pos)))
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        batches = []
        for batch in length_batches(lengths, self.batch_tokens):
            masked_rows = []
            for i in batch:
                m = rows[i].copy()
                m[positions[i]] = MASK_ID
                masked_rows.append(m)
            ids = pad_rows(masked_rows).to(self.device)
            attn = attention_mask(lengths[batch], ids.shape[1]).to(self.device)
            flags = torch.zeros(ids.shape, dtype=torch.bool)
            for j, i in enumerate(batch):
                flags[j, torch.from_numpy(positions[i])] = True
            batches.append((batch, ids, attn, flags.to(self.device)))
        return positions, uniforms, batches

    def aux_logits(self, ids, attn, flags) -> torch.Tensor:
        if self.autocast is not None:
            with self.autocast:
                return self.model(ids, attn, flags)
        return self.model(ids, attn, flags)

    @torch.no_grad()
    def __call__(self, rows: list[np.ndarray], row_ids: np.ndarray, epoch: int, temperatures: np.ndarray) -> dict:
        """Corrupt `rows` (original ids). Returns per-row corrupted ids and labels plus counts:
        masked positions, replaced positions, aux top-1 hits at masked positions."""
        positions, uniforms, batches = self.masked_batches(rows, row_ids, epoch)
        corrupted = [r.astype(np.int32, copy=True) for r in rows]
        top1_hits = 0
        for batch, ids, attn, flags in batches:
            logits = self.aux_logits(ids, attn, flags)
            counts = [len(positions[i]) for i in batch]
            temps = torch.from_numpy(np.repeat(temperatures[batch].astype(np.float32), counts)).to(self.device)
            u = torch.from_numpy(np.concatenate([uniforms[i] for i in batch])).to(self.device)
            sampled = sample_replacements(logits, temps, u).cpu().numpy()
            originals = np.concatenate([rows[i][positions[i]] for i in batch])
            top1_hits += int((logits.argmax(-1).cpu().numpy() == originals).sum())
            offset = 0
            for i, k in zip(batch, counts):
                corrupted[i][positions[i]] = sampled[offset:offset + k]
                offset += k
        labels = [rtd_labels(r, c) for r, c in zip(rows, corrupted)]
        return {
            "input_ids": corrupted,
            "labels": labels,
            "masked": int(sum(len(p) for p in positions)),
            "replaced": int(sum(int(l.sum()) for l in labels)),
            "aux_top1": top1_hits,
        }


class ShardWriter:
    """Holds the corpus rows (anything indexable by row id: a list, or the memory-mapped
    `common.corpus.SplitRows`) and a Corruptor; turns a ShardTask into a Parquet file."""

    def __init__(self, corpus_rows: dict, corruptor: Corruptor, out_dir: str | Path, zstd_level: int = 19):
        self.rows = corpus_rows
        self.corruptor = corruptor
        self.out_dir = Path(out_dir)
        self.zstd_level = zstd_level

    def __call__(self, task: ShardTask) -> dict:
        t0 = time.time()
        source = self.rows[task.split]
        rows = [source[i] for i in task.row_ids]
        out = self.corruptor(rows, task.row_ids, task.epoch, task.temperatures)
        num = len(rows)
        columns = {
            "stream_index": pa.array(np.arange(task.stream_start, task.stream_start + num, dtype=np.int64)),
            "row_id": pa.array(np.asarray(task.row_ids, dtype=np.int64)),
            "temperature": pa.array(task.temperatures.astype(np.float32)),
            "input_ids": int_lists(out["input_ids"], pa.int32()),
            "labels": int_lists(out["labels"], pa.bool_()),
        }
        info = write_parquet(self.out_dir / task.path, columns, SHARD_SCHEMA, SHARD_ENCODING, self.zstd_level)
        tokens = int(sum(len(r) for r in rows))
        return {
            "path": task.path, "epoch": task.epoch, "shard_index": task.shard_index,
            "rows": num, "tokens": tokens, **info,
            "stream_start": task.stream_start,
            "temperature_min": float(task.temperatures.min()), "temperature_max": float(task.temperatures.max()),
            "masked": out["masked"], "replaced": out["replaced"], "aux_top1": out["aux_top1"],
            "seconds": time.time() - t0,
        }
