"""`make corpus`: raw text -> tokenizer + packed sequences, streamed and parallel on Ray.

The source is cut into work units (`common.sources.write_units`) and read twice, each time by
Ray workers unit by unit, so memory does not grow with the corpus:
1. scan: each document's keyed hash (exact duplicates, and its train / validation split) and a
   seeded sample of paragraphs for the tokenizer, in proportion to the unit's bytes;
2. the driver drops every document whose hash an earlier one had (a bucket of hashes in memory at a
   time, `_decide`), trains the tokenizer on the bounded sample, and numbers the documents;
3. pack: each worker tokenizes its unit and packs it into its own part files per split (Parquet
   plus the memory-mappable token arrays the generator's actors read).
Everything is built in a staging folder next to the output: a killed build resumes there and
redoes only missing or damaged parts; `corpus.json` is written last and the folder replaces the
old corpus only when complete. A part's bytes depend on its unit, the tokenizer and the config,
never on the number of workers. Paper appendix A: sequences respect document boundaries.
"""
from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import time
from collections import deque
from pathlib import Path

import numpy as np
import pyarrow as pa

from common.config import RunConfig, config_to_dict, dump_toml
from common.corpus import (CORPUS_FORMAT, CORPUS_META, NpyAppender, file_limit, load_corpus_meta, npy_chunks,
                           npy_header, term_counts)
from common.storage import cache_folder, is_remote, location
from common.io import (DamagedFile, FolderLock, append_record, atomic_path, atomic_write_json, atomic_write_text,
                       disk_full, file_stamp, publish_folder, read_json, read_records, remove_stale_tmp, sha256_file,
                       tmp_path_for)
from common.shards import CORPUS_SCHEMA, FORMAT_VERSION
from common.sources import (SUFFIXES, CorpusError, LeftOut, SourceUnreadable, UnitRef, WorkUnit, blocks,
                            check_unchanged, compressed_ranges, document_hash, paragraphs, read_unit, source_files,
                            source_bytes, split_marker, write_units)
from common import hf
from common.parallel import NodeProblem
from common.tokenizer import CLS_ID, META_FILE, SEP_ID, Reserved, Tokenizer, open_tokenizer, train_tokenizer

SPLITS = ("train", "valid")
MAX_PARAGRAPH_CHARS = 8192  # a tokenizer sample line longer than this is cut (SentencePiece skips long ones)
# Fault injection for tests: seconds to sleep before packing each unit, so a build can be killed halfway.
SLOW_ENV = "FAST_ELECTRA_TEST_SECONDS_PER_UNIT"


def is_valid(doc_hash: int, valid_fraction: float) -> bool:
    """A document is held out when its hash falls in the first `valid_fraction` of the hash range."""
    return doc_hash < valid_fraction * 2.0**64


def valid_mask(hashes: np.ndarray, valid_fraction: float) -> np.ndarray:
    """`is_valid` of every uint64 hash at once, the same comparison made on integers (a hash turned into a
    float could round across the boundary): h < x exactly when h < ceil(x), for an integer h. One pass
    in numpy: the loop over documents cost about 90 s of the driver's time, all workers waiting, at 1 TB."""
    threshold = math.ceil(valid_fraction * 2.0**64)
    if threshold >= 2**64 or threshold <= 0:
        return np.full(len(hashes), threshold > 0, dtype=bool)
    return np.asarray(hashes, dtype=np.uint64) < np.uint64(threshold)


def unit_bytes(config: RunConfig) -> int:
    return max(1, int(config.corpus.unit_mb * 2**20))


def build_key(config: RunConfig, files) -> str:
    """What a corpus's bytes depend on: every source file (name, size, modification time; for a compressed file
    read in ranges, `split_marker`), the [corpus] and [tokenizer] settings, the seed and the format:
    the SHA-256 of `key_blob` as JSON with the files' list in it, hashed as the files come (a `SourceList` or a
    list), not held."""
    head, tail = json.dumps(key_blob(config), sort_keys=True).split(json.dumps(_FILES_HERE))
    digest = hashlib.sha256(head.encode() + b"[")
    size, total = unit_bytes(config), source_bytes(files)
    for i, f in enumerate(files):
        split = [split_marker(f)] if len(compressed_ranges(f, size, total)) > 2 else []  # units unlike a build's before
        digest.update((", " if i else "").encode() + json.dumps([f.name, f.size, f.mtime_ns, *split]).encode())
    digest.update(b"]" + tail.encode())
    return digest.hexdigest()


_FILES_HERE = "<the source files>"  # where key_blob's "files" go


def key_blob(config: RunConfig) -> dict:
    """build_key's inputs but the files ("files" holds a placeholder)."""
    blob = {"format": CORPUS_FORMAT, "files": _FILES_HERE,
            "corpus": {k: v for k, v in config_to_dict(config)["corpus"].items() if k != "source"},
            "tokenizer": config_to_dict(config)["tokenizer"], "seed": config.seed}
    source = hf.hf_dir(config.aux.source)
    if source is not None:  # an hf: aux model's tokenizer: its files, and the sample that orders its ids
        if not source.is_dir():
            raise CorpusError(f"[aux] source = {config.aux.source!r}: {source} is not a folder (a Hugging Face "
                              f"model directory: config, weights, tokenizer)")
        # split_special_tokens: a "[SEP]" written in the text is spelled out (hf.encode_text), where corpora
        # built before read it as the special token: their bytes differ, so they are rebuilt
        blob["tokenizer"] = {"hf": hf.tokenizer_sha256(source), "max_sentences": config.tokenizer.max_sentences,
                             "max_sample_mb": config.tokenizer.max_sample_mb, "split_special_tokens": True}
    return blob


# --- the two passes over a unit (run in Ray workers; pure functions of their arguments) ---------

KEPT_MESSAGES = 3  # a unit's scan keeps its first few bad documents' messages and counts them all: what the
# driver loads for every unit stays small however many documents a corpus of on_bad_input = "skip" leaves out


class BadDocuments:
    """The bad documents a read left out ([corpus] on_bad_input = "skip"): every one counted, the messages of
    the first `kept` kept (a list of them all grew with the file)."""

    def __init__(self, kept: int = KEPT_MESSAGES):
        self.messages, self.count, self.kept = [], 0, kept

    def append(self, message: str) -> None:
        self.count += 1
        if len(self.messages) < self.kept:
            self.messages.append(message)


# A unit's hashes and masks are written and read this many documents at a time: one gzip file is one unit,
# and its arrays whole (8 bytes a document, ~40 at the decision's peak) grew with the file, 40 GB at 1G documents.
UNIT_CHUNK_DOCS = 1 << 20


def scan_unit(unit: WorkUnit, hashes_path: str, text_column: str, seed: int, valid_fraction: float,
              sample_lines: int, skip_bad: bool = False, sample_bytes: float = math.inf,
              chunk_docs: int = UNIT_CHUNK_DOCS) -> dict:
    """Pass 1: every document's hash (to `hashes_path`, a .npy of uint64 written as the read goes) and split,
    and a seeded reservoir sample of `sample_lines` paragraphs of its training documents, as (document index,
    text), holding at most `sample_bytes` characters: past them, random entries leave and the reservoir
    shrinks to what fits. Memory: the sample and `chunk_docs` hashes, whatever the unit's size."""
    check_unchanged(unit)
    rng = random.Random(hash((seed, unit.index, 0x5CA)))  # Python ints hash the same in every process
    hashes, sample, seen, size, documents = array.array("Q"), [], 0, 0, 0  # 8 bytes a hash, flushed to `out`
    skipped = BadDocuments(KEPT_MESSAGES) if skip_bad else None
    out = NpyAppender(hashes_path, np.uint64)
    try:
        for i, doc in enumerate(read_unit(unit, text_column, skipped)):
            h = document_hash(doc.text, seed)
            hashes.append(h)
            documents += 1
            if len(hashes) >= chunk_docs:
                out.append(np.frombuffer(hashes, dtype=np.uint64))
                hashes = array.array("Q")
            if is_valid(h, valid_fraction):
                continue
            for k, block in enumerate(blocks(doc.text)):  # whitespace is collapsed for the chosen ones only
                seen += 1
                block = block[:4 * MAX_PARAGRAPH_CHARS]  # what is kept of it is at most MAX_PARAGRAPH_CHARS
                if len(sample) < sample_lines:
                    sample.append((i, k, block))
                    size += len(block)
                elif (j := rng.randrange(seen)) < sample_lines:
                    size += len(block) - len(sample[j][2])
                    sample[j] = (i, k, block)
                while size > sample_bytes and len(sample) > 1:  # bounded in characters too
                    size -= len(sample.pop(rng.randrange(len(sample)))[2])
                    sample_lines = len(sample)
        out.append(np.frombuffer(hashes, dtype=np.uint64))
        check_unchanged(unit)  # a file rewritten while it was read: hashes of two versions
        out.close()
    except BaseException:
        out.abort()
        raise
    sample.sort(key=lambda entry: entry[:2])  # document order
    sample = [(i, k, " ".join(block.split())[:MAX_PARAGRAPH_CHARS]) for i, k, block in sample]
    sample = [entry for entry in sample if entry[2]]
    return {"unit": unit.index, "documents": documents, "sample": sample,
            "skipped": [] if skipped is None else skipped.messages, "skipped_count": 0 if skipped is None else skipped.count}


def pack_document(ids: np.ndarray, max_seq_len: int, min_seq_len: int) -> list[np.ndarray]:
    """Cut one document's tokens (int32) into [CLS] ... [SEP] rows of at most `max_seq_len`; a last
    piece shorter than `min_seq_len` (with specials) is dropped. Never crosses documents."""
    body = max_seq_len - 2
    rows = []
    for start in range(0, len(ids), body):
        piece = ids[start:start + body]
        if len(piece) + 2 < min_seq_len:
            break
        row = np.empty(len(piece) + 2, dtype=np.int32)
        row[0], row[1:-1], row[-1] = CLS_ID, piece, SEP_ID
        rows.append(row)
    return rows


class PartWriter:
    """One unit's rows of one split, written as they come, so a unit of any size is packed in bounded
    memory: every `flush_rows` rows go to the Parquet part as a row group and to the flat token and
    offset arrays (`NpyAppender`s: the same bytes as `np.save`)."""

    FLUSH_ROWS = 16384

    def __init__(self, out: Path, split: str, unit: int, flush_rows: int = FLUSH_ROWS):
        self.out, self.name, self.flush_rows = out, f"{split}/part-{unit:05d}", flush_rows
        self.rows, self.doc_ids, self.count, self.tokens = [], [], 0, 0
        self.parquet = self.flat = None

    def add(self, rows: list[np.ndarray], doc_id: int) -> None:
        self.rows += rows
        self.doc_ids += [doc_id] * len(rows)
        if len(self.rows) >= self.flush_rows:
            self._flush()

    def _flush(self) -> None:
        import pyarrow.parquet as pq
        if not self.rows:
            return
        if self.parquet is None:
            (self.out / self.name).parent.mkdir(parents=True, exist_ok=True)
            self.parquet_tmp = tmp_path_for(self.out / f"{self.name}.parquet")
            self.parquet = pq.ParquetWriter(self.parquet_tmp, CORPUS_SCHEMA, **PARQUET_OPTIONS)
            self.flat = {kind: NpyAppender(self.out / f"{self.name}.{kind}.npy", dtype)
                         for kind, dtype in (("tokens", np.int32), ("offsets", np.int64))}
            self.flat["offsets"].append(np.zeros(1, np.int64))
        lengths = np.fromiter((len(r) for r in self.rows), dtype=np.int64, count=len(self.rows))
        offsets = np.zeros(len(self.rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(self.rows).astype(np.int32, copy=False)
        self.parquet.write_table(pa.table({
            "row_id": pa.array(np.arange(self.count, self.count + len(self.rows), dtype=np.int64)),
            "doc_id": pa.array(np.asarray(self.doc_ids, dtype=np.int32)),
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tokens))},
            schema=CORPUS_SCHEMA))
        self.flat["tokens"].append(tokens)
        self.flat["offsets"].append(offsets[1:] + self.tokens)
        self.count, self.tokens = self.count + len(self.rows), self.tokens + int(offsets[-1])
        self.rows, self.doc_ids = [], []

    def close(self) -> dict | None:
        """Publish the part (atomically, each file); its record, or None if it got no row."""
        self._flush()
        if self.parquet is None:
            return None
        self.parquet.close()
        records = {kind: appender.close() for kind, appender in self.flat.items()}
        final = self.out / f"{self.name}.parquet"
        with open(self.parquet_tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(self.parquet_tmp, final)
        records = {kind: {"path": f"{self.name}.{kind}.npy", "bytes": path.stat().st_size, "sha256": sha256_file(path)}
                   for kind, path in records.items()}
        return {"path": f"{self.name}.parquet", "rows": self.count, "tokens": self.tokens,
                "bytes": final.stat().st_size, "sha256": sha256_file(final), "flat": records}

    def abort(self) -> None:
        if self.parquet is not None:
            self.parquet.close()
            self.parquet_tmp.unlink(missing_ok=True)
            for appender in self.flat.values():
                appender.abort()


def pack_unit(unit: WorkUnit, text_column: str, out_dir: str, masks: tuple, doc_id_start: int, max_seq_len: int,
              min_seq_len: int, skip_bad: bool = False) -> dict:
    """Pass 2: tokenize the unit's kept documents and write its part files (one per non-empty split).
    `masks`: (the unit's first document's index, valid_fraction, `Decision.force`), which and how its
    documents are kept, read here from the driver's decision in `out_dir/scan/` (`UnitMasks`). Documents are
    tokenized a batch at a time (`ENCODE_BATCH_DOCS` of them, or `ENCODE_BATCH_CHARS`): one SentencePiece call
    a short document cost four times the encoding itself; each text is encoded alone either way."""
    time.sleep(float(os.environ.get(SLOW_ENV, "0")))
    check_unchanged(unit)
    out = Path(out_dir)
    flags = UnitMasks(out / "scan", unit.index, *masks)
    tok = open_tokenizer(out)
    writers = {s: PartWriter(out, s, unit.index) for s in SPLITS}  # rows leave memory every FLUSH_ROWS
    names, batch, batch_chars = [], [], 0
    documents, doc_id, encode_s = 0, doc_id_start, 0.0
    documents_path = out / "documents" / f"part-{unit.index:05d}.parquet"
    documents_path.parent.mkdir(parents=True, exist_ok=True)

    def encode_batch():  # the batch's documents tokenized, packed and handed to their split's part
        nonlocal encode_s, batch_chars
        t0 = time.perf_counter()
        pieces = tok.encode_native([text for _, _, texts in batch for text in texts])  # bench-corpus's limit
        encode_s += time.perf_counter() - t0
        first = 0
        for doc_id, split, texts in batch:
            ids = tok.to_ours(pieces[first:first + len(texts)])
            writers[split].add(pack_document(ids, max_seq_len, min_seq_len), doc_id)
            first += len(texts)
        batch.clear()
        batch_chars = 0

    import pyarrow.parquet as pq
    with atomic_path(documents_path) as tmp, pq.ParquetWriter(tmp, DOCUMENTS_SCHEMA, **PARQUET_OPTIONS) as names_out:
        try:
            for i, doc in enumerate(read_unit(unit, text_column, BadDocuments() if skip_bad else None)):
                if i >= flags.count:  # more documents than the scan found: the file grew since
                    check_unchanged(unit)
                    raise CorpusError(f"unit {unit.index} holds more documents than its scan found; run `make "
                                      f"corpus` again")
                keep, valid = flags(i)
                if not keep:
                    continue
                split = "valid" if valid else "train"
                batch.append((doc_id, split, paragraphs(doc.text)))
                batch_chars += len(doc.text)
                if len(batch) >= ENCODE_BATCH_DOCS or batch_chars >= ENCODE_BATCH_CHARS:
                    encode_batch()
                names.append((doc_id, doc.name, split, len(doc.text)))
                doc_id, documents = doc_id + 1, documents + 1
                if len(names) >= PartWriter.FLUSH_ROWS:
                    _write_names(names_out, names)
            encode_batch()
            check_unchanged(unit)  # a file rewritten while it was read would publish parts of two versions
            _write_names(names_out, names)
            parts = {s: record for s in SPLITS if (record := writers[s].close())}
        except BaseException:
            for writer in writers.values():
                writer.abort()
            raise
    return {"unit": unit.index, "parts": parts, "documents": documents, "encode_s": encode_s}


ENCODE_BATCH_DOCS, ENCODE_BATCH_CHARS = 256, 1 << 20  # a batch of documents to tokenize: at most these


DOCUMENTS_SCHEMA = pa.schema([("doc_id", pa.int32()), ("name", pa.string()), ("split", pa.string()),
                              ("chars", pa.int64())])
# write_parquet's options (common/shards.py), for the parts written a row group at a time
PARQUET_OPTIONS = {"compression": "zstd", "use_dictionary": False, "write_statistics": False, "store_schema": True,
                   "write_page_checksum": True}


def _write_names(writer, names: list) -> None:
    """Append (and clear) documents' records to the unit's documents part. A file name that is not UTF-8 (a
    Latin-1 archive unpacked here: Python keeps its bytes as surrogates) is recorded with those bytes as \\xNN."""
    if names:
        text = [n[1].encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") for n in names]
        writer.write_table(pa.table({"doc_id": pa.array([n[0] for n in names], pa.int32()),
                                     "name": pa.array(text), "split": pa.array([n[2] for n in names]),
                                     "chars": pa.array([n[3] for n in names], pa.int64())}, schema=DOCUMENTS_SCHEMA))
        names.clear()


# --- the driver ---------------------------------------------------------------

def _on_node(fn, staging: str, unit: UnitRef, *args):
    """`fn(unit, *args)` (the unit loaded from its ref) in a Ray worker, once it sees the build's staging
    folder, which it reads and writes (the units, the scan's hashes, the decision's masks, the tokenizer, the
    parts): on a node that does not, one line naming the node and the folder, not a FileNotFoundError after
    the scan pass."""
    if not (Path(staging) / "key.json").is_file():
        import socket
        raise NodeProblem(f"the corpus build's staging folder {staging} is not there as seen from Ray node "
                          f"{socket.gethostname()}: every node must see it at the same path (a shared file system). "
                          f"With an object-storage --out the build is staged in the driver's cache: set "
                          f"FAST_ELECTRA_CACHE to a folder all nodes share, or build on one machine (no --address)")
    return fn(unit.load(), *args)


def _run_on_ray(fn, jobs: list[tuple[UnitRef, tuple]], workers: int, address: str | None, desc: str,
                on_result, staging: Path) -> None:
    """`fn(unit, *args)` for every job on Ray workers, results handed to `on_result` as they finish;
    a progress bar in MB/s with an ETA. One local worker runs the jobs in this process: the same
    functions and bytes, without Ray's start-up."""
    import ray
    from tqdm import tqdm
    from common.parallel import start_ray
    if not jobs:
        return
    if workers == 1 and not address:
        with tqdm(total=sum(u.bytes for u, _ in jobs), desc=desc, unit="B", unit_scale=True, dynamic_ncols=True) as bar:
            for unit, args in jobs:
                on_result(fn(unit.load(), *args))
                bar.update(unit.bytes)
        return
    start_ray(address, workers, (SLOW_ENV,))
    remote = ray.remote(num_cpus=1, max_retries=2)(_on_node)
    # Two jobs per worker in flight, the next submitted as one finishes: every unit at once (15,000 at 1 TB)
    # held all their references in the driver, and each wait scanned them all (quadratic in the units).
    queue, pending = deque(jobs), {}
    bar = tqdm(total=sum(u.bytes for u, _ in jobs), desc=desc, unit="B", unit_scale=True, dynamic_ncols=True)
    try:
        while queue or pending:
            while queue and len(pending) < 2 * workers:
                unit, args = queue.popleft()
                pending[remote.remote(fn, str(staging), unit, *args)] = unit
            done, _ = ray.wait(list(pending), num_returns=1)
            unit = pending.pop(done[0])
            try:
                result = ray.get(done[0])
            except ray.exceptions.RayTaskError as e:  # the worker's own error, without Ray's traceback
                cause = getattr(e, "cause", None)
                if isinstance(cause, (CorpusError, NodeProblem)):
                    raise type(cause)(str(cause)) from None
                if isinstance(cause, OSError):  # a full disk among them: `_build` says so
                    raise cause from None
                raise
            on_result(result)
            bar.update(unit.bytes)
    finally:
        bar.close()
        for ref in pending:
            ray.cancel(ref, force=True)


def _import_stage() -> None:
    import corpus.build  # noqa: F401  (what a worker's first unit would import)


def _warm_up(workers: int, address: str | None) -> None:
    """Start Ray and its worker processes with the stage's imports: fixed costs, paid before the passes."""
    import ray
    from common.parallel import start_ray
    if workers == 1 and not address:
        return  # the passes run in this process
    start_ray(address, workers, (SLOW_ENV,))
    ray.get([ray.remote(num_cpus=1)(_import_stage).remote() for _ in range(workers)])


def _scan_all(units, cfg, config, staging: Path, workers, address, total_bytes, log) -> list[dict]:
    scan_dir = staging / "scan"
    scan_dir.mkdir(exist_ok=True)
    paths = {u.index: scan_dir / f"unit-{u.index:05d}" for u in units}

    def save(result):  # the unit's hashes are in its .npy already, written by the worker as it read
        path = paths[result["unit"]]
        atomic_write_json(path.with_suffix(".json"), {k: result[k] for k in ("sample", "skipped", "skipped_count")})

    todo = [u for u in units if not paths[u.index].with_suffix(".json").is_file()]
    lines = config.tokenizer.max_sentences
    skip = cfg.on_bad_input == "skip"
    budget = config.tokenizer.max_sample_mb * 1e6  # characters of the whole sample, shared like the lines
    jobs = [(u, (str(paths[u.index].with_suffix(".npy")), cfg.text_column, config.seed, cfg.valid_fraction,
                 math.ceil(lines * u.bytes / total_bytes), skip, budget * u.bytes / total_bytes)) for u in todo]
    log(f"corpus: scanning {len(todo)} of {len(units)} units (hashes, split, tokenizer sample)")
    _run_on_ray(scan_unit, jobs, workers, address, "corpus scan", save, staging)
    # the units' samples (bounded in all) and bad documents; their hashes stay in their files (`_decide`)
    scans = [json.loads(paths[u.index].with_suffix(".json").read_text()) for u in units]
    skipped = sum(s["skipped_count"] for s in scans)
    if skipped:
        example = next(message for s in scans for message in s["skipped"])
        log(f"corpus: skipped {skipped} bad document(s) ([corpus] on_bad_input = 'skip'), e.g. {example}")
    return scans


# (hash, document index) pairs of the dedup buckets; a bucket holds about this many documents
PAIR = np.dtype([("hash", "<u8"), ("index", "<i8")])
DEDUP_BUCKET_DOCS = 1 << 20  # 16 MB of pairs, as a unit's chunk of hashes (UNIT_CHUNK_DOCS)
# a bucket file's buffer (reads and writes of whole chunks go past it): the default, the file system's block
# size, is 1-16 MB on a shared file system (NFS, Lustre, GPFS), 4 GB in all at 4,096 buckets
BUCKET_FILE_BUFFER = 1 << 13
# 4,096 buckets: 4G documents at DEDUP_BUCKET_DOCS (256 were 256M; a 1 TB corpus of 1 KB documents is 1G)
MAX_BUCKET_BITS = 12


@dataclasses.dataclass
class Decision:
    """What the driver decided of every document: the keep masks on disk, one file per unit beside its
    hashes (`scan/unit-NNNNN.keep.npy`), and a few numbers per unit or in all."""
    scan_dir: Path
    valid_fraction: float
    documents: int          # read, in all
    starts: list[int]       # per unit: the index of its first document among all (in unit order)
    force: tuple[int, int]  # the index of a document held out against its hash, and of one trained on (-1: none)
    duplicates: int
    kept: list[int] = dataclasses.field(default_factory=list)      # per unit: documents kept
    held_out: list[int] = dataclasses.field(default_factory=list)  # per unit: kept documents held out

    def masks(self, unit: int) -> "UnitMasks":
        return UnitMasks(self.scan_dir, unit, self.starts[unit], self.valid_fraction, self.force)


class UnitMasks:
    """A unit's documents as `_decide` left them in `scan_dir`: `masks(i)` is (kept, held out) of its document
    i, for i never decreasing, read `chunk_docs` at a time from the keep file and the hashes (the held-out split
    is by hash, but for the one or two documents `force` moves to keep both sides of the split non-empty)."""

    def __init__(self, scan_dir: str | Path, unit: int, start: int, valid_fraction: float, force: tuple[int, int],
                 chunk_docs: int = UNIT_CHUNK_DOCS):
        scan_dir = Path(scan_dir)
        self.count = _npy_length(scan_dir / f"unit-{unit:05d}.keep.npy")
        self.keeps = npy_chunks(scan_dir / f"unit-{unit:05d}.keep.npy", chunk_docs)
        self.hashes = npy_chunks(scan_dir / f"unit-{unit:05d}.npy", chunk_docs)
        self.start, self.valid_fraction, self.force = start, valid_fraction, force
        self.low = self.high = 0  # the documents of the chunk in memory
        self.keep = self.valid = np.zeros(0, bool)

    def __call__(self, i: int) -> tuple[bool, bool]:
        if i < self.low:
            raise ValueError(f"document {i} comes before the ones read ({self.low})")
        while i >= self.high:
            self.keep, hashes = next(self.keeps), next(self.hashes)
            self.valid = held_out_mask(hashes, self.start + self.high, self.valid_fraction, self.force)
            self.low, self.high = self.high, self.high + len(self.keep)
        return bool(self.keep[i - self.low]), bool(self.valid[i - self.low])


def held_out_mask(hashes: np.ndarray, start: int, valid_fraction: float, force: tuple[int, int]) -> np.ndarray:
    """Which of a unit's documents (`hashes`, the first at index `start` among all) are held out."""
    valid = valid_mask(hashes, valid_fraction)
    for index, value in zip(force, (True, False)):
        if start <= index < start + len(valid):
            valid[index - start] = value
    return valid


class _SortedIndices:
    """A file of ascending int64 values read a chunk at a time: `below(limit)` returns the next ones under
    `limit`."""

    def __init__(self, path: Path, chunk: int = 1 << 15):
        self.file = open(path, "rb", buffering=BUCKET_FILE_BUFFER)  # not the file system's block size
        self.chunk, self.buffer = chunk, np.zeros(0, np.int64)

    def below(self, limit: int) -> np.ndarray:
        taken = []
        while True:
            n = int(np.searchsorted(self.buffer, limit))
            taken.append(self.buffer[:n])
            self.buffer = self.buffer[n:]
            if len(self.buffer):
                break
            self.buffer = np.frombuffer(self.file.read(8 * self.chunk), dtype="<i8")
            if not len(self.buffer):
                break
        return np.concatenate(taken) if len(taken) > 1 else taken[0]

    def close(self) -> None:
        self.file.close()


def _decide(units: list[UnitRef], scan_dir: Path, valid_fraction: float, bucket_docs: int = 0,
            chunk_docs: int = UNIT_CHUNK_DOCS) -> Decision:
    """Which documents to keep (the first of each hash, in unit order) and which are held out (by hash), at
    least one document on each side of the split; duplicates. In memory bounded by a bucket, not the corpus:
    all hashes at once (8 bytes a document, about 40 at the peak of finding the first of each) were ~10 GB
    at 1 TB. The (hash, index) pairs go to buckets by their hashes' top bits, about `bucket_docs` each (a
    hash's copies all in one, a unit's own copies left out first); each bucket keeps the first of each of its
    hashes, their indices written in order; the units' keep masks are then merged from the buckets' sorted
    indices. A unit is read and its keep mask written `chunk_docs` documents at a time (one gzip file is one
    unit, of any size)."""
    counts = [_npy_length(scan_dir / f"unit-{u.index:05d}.npy") for u in units]
    starts = np.cumsum([0] + counts).tolist()
    total = starts[-1]
    if not total:
        raise CorpusError("the corpus source holds no text (every document is empty)")
    # their files are open at once: at most a half of the process's file limit (at least 256) and 4,096 (past
    # 4G documents, or 512M under a file limit of 1,024, a bucket holds more than bucket_docs)
    allowed = min(MAX_BUCKET_BITS, max(8, (file_limit() // 2).bit_length() - 1))
    bits = min(allowed, max(0, math.ceil(math.log2(total / (bucket_docs or DEDUP_BUCKET_DOCS)))))
    for stale in scan_dir.glob("bucket-*"):
        stale.unlink()
    pairs_paths = [scan_dir / f"bucket-{b:05d}.pairs" for b in range(1 << bits)]
    files = [open(path, "wb", buffering=BUCKET_FILE_BUFFER) for path in pairs_paths]
    try:
        for u, start in zip(units, starts):
            for hashes in npy_chunks(scan_dir / f"unit-{u.index:05d}.npy", chunk_docs):
                first_index, start = start, start + len(hashes)
                # a chunk's own copies are duplicates already: one pair per hash and chunk, so a text repeated
                # millions of times (boilerplate) fills its bucket with one pair per chunk at most
                hashes, first = np.unique(hashes, return_index=True)
                order = np.argsort(first)
                pairs = np.empty(len(hashes), PAIR)
                pairs["hash"], pairs["index"] = hashes[order], first_index + first[order]
                hashes = pairs["hash"]
                if not bits:
                    files[0].write(pairs.tobytes())
                    continue
                bucket = (hashes >> np.uint64(64 - bits)).astype(np.int64)
                order = np.argsort(bucket, kind="stable")  # a bucket's pairs stay in index order
                bounds = np.searchsorted(bucket[order], np.arange((1 << bits) + 1))
                for b in np.flatnonzero(np.diff(bounds)):
                    files[b].write(pairs[order[bounds[b]:bounds[b + 1]]].tobytes())
    finally:
        for f in files:
            f.close()
    kept_total = valid_total = 0
    lowest, highest = (2**64, -1), (-1, -1)  # (hash, index) of the kept documents with the least and most hash
    for path in pairs_paths:
        kept, held_out, least, most = _first_of_each(path, valid_fraction)
        kept_total, valid_total = kept_total + kept, valid_total + held_out
        lowest, highest = min(lowest, least), max(highest, most)
    if kept_total < 2:
        raise CorpusError(f"the corpus has {kept_total} distinct document(s); at least 2 are needed "
                          f"to hold one out for validation")
    # too few documents for the fraction: the least hash held out; every one held out: the greatest trained on
    force = (lowest[1] if valid_total == 0 else -1, highest[1] if valid_total == kept_total else -1)
    decision = Decision(scan_dir, valid_fraction, total, starts[:-1], force, total - kept_total)
    # read a chunk at a time: 32,768 indices a bucket up to 256 buckets, then 2^23 (64 MB) in all
    readers = [_SortedIndices(path.with_suffix(".kept"), min(1 << 15, (1 << 23) >> bits)) for path in pairs_paths]
    try:
        for u, start in zip(units, starts):
            out, kept, held_out = NpyAppender(scan_dir / f"unit-{u.index:05d}.keep.npy", bool), 0, 0
            for hashes in npy_chunks(scan_dir / f"unit-{u.index:05d}.npy", chunk_docs):
                keep = np.zeros(len(hashes), dtype=bool)
                for reader in readers:
                    keep[reader.below(start + len(hashes)) - start] = True
                valid = held_out_mask(hashes, start, valid_fraction, force)
                out.append(keep)
                kept, held_out = kept + int(keep.sum()), held_out + int((keep & valid).sum())
                start += len(hashes)
            out.close()
            decision.kept.append(kept)
            decision.held_out.append(held_out)
    finally:
        for reader in readers:
            reader.close()
    for path in pairs_paths:
        path.with_suffix(".kept").unlink()
    return decision


def _first_of_each(path: Path, valid_fraction: float) -> tuple[int, int, tuple, tuple]:
    """One bucket of `_decide`: the indices of the first document of each of its hashes, sorted, to `.kept`
    beside it (its pairs file removed); their number, how many are held out, and the (hash, index) of the
    least and the greatest hash. A function of its own so that one bucket's arrays are gone before the
    next one's are made."""
    pairs = np.fromfile(path, dtype=PAIR)
    unique, first = np.unique(pairs["hash"], return_index=True)  # the first occurrence of each
    kept = pairs["index"][first]
    del pairs, first
    np.sort(kept).astype("<i8").tofile(path.with_suffix(".kept"))
    path.unlink()
    if not len(unique):
        return 0, 0, (2**64, -1), (-1, -1)
    return (len(unique), int(valid_mask(unique, valid_fraction).sum()), (int(unique[0]), int(kept[0])),
            (int(unique[-1]), int(kept[-1])))


def _npy_length(path: Path) -> int:
    """The number of values in a 1-d .npy file, from its header."""
    with open(path, "rb") as f:
        return int(npy_header(f)[0][0])


def _train_tokenizer(scans, decision: Decision, config: RunConfig, staging: Path, log) -> Tokenizer:
    meta = staging / META_FILE
    if meta.is_file():
        try:
            return open_tokenizer(staging)
        except (ValueError, FileNotFoundError):
            pass
    lines = []
    for unit, scan in enumerate(scans):
        if scan["sample"]:
            masks = decision.masks(unit)  # the sample is in document order
            lines += [text for i, _, text in scan["sample"] if masks(i) == (True, False)]
    source = hf.hf_dir(config.aux.source)
    if source is not None:  # the aux model's own tokenizer, renumbered by frequency in the sample
        log(f"corpus: the tokenizer of {source}, ordered on {len(lines)} sampled paragraphs")
        hf.build_tokenizer(source, lines, staging, META_FILE)
        return open_tokenizer(staging)
    vocab = config.tokenizer.vocab_size
    log(f"corpus: training the tokenizer on {len(lines)} sampled paragraphs ({sum(map(len, lines)) / 1e6:.1f}M chars)")
    try:
        train_tokenizer(lines, vocab, staging)
    except RuntimeError as e:  # SentencePiece: too little text for the vocabulary, among others
        raise CorpusError(f"the tokenizer cannot be trained on this corpus ({len(lines)} paragraphs, "
                          f"{sum(map(len, lines))} characters) with tokenizer.vocab_size = {vocab}: {e}") from e
    return open_tokenizer(staging)


# How sources are read into documents (common.sources), in the staging folder's key.json: a build scanned by
# one version and packed by another would index different documents (2: .txt.gz in documents, cleaned JSONL
# and Parquet text, Windows-1252, long lines cut; 2026-11-26). A published corpus keeps its bytes and its key.
SOURCE_READER = 2
UNITS_FILE = "units.jsonl"  # the build's work units (`common.sources.write_units`), in its staging folder


def _staged_key(staging: Path) -> tuple | None:
    try:
        staged = read_json(staging / "key.json", ("key",))
        return staged["key"], staged.get("reader")
    except (OSError, DamagedFile):
        return None


def _read_progress(staging: Path) -> dict[int, dict]:
    return read_records(staging / "progress.jsonl", "unit")


def _part_files(part: dict) -> list[tuple[str, int, str]]:
    return [(part["path"], part["bytes"], part["sha256"])] + \
           [(f["path"], f["bytes"], f["sha256"]) for f in part["flat"].values()]


def _part_intact(staging: Path, part: dict, stamps: dict, hashed: list) -> bool:
    """A packed part's files have their recorded size, and either the size and time they had when recorded
    (`stamps`: not read again) or their recorded sha256 (read, and appended to `hashed`)."""
    for p, n, h in _part_files(part):
        path = staging / p
        if not path.is_file() or path.stat().st_size != n:
            return False
        if stamps.get(p) != file_stamp(path):
            hashed.append(p)
            if sha256_file(path) != h:
                return False
    return True


def check_hf_aux(config: RunConfig) -> None:
    """An hf: aux model is checked before any work: its tokenizer loads and has the specials a masked LM
    needs, the model loads with a masked-LM head over the tokenizer's ids, and the rows fit its positions
    (loading takes seconds; a tokenization pass over a real corpus, hours)."""
    path = hf.hf_dir(config.aux.source)
    if path is None:
        return
    try:
        tokenizer = hf.load_hf_tokenizer(path)
        hf.special_hf_ids(tokenizer, path)
        hf.HFMaskedLM(path, np.arange(len(tokenizer)))
        limit = hf.max_positions(hf.load_config(path))
    except (OSError, ValueError) as e:
        raise CorpusError(str(e)) from None
    if limit and config.corpus.max_seq_len > limit:
        raise CorpusError(f"corpus.max_seq_len = {config.corpus.max_seq_len} is beyond the {limit} positions of "
                          f"the aux model in {path}; set corpus.max_seq_len <= {limit}")


def build_corpus(config: RunConfig, out_dir: str | Path, source: str | None = None, workers: int = 1,
                 address: str | None = None, log=print) -> Path:
    """Build the corpus folder. Nothing changes under `out_dir` unless the whole build succeeds;
    a rerun after a failure or a kill continues from the staging folder. One writer at a time."""
    out_dir = Path(os.path.abspath(out_dir))  # `--out .` has a name, and a folder beside it for the staging
    with FolderLock(out_dir, "python -m corpus"):
        if out_dir.is_dir() and not (out_dir / CORPUS_META).is_file() and any(out_dir.iterdir()):
            raise CorpusError(f"{out_dir} is not empty and holds no {CORPUS_META}: not a corpus folder, and a build "
                              f"replaces its folder whole; give --out a new or empty folder")
        return _build(config, out_dir, source, workers, address, log)


def _build(config: RunConfig, out_dir: Path, source: str | None, workers: int, address: str | None, log) -> Path:
    cfg = config.corpus
    source = source or cfg.source
    out_dir = Path(out_dir)
    t_start = time.time()
    check_hf_aux(config)
    ignored = LeftOut()
    files = source_files(source, cache_dir=out_dir.parent / "downloads", ignored=ignored)
    if ignored.count:  # a .bz2 or .xz among them is text this build does not read: said, not silently left out
        log(f"corpus: note: {ignored.count} file(s) in {source} are not of a kind read here ({', '.join(SUFFIXES)}) "
            f"and are left out: {', '.join(ignored.names)}{', ...' if ignored.count > len(ignored.names) else ''}")
    key = build_key(config, files)
    staging = out_dir.with_name(f".{out_dir.name}.staging")
    if staging.is_dir() and _staged_key(staging) != (key, SOURCE_READER):
        shutil.rmtree(staging)  # an unfinished build of other inputs or reader (or its key.json cut short)
    staging.mkdir(parents=True, exist_ok=True)
    for folder in (staging, *(p for p in staging.iterdir() if p.is_dir())):
        remove_stale_tmp(folder)
    atomic_write_json(staging / "key.json", {"key": key, "reader": SOURCE_READER})
    if (staging / CORPUS_META).is_file():  # killed between finishing and publishing
        _publish(staging, out_dir)
        log(f"corpus: published the build finished in {staging} -> {out_dir}")
        return out_dir
    import ray
    ray_was_running = ray.is_initialized()
    try:
        # the units on disk, a piece a line: the driver holds their sizes and offsets, not the source's files
        units = write_units(files, unit_bytes(config), staging / UNITS_FILE)
        source_count = len(files)
        del files  # and the listing's runs (TMPDIR) with it: hours of a build need none of it
        total_bytes = sum(u.bytes for u in units)
        if not total_bytes:
            raise CorpusError(f"corpus source {source} holds no text: its {source_count} file(s) are empty")
        if not workers:  # none asked, joining a cluster: one per core of it
            from common.parallel import cluster_size
            workers = cluster_size(address, "CPU")
        if not address:  # a worker per unit at most: a corpus of one unit (the default's) skips Ray's start-up
            workers = min(workers, len(units))
        log(f"corpus: {source_count} files, {total_bytes / 1e6:.1f} MB from {source!r} in {len(units)} units "
            f"on {workers} worker(s)")
        _warm_up(workers, address)
        seconds = {"start": time.time() - t_start}
        scans = _scan_all(units, cfg, config, staging, workers, address, total_bytes, log)
        seconds["scan"] = time.time() - t_start - sum(seconds.values())
        decision = _decide(units, staging / "scan", cfg.valid_fraction)
        skipped = sum(s["skipped_count"] for s in scans)
        tok = _train_tokenizer(scans, decision, config, staging, log)
        seconds["tokenizer"] = time.time() - t_start - sum(seconds.values())
        del scans  # the tokenizer sample is no longer needed
        return _pack_and_publish(config, source, key, source_count, units, decision, tok, staging, out_dir,
                                 workers, address, t_start, seconds, log, skipped)
    except SourceUnreadable as e:  # maybe passing (a network file system): the same command continues
        raise SourceUnreadable(f"{e}; the work done so far is kept in {staging}: if the read failed in passing "
                               f"(a network file system), the same command continues from it") from None
    except CorpusError:  # bad input: a rerun would fail the same way until the source changes
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except OSError as e:  # the staging folder is kept: a rerun goes on from its parts
        if (full := disk_full(e, e.filename or staging, staging)) is not None:
            raise full from e
        raise
    finally:
        if not ray_was_running and ray.is_initialized():
            ray.shutdown()  # the Ray this build started (a caller's own Ray is left running)


def _pack_and_publish(config, source, key: str, source_count: int, units: list[UnitRef], decision: Decision, tok,
                      staging, out_dir, workers, address, t_start, seconds, log, skipped: int) -> Path:
    cfg, total_bytes = config.corpus, sum(u.bytes for u in units)

    progress, hashed = _read_progress(staging), []
    done = {u: r for u, r in progress.items()
            if all(_part_intact(staging, p, r.get("stamps", {}), hashed) for p in r["parts"].values())}
    if hashed:
        log(f"corpus: hashed {len(hashed)} part file(s) again, their size or time changed since they were recorded")
    doc_starts = np.cumsum([0] + decision.kept).tolist()
    if doc_starts[-1] >= 2**31:  # doc_id is int32 in the parts and documents/ (said before the pass, not in it)
        raise CorpusError(f"the corpus keeps {doc_starts[-1]:,} documents, more than the 2,147,483,647 its document "
                          f"ids can number: join short documents (a line each?) into longer ones in the source")
    masks = lambda u: (decision.starts[u.index], decision.valid_fraction, decision.force)  # read by the worker
    jobs = [(u, (cfg.text_column, str(staging), masks(u), doc_starts[u.index], cfg.max_seq_len, cfg.min_seq_len,
                 cfg.on_bad_input == "skip")) for u in units if u.index not in done]

    def record(result):  # with each file's size and time: a restart trusts them as they are, unread
        stamps = {p: file_stamp(staging / p) for part in result["parts"].values() for p, _, _ in _part_files(part)}
        append_record(staging / "progress.jsonl", {**result, "stamps": stamps})
        done[result["unit"]] = result

    log(f"corpus: packing {len(jobs)} of {len(units)} units ({len(units) - len(jobs)} already done)")
    packed_now = set()
    _run_on_ray(pack_unit, jobs, workers, address, "corpus pack",
                lambda result: (record(result), packed_now.add(result["unit"])), staging)
    seconds["pack"] = time.time() - t_start - sum(seconds.values())
    encode_s = sum(done[u].get("encode_s", 0.0) for u in packed_now)

    meta = {
        "format_version": FORMAT_VERSION, "corpus_format": CORPUS_FORMAT, "build_key": key, "source": source,
        "source_files": source_count, "source_bytes": total_bytes, "units": len(units),
        "max_seq_len": cfg.max_seq_len, "vocab_size": tok.vocab_size, "tokenizer_sha256": tok.sha256,
        **({} if tok.reserved == Reserved() else {"reserved_ids": dataclasses.asdict(tok.reserved)}),
        "documents": {"read": decision.documents, "duplicates": decision.duplicates,
                      "skipped_bad": skipped, "train": sum(decision.kept) - sum(decision.held_out),
                      "valid": sum(decision.held_out)},
        "config": {"corpus": config_to_dict(config)["corpus"], "tokenizer": config_to_dict(config)["tokenizer"],
                   "seed": config.seed},
    }
    for split in SPLITS:
        parts, row_start = [], 0
        for u in units:
            part = done[u.index]["parts"].get(split)
            if part:
                parts.append({**part, "row_start": row_start})
                row_start += part["rows"]
        if not parts:
            raise CorpusError(f"the {split} split of {source!r} has no sequence of >= {cfg.min_seq_len} tokens")
        meta[split] = {"rows": row_start, "tokens": sum(p["tokens"] for p in parts), "parts": parts}
    atomic_write_text(staging / "resolved_manifest.toml", dump_toml(config))
    atomic_write_json(staging / CORPUS_META, meta)  # from here on a rerun only publishes
    _publish(staging, out_dir)
    seconds["publish"] = time.time() - t_start - sum(seconds.values())
    log("corpus: seconds " + ", ".join(f"{k} {v:.2f}" for k, v in {**seconds, "encode_in_pack": encode_s}.items()))
    from common.memory import peak_rss_bytes
    log(f"corpus: peak RSS of this process {peak_rss_bytes() / 2**20:.0f} MB "
        f"({'the whole build: one worker, in it' if workers == 1 and not address else 'its Ray workers apart'})")
    log(f"corpus: train {meta['train']['rows']} rows / {meta['train']['tokens']} tokens, "
        f"valid {meta['valid']['rows']} rows; {meta['documents']['train']} + {meta['documents']['valid']} "
        f"documents, {decision.duplicates} duplicates dropped; vocab {tok.vocab_size}; "
        f"{total_bytes / 1e6 / max(time.time() - t_start, 1e-9):.2f} MB/s, {time.time() - t_start:.1f}s -> {out_dir}")
    return out_dir


def _publish(staging: Path, out_dir: Path) -> None:
    """The complete staging folder (its `corpus.json` written) takes the place of `out_dir`, with its term
    counts and without the build's own files; the old corpus is removed only after."""
    term_counts(staging)
    if (staging / "scan").is_dir():
        shutil.rmtree(staging / "scan")
    (staging / "progress.jsonl").unlink(missing_ok=True)
    (staging / UNITS_FILE).unlink(missing_ok=True)  # every source file's path: the build's, not the corpus's
    # every part is recorded and in place: a temporary left now is a stray writer's (a worker of a killed
    # build that outlived its driver for a moment, seen once in the kill -9 test), not part of the corpus
    for folder in (staging, *(p for p in staging.iterdir() if p.is_dir())):
        remove_stale_tmp(folder)
    publish_folder(staging, out_dir)
    (out_dir / "key.json").unlink()


def parts_present(corpus_dir: Path) -> bool:
    """Every part file `corpus.json` lists is in `corpus_dir` with its recorded size (a local build kept in
    the cache for an upload, which a cleanup may have thinned)."""
    meta = load_corpus_meta(corpus_dir)
    return all((corpus_dir / p).is_file() and (corpus_dir / p).stat().st_size == n
               for split in SPLITS for part in meta[split]["parts"] for p, n, _ in _part_files(part))


def corpus_is_current(config: RunConfig, corpus_dir: Path, source: str) -> bool:
    """True if `corpus_dir` was built from these very source files (names, sizes, modification
    times) with these settings."""
    try:
        meta = load_corpus_meta(corpus_dir)
        remote = location(corpus_dir)
        files = source_files(source, cache_dir=(cache_folder(remote, "builds").parent if is_remote(remote)
                                                else Path(corpus_dir).parent) / "downloads")
    except (CorpusError, DamagedFile):  # a damaged corpus.json: built again
        return False
    return meta.get("build_key") == build_key(config, files) and _same_source(meta.get("source"), source)


def _same_source(built: str | None, source: str) -> bool:
    """The same source, spelled either way: a local folder with or without its trailing slash, relative or
    absolute (a whole rebuild for `raw/` after `raw`, the build key being the same)."""
    if built == source:
        return True
    local = built and "://" not in built + source
    return bool(local) and os.path.realpath(built) == os.path.realpath(source)
