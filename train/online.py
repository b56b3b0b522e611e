"""`fast-online`: Fast-ELECTRA with the frozen aux model inside the training loop.

Paper section 3: the auxiliary model is fixed, so its corruption of a row depends only
on (seed, epoch, row, temperature). This stream computes, on demand, exactly the rows
the generator writes to the shards: the same plan (`common.plan`: epoch permutation,
per-row temperature) and the same `Corruptor` (masking, aux forward, fp32 sampling,
labels). It is the baseline that `fast-offline` removes the aux cost from, and a test
checks it feeds the main model the very same ids and labels as the shards.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from common.checkpoint import IncompatibleInputs, check_aux_matches_tokenizer, read_aux_meta
from common.config import RunConfig
from common.corpus import SplitRows, load_corpus_meta
from common.curriculum import VALID_EPOCH
from common.plan import epoch_curriculum, epoch_order, generation_key, stream_plan, validation_rows
from common.corrupt import Corruptor


class OnlineStream:
    """Rows [start, stop) of the training stream, corrupted now: the same dict as `ShardStream.rows`.
    Without a corruptor (`electra`), the original rows with their row ids and epochs."""

    def __init__(self, config: RunConfig, corpus_dir: Path, corruptor: Corruptor | None):
        meta = load_corpus_meta(corpus_dir)
        self.cfg, self.seed = config.generate, config.seed
        self.num_train = meta["train"]["rows"]
        plan = stream_plan(self.num_train, config)
        self.per_epoch, self.num_epochs, self.num_rows = plan.rows_per_epoch, plan.epochs, plan.total_rows
        self.corpus = SplitRows(corpus_dir, "train")
        self.corruptor = corruptor

    def _order(self, epoch: int):
        return epoch_order(self.num_train, epoch, self.seed)

    def rows(self, start: int, stop: int) -> dict:
        assert 0 <= start <= stop <= self.num_rows, (start, stop, self.num_rows)
        out = {"input_ids": [], "labels": [], "temperature": [], "stream_index": []}
        if self.corruptor is None:
            out = {"input_ids": [], "row_id": [], "epoch": [], "temperature": [], "stream_index": []}
        position = start
        while position < stop:
            epoch = position // self.per_epoch
            end = min(stop, (epoch + 1) * self.per_epoch)
            stream = np.arange(position, end, dtype=np.int64)
            row_ids = self._order(epoch)(stream - epoch * self.per_epoch)
            temperatures, gammas = epoch_curriculum(self.cfg, epoch, stream, self.num_rows, self.num_epochs)
            originals = [self.corpus[int(i)] for i in row_ids]
            if self.corruptor is None:
                out["input_ids"] += originals
                out["row_id"] += row_ids.tolist()
                out["epoch"] += [epoch] * len(row_ids)
            else:
                corrupted = self.corruptor(originals, row_ids, epoch, temperatures, gammas)
                out["input_ids"] += corrupted["input_ids"]
                out["labels"] += [label.astype(bool) for label in corrupted["labels"]]
            # electra's generator samples at T = 1 (train.objectives.ElectraPair): what its rows report
            out["temperature"].append(temperatures.astype(np.float32) if self.corruptor is not None
                                      else np.ones(len(stream), np.float32))
            out["stream_index"].append(stream)
            position = end
        out["temperature"] = np.concatenate(out["temperature"]) if out["temperature"] else np.zeros(0, np.float32)
        out["stream_index"] = np.concatenate(out["stream_index"]) if out["stream_index"] else np.zeros(0, np.int64)
        return out


class RowsInMemory:
    """A few already-corrupted rows (the validation split) behind the `rows(start, stop)` interface."""

    def __init__(self, data: dict):
        self.data, self.num_rows = data, len(data["input_ids"])

    def rows(self, start: int, stop: int) -> dict:
        return {k: v[start:stop] for k, v in self.data.items()}


def online_streams(config: RunConfig, corpus_dir: Path, aux_path: Path, device: str, corrupt: bool = True,
                   loaded=None) -> tuple:
    """(training stream, validation rows at T = 1, vocab size, data key) for `fast-online`, or with
    corrupt=False for `electra` (original training rows; validation rows still from the frozen aux
    model at T = 1, so every objective is scored on the same held-out rows). `loaded(corruptor)`: called once
    the aux model is loaded, before any row is corrupted (the trainer's memory pre-flight)."""
    meta = load_corpus_meta(corpus_dir)
    aux = read_aux_meta(aux_path)
    check_aux_matches_tokenizer(aux, aux_path, meta["vocab_size"], meta["tokenizer_sha256"], corpus_dir / "tokenizer.model")
    if meta["vocab_size"] != config.tokenizer.vocab_size or meta["max_seq_len"] != config.corpus.max_seq_len:
        raise IncompatibleInputs(f"corpus {corpus_dir} has vocabulary {meta['vocab_size']} / sequence length "
                                 f"{meta['max_seq_len']}, the manifest {config.tokenizer.vocab_size} / {config.corpus.max_seq_len}")
    g = config.generate
    corruptor = Corruptor.from_config(aux_path, config.seed, g, corpus_dir, device=device)
    if loaded is not None:
        loaded(corruptor)
    stream = OnlineStream(config, corpus_dir, corruptor if corrupt else None)
    valid_rows = SplitRows(corpus_dir, "valid")
    count = min(g.valid_rows, len(valid_rows)) if g.valid_rows else len(valid_rows)
    ids = validation_rows(np.arange(count), len(valid_rows), count)  # the generator's validation shard's rows
    corrupted = corruptor([valid_rows[int(i)] for i in ids], ids, VALID_EPOCH, np.ones(count))
    valid = RowsInMemory({"input_ids": corrupted["input_ids"], "labels": [l.astype(bool) for l in corrupted["labels"]],
                          "temperature": np.ones(count, np.float32), "stream_index": np.arange(count)})
    key = generation_key(config.seed, g, meta, aux["sha256"], stream.num_rows)
    return stream, valid, meta["vocab_size"], online_data_key(key, corrupt, torch.device(device).type)


def online_data_key(generation: str, corrupt: bool, device_kind: str) -> str:
    """What a checkpoint of an online run must resume on. With `corrupt`, the aux model's kernels on this device
    kind make every batch (bf16 on a GPU, fp32 on the CPU: other draws), as the shards' records name theirs: a run
    is not resumed on the other kind. CPU runs keep the key they had before the device counted."""
    identity = {"online": generation, "corrupt": corrupt}
    if corrupt and device_kind != "cpu":
        identity["device"] = device_kind
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()
