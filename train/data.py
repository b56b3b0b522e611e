"""Reading the generator's shards in manifest order (docs/design.md, trainer contract).

Global batch b at step s is rows [s*b, (s+1)*b) of the stream; rank r of W takes
its contiguous slice, and reads, decompresses and checks only the Parquet row groups
that hold it. Every shard's size is checked against the manifest at start; every page
it reads against its CRC32 (written by the generator), with the row count and stream
positions of each row group, before a row of it is used.
"""
from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.batching import attention_mask, pad_rows
from common.checkpoint import IncompatibleInputs
from common.config import RunConfig
from common.io import sha256_file
from common.shards import MANIFEST_FILE, SHARD_SCHEMA, data_fingerprint, list_column, open_parquet



class DataError(ValueError):
    """The shards are missing, damaged, or do not fit the trainer's config."""


def replaced_rate(manifest: dict) -> float:
    """Fraction of training tokens labelled replaced, from the manifest's per-epoch counts."""
    replaced = sum(e["replaced_fraction"] * e["masked_positions"] for e in manifest["epochs"])
    tokens = sum(e["tokens"] for e in manifest["epochs"])
    return min(max(replaced / max(tokens, 1), 1e-4), 1 - 1e-4)


def load_data_manifest(data_dir: str | Path, config: RunConfig) -> tuple[dict, str]:
    """Read manifest.json, check it against the config; returns (manifest, its data fingerprint)."""
    path = Path(data_dir) / MANIFEST_FILE
    if not path.is_file():
        raise DataError(f"{path} does not exist: run `make generate-epochs` (an unfinished generation has no manifest)")
    manifest = json.loads(path.read_text())
    if not config.aux.source and manifest["vocab_size"] != config.tokenizer.vocab_size:  # hf: its tokenizer's size
        raise IncompatibleInputs(f"shards in {data_dir} have vocabulary {manifest['vocab_size']} but the manifest "
                                 f"config has tokenizer.vocab_size = {config.tokenizer.vocab_size}")
    if manifest["max_seq_len"] != config.corpus.max_seq_len:
        raise IncompatibleInputs(f"shards in {data_dir} have sequence length {manifest['max_seq_len']} but the "
                                 f"manifest config has corpus.max_seq_len = {config.corpus.max_seq_len}")
    corpus_meta = Path(config.corpus_dir) / "corpus.json"  # the corpus whose tokenizer reads this run's model later
    if corpus_meta.is_file() and manifest.get("tokenizer_sha256"):
        ours = json.loads(corpus_meta.read_text()).get("tokenizer_sha256")
        if ours and ours != manifest["tokenizer_sha256"]:
            raise IncompatibleInputs(f"shards in {data_dir} were made with tokenizer {manifest['tokenizer_sha256'][:12]}, "
                                     f"but this run's corpus {config.corpus_dir} has tokenizer {ours[:12]}: fine-tuning "
                                     f"and export would read the model with the wrong ids (regenerate the shards, or "
                                     f"point work_dir / corpus.source at the corpus they were made from)")
    schema = [{"name": f.name, "type": str(f.type)} for f in SHARD_SCHEMA]
    if manifest["schema"] != schema:
        raise IncompatibleInputs(f"shards in {data_dir} have schema {manifest['schema']}, the trainer reads {schema}")
    return manifest, data_fingerprint(manifest)


@dataclass
class Shard:
    start: int  # stream index of its first row
    rows: int
    path: Path
    bytes: int
    sha256: str


class ShardStream:
    """Random access to rows [start, stop) of a stream of shards, read a row group at a time (the few
    last ones cached). `bytes_read` / `bytes_decompressed`: what this stream has read from disk (column
    chunks and footers) and decompressed, for the per-rank reading benchmark."""

    CACHED_ROW_GROUPS = 4

    def __init__(self, data_dir: str | Path, shard_records: list[dict]):
        self.shards, position = [], 0
        for record in shard_records:
            self.shards.append(Shard(position, record["rows"], Path(data_dir) / record["path"],
                                     record["bytes"], record["sha256"]))
            position += record["rows"]
        self.num_rows = position
        problems = [f"{s.path} is missing" if not s.path.is_file() else
                    f"{s.path} has {s.path.stat().st_size} bytes, the manifest says {s.bytes}"
                    for s in self.shards if not s.path.is_file() or s.path.stat().st_size != s.bytes]
        if problems:
            raise DataError("shards do not match the manifest: " + "; ".join(problems[:5]))
        self._starts = [s.start for s in self.shards]
        self._files: OrderedDict[int, tuple] = OrderedDict()  # shard -> (ParquetFile, row group starts)
        self._cache: OrderedDict[tuple, dict] = OrderedDict()
        self.bytes_read, self.bytes_decompressed = 0, 0

    def verify(self, rank: int = 0, world: int = 1, threads: int = 4) -> list[str]:
        """sha256 of every `world`-th shard from `rank` on, against the manifest, in threads (hashing
        releases the GIL); returns the problems found (`train.verify_shards`)."""
        mine = list(range(rank, len(self.shards), world))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            digests = list(pool.map(lambda k: sha256_file(self.shards[k].path), mine))
        return [f"{self.shards[k].path} has sha256 {digest[:12]}, the manifest says {self.shards[k].sha256[:12]}"
                for k, digest in zip(mine, digests) if digest != self.shards[k].sha256]

    def _file(self, k: int) -> tuple:
        """Shard k's open file and the first row of each of its row groups (its footer read once)."""
        if k in self._files:
            self._files.move_to_end(k)
            return self._files[k]
        shard = self.shards[k]
        try:
            file = open_parquet(shard.path, SHARD_SCHEMA)
        except Exception as e:  # noqa: BLE001 - any unreadable footer or schema is damage
            raise DataError(f"{shard.path} is damaged: {type(e).__name__}: {e}; run `make generate-epochs` "
                            f"(it redoes damaged shards), then train with --resume") from None
        meta = file.metadata
        counts = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        if sum(counts) != shard.rows:
            raise DataError(f"{shard.path} holds {sum(counts)} rows, the manifest says {shard.rows}")
        self.bytes_read += meta.serialized_size + 8  # the footer and its length and magic
        self._files[k] = (file, np.concatenate([[0], np.cumsum(counts)]))
        while len(self._files) > 2:
            self._files.popitem(last=False)
        return self._files[k]

    def _row_group(self, k: int, g: int) -> dict:
        key = (k, g)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        shard = self.shards[k]
        file, starts = self._file(k)
        try:
            table = file.read_row_group(g)
        except Exception as e:  # noqa: BLE001 - a page whose CRC32 or encoding is wrong
            raise DataError(f"{shard.path}: row group {g} (rows {shard.start + starts[g]}..{shard.start + starts[g + 1] - 1} "
                            f"of the stream) is damaged: {type(e).__name__}: {e}; run `make generate-epochs` (it "
                            f"redoes damaged shards), then train with --resume") from None
        group = file.metadata.row_group(g)
        self.bytes_read += sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        self.bytes_decompressed += group.total_byte_size
        data = {"input_ids": list_column(table, "input_ids"), "labels": list_column(table, "labels"),
                "temperature": table.column("temperature").to_numpy(),
                "stream_index": table.column("stream_index").to_numpy()}
        expected = shard.start + starts[g] + np.arange(table.num_rows)
        if table.num_rows != starts[g + 1] - starts[g] or not np.array_equal(data["stream_index"], expected):
            raise DataError(f"{shard.path}: row group {g}: rows or stream positions differ from the manifest")
        self._cache[key] = data
        while len(self._cache) > self.CACHED_ROW_GROUPS:
            self._cache.popitem(last=False)
        return data

    def rows(self, start: int, stop: int) -> dict:
        """Rows with stream index in [start, stop), in order."""
        assert 0 <= start <= stop <= self.num_rows, (start, stop, self.num_rows)
        out = {"input_ids": [], "labels": [], "temperature": [], "stream_index": []}
        position = start
        while position < stop:
            k = bisect.bisect_right(self._starts, position) - 1
            shard = self.shards[k]
            _, starts = self._file(k)
            g = int(np.searchsorted(starts, position - shard.start, side="right")) - 1
            data = self._row_group(k, g)
            first = shard.start + int(starts[g])
            lo, hi = position - first, min(stop, shard.start + int(starts[g + 1])) - first
            for key in out:
                out[key].extend(data[key][lo:hi])
            position = first + hi
        out["temperature"] = np.asarray(out["temperature"], dtype=np.float32)
        out["stream_index"] = np.asarray(out["stream_index"], dtype=np.int64)
        return out


def training_stream(data_dir: str | Path, manifest: dict) -> ShardStream:
    return ShardStream(data_dir, [s for e in manifest["epochs"] for s in e["shards"]])


def validation_stream(data_dir: str | Path, manifest: dict) -> ShardStream:
    return ShardStream(data_dir, manifest["valid"]["shards"])


def to_tensors(rows: dict) -> dict:
    """Padded tensors: input_ids (B, L) long, labels (B, L) float, attention_mask (B, L) bool."""
    lengths = [len(r) for r in rows["input_ids"]]
    ids = pad_rows(rows["input_ids"])
    return {"input_ids": ids, "labels": pad_rows(rows["labels"], 0, torch.float32),
            "attention_mask": attention_mask(lengths, ids.shape[1])}


def rank_slice(step: int, batch_size: int, rank: int, world: int) -> tuple[int, int]:
    """Stream rows [start, stop) that `rank` reads at `step` (contiguous slice of the global batch)."""
    per_rank = batch_size // world
    start = step * batch_size + rank * per_rank
    return start, start + per_rank
