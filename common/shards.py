"""Parquet schemas of the packed corpus and of the generated shards, and their I/O.

Columns use native Arrow list types; every file is written atomically.

The shard encoding (ids in frequency order, BYTE_STREAM_SPLIT, labels bit-packed as list<bool>,
zstd at `[generate] zstd_level`: 19 by default, 15 for base and large) was chosen by measuring bytes per
token and seconds (docs/design.md, shard schema; docs/benchmarks.md, the zstd table).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common.io import atomic_path, sha256_file

FORMAT_VERSION = 2
# The index of a shard folder, written last (generate/generator.py), read by the trainer.
MANIFEST_FILE = "manifest.json"
# Written first: the generation key and every planned shard (a trainer follows the generation by it).
PLAN_FILE = "plan.json"
# One record per finished shard: path, rows, bytes, sha256, device, replaced counts (resume; `train --follow`).
PROGRESS_FILE = "progress.jsonl"


def stream_fingerprint(generation_key: str, shards: list, device: str) -> str:
    """Hash of what the trainer reads: the generation key (everything a shard's bytes depend on), every
    shard's path and rows in stream order (training shards, then validation), and the kind of device that
    made them (bf16 on GPU, fp32 on CPU). Known from plan.json and the first shard's record, so a run that
    follows the generation (`train --follow`) has the fingerprint of a run over the finished folder. A
    checkpoint records it (`data_manifest_sha256`); the trainer resumes and `make export` counts tokens by it."""
    blob = json.dumps({"generation_key": generation_key, "shards": [[p, int(r)] for p, r in shards],
                       "device": device})
    return hashlib.sha256(blob.encode()).hexdigest()


def data_fingerprint(manifest: dict) -> str:
    """`stream_fingerprint` of a finished folder's manifest."""
    shards = [(s["path"], s["rows"]) for e in manifest["epochs"] for s in e["shards"]]
    shards += [(s["path"], s["rows"]) for s in manifest["valid"]["shards"]]
    return stream_fingerprint(manifest.get("generation_key"), shards, ",".join(manifest.get("devices", [])))

# One packed sequence of the corpus: [CLS] tokens-of-one-document [SEP].
CORPUS_SCHEMA = pa.schema([
    pa.field("row_id", pa.int64(), nullable=False),
    pa.field("doc_id", pa.int32(), nullable=False),
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
])

# One corrupted row of an epoch, at the temperature of the training step that reads it.
SHARD_SCHEMA = pa.schema([
    pa.field("stream_index", pa.int64(), nullable=False),   # position in the training stream
    pa.field("row_id", pa.int64(), nullable=False),         # row of the packed corpus
    pa.field("temperature", pa.float32(), nullable=False),
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),  # corrupted sequence
    pa.field("labels", pa.list_(pa.bool_()), nullable=False),     # True = replaced
])
# Per-column Parquet encodings of a shard (all lossless; see the measurements above).
SHARD_ENCODING = {"stream_index": "DELTA_BINARY_PACKED", "temperature": "BYTE_STREAM_SPLIT",
                  "input_ids.list.element": "BYTE_STREAM_SPLIT"}


def write_parquet(path: str | Path, columns: dict, schema: pa.Schema, column_encoding: dict | None = None,
                  compression_level: int | None = None, row_group_rows: int = 0, first_row: int = 0) -> dict:
    """Write `columns` with `schema` atomically, in row groups of `row_group_rows` rows (0: one), every
    page with a CRC32 (`read_row_group` checks them); returns bytes and sha256 of the file. `first_row`: the
    stream position of the first row; the groups end where the stream's multiples of `row_group_rows` do
    (the first one shorter if it starts between two), so a trainer rank's slice of a batch is whole groups
    in every epoch, whatever an epoch's length (each epoch's shards start where the one before ended)."""
    table = pa.Table.from_pydict(columns, schema=schema)
    size = row_group_rows or max(1, table.num_rows)
    cuts = [0, *range(size - first_row % size if row_group_rows else size, table.num_rows, size), table.num_rows]
    with atomic_path(path) as tmp:  # on object storage: written locally, then uploaded in one put
        with pq.ParquetWriter(tmp, table.schema, compression="zstd", compression_level=compression_level,
                              use_dictionary=False, column_encoding=column_encoding, write_statistics=False,
                              store_schema=True, write_page_checksum=True) as writer:
            for lo, hi in zip(cuts, cuts[1:]):
                if hi > lo:
                    writer.write_table(table.slice(lo, hi - lo), row_group_size=hi - lo)
        info = {"bytes": Path(tmp).stat().st_size, "sha256": sha256_file(tmp)}
    return info


def open_parquet(path, schema: pa.Schema, source=None, metadata=None) -> pq.ParquetFile:
    """A Parquet file whose pages are checked against their CRC32 when read; its schema must be `schema`.
    `source`, `metadata`: an open file to read it from (an object's ranged reads) and its footer, already read."""
    file = pq.ParquetFile(source if source is not None else path, metadata=metadata, page_checksum_verification=True)
    got = {f.name: f.type for f in file.schema_arrow}
    want = {f.name: f.type for f in schema}
    if got != want:
        raise ValueError(f"{path}: schema {got} differs from the expected {want}")
    return file


def read_parquet(path: str | Path, schema: pa.Schema) -> pa.Table:
    """Read a file and check it has exactly `schema`'s columns and types."""
    table = pq.read_table(path)
    got = {f.name: f.type for f in table.schema}
    want = {f.name: f.type for f in schema}
    if got != want:
        raise ValueError(f"{path}: schema {got} differs from the expected {want}")
    return table


def list_column(table: pa.Table, name: str) -> list[np.ndarray]:
    """A list column as one numpy array per row (views into one flat buffer)."""
    column = table.column(name).combine_chunks()
    flat = column.values.to_numpy(zero_copy_only=False)
    offsets = column.offsets.to_numpy()
    return [flat[offsets[i]:offsets[i + 1]] for i in range(len(column))]


def int_lists(arrays: list[np.ndarray], pa_type: pa.DataType) -> pa.Array:
    """numpy arrays -> an Arrow list array (ints or bools), without a Python loop over tokens."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.zeros(0)
    dtype = bool if pa_type == pa.bool_() else pa_type.to_pandas_dtype()
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(dtype), type=pa_type))
