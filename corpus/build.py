"""`make corpus`: raw text -> tokenizer + packed sequences in Parquet, split by document.

Output folder (published atomically: built under a temporary name, renamed at the end): see
`common/corpus.py`, which reads it. Paper appendix A: sequences respect document boundaries;
special tokens are fixed.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from common.config import RunConfig, config_to_dict, dump_toml
from common.corpus import CORPUS_META, load_corpus_meta, term_counts
from common.io import atomic_path, atomic_write_json, atomic_write_text, sha256_file
from common.shards import CORPUS_SCHEMA, FORMAT_VERSION, int_lists, write_parquet
from common.sources import CorpusError, Document, paragraphs, read_source
from common.tokenizer import CLS_ID, SEP_ID, Tokenizer, train_tokenizer


def pack_document(token_ids: list[int], max_seq_len: int, min_seq_len: int) -> list[list[int]]:
    """Cut one document's tokens into [CLS] ... [SEP] sequences of at most `max_seq_len`;
    a last piece shorter than `min_seq_len` (with specials) is dropped. Never crosses documents."""
    body = max_seq_len - 2
    rows = []
    for start in range(0, len(token_ids), body):
        piece = token_ids[start:start + body]
        if len(piece) + 2 < min_seq_len:
            break
        rows.append([CLS_ID, *piece, SEP_ID])
    return rows


def split_documents(num_docs: int, valid_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of held-out documents: a seeded choice of round(fraction * n), at least one."""
    if num_docs < 2:
        raise CorpusError(f"the corpus has {num_docs} document(s); at least 2 are needed to hold one out")
    num_valid = max(1, round(valid_fraction * num_docs))
    rng = np.random.default_rng([seed, 0x5E1])
    mask = np.zeros(num_docs, dtype=bool)
    mask[rng.choice(num_docs, size=num_valid, replace=False)] = True
    return mask


def tokenizer_lines(docs: list[Document], max_lines: int, seed: int) -> list[str]:
    """A seeded sample of paragraphs to train the tokenizer on."""
    lines = [p[:8192] for d in docs for p in paragraphs(d.text)]
    if len(lines) > max_lines:
        rng = np.random.default_rng([seed, 0x70C])
        lines = [lines[i] for i in sorted(rng.choice(len(lines), size=max_lines, replace=False))]
    return lines


def _write_split(out: Path, split: str, rows: list[tuple[int, list[int]]], rows_per_part: int) -> dict:
    parts = []
    for part, start in enumerate(range(0, max(len(rows), 1), rows_per_part)):
        chunk = rows[start:start + rows_per_part]
        columns = {
            "row_id": pa.array(np.arange(start, start + len(chunk), dtype=np.int64)),
            "doc_id": pa.array(np.array([d for d, _ in chunk], dtype=np.int32)),
            "input_ids": int_lists([np.asarray(ids, dtype=np.int32) for _, ids in chunk], pa.int32()),
        }
        path = out / split / f"part-{part:05d}.parquet"
        info = write_parquet(path, columns, CORPUS_SCHEMA)
        parts.append({"path": f"{split}/{path.name}", "rows": len(chunk), **info})
    flat = _write_flat(out, split, [ids for _, ids in rows])
    return {"rows": len(rows), "tokens": int(sum(len(ids) for _, ids in rows)), "parts": parts, "flat": flat}


def _write_flat(out: Path, split: str, rows: list[list[int]]) -> dict:
    """All rows of a split as one int32 token array plus int64 row offsets (.npy, memory-mappable)."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    tokens = np.concatenate([np.asarray(r, dtype=np.int32) for r in rows]) if rows else np.zeros(0, np.int32)
    files = {}
    for kind, array in (("tokens", tokens), ("offsets", offsets)):
        path = out / f"{split}.{kind}.npy"
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, array)
        files[kind] = {"path": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return files


def build_corpus(config: RunConfig, out_dir: str | Path, source: str | None = None, log=print) -> Path:
    """Build the corpus folder; nothing is visible under `out_dir` unless it all succeeds."""
    cfg = config.corpus
    source = source or cfg.source
    out_dir = Path(out_dir)
    t_start = time.time()
    docs, dropped = read_source(source, cfg.text_column, cache_dir=out_dir.parent / "downloads")
    log(f"corpus: {len(docs)} documents from {source!r} ({len(dropped)} duplicate editions dropped)")
    held_out = split_documents(len(docs), cfg.valid_fraction, config.seed)

    staging = out_dir.with_name(f".{out_dir.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        train_docs = [d for d, v in zip(docs, held_out) if not v]
        train_tokenizer(tokenizer_lines(train_docs, config.tokenizer.max_sentences, config.seed),
                        config.tokenizer.vocab_size, staging)
        tok = Tokenizer(staging / "tokenizer.model")
        splits = {"train": [], "valid": []}
        for doc_id, (doc, valid) in enumerate(zip(docs, held_out)):
            ids = [i for para in tok.encode_batch(paragraphs(doc.text)) for i in para]
            for row in pack_document(ids, cfg.max_seq_len, cfg.min_seq_len):
                splits["valid" if valid else "train"].append((doc_id, row))
        for split, rows in splits.items():
            if not rows:
                raise CorpusError(f"the {split} split of {source!r} has no sequence of >= {cfg.min_seq_len} tokens")
        meta = {
            "format_version": FORMAT_VERSION,
            "source": source,
            "max_seq_len": cfg.max_seq_len,
            "vocab_size": tok.vocab_size,
            "tokenizer_sha256": tok.sha256,
            "documents": [{"doc_id": i, "name": d.name, "split": "valid" if v else "train", "chars": len(d.text)}
                          for i, (d, v) in enumerate(zip(docs, held_out))],
            "dropped_duplicates": dropped,
            "config": {"corpus": config_to_dict(config)["corpus"], "tokenizer": config_to_dict(config)["tokenizer"],
                       "seed": config.seed},
        }
        for split, rows in splits.items():
            meta[split] = _write_split(staging, split, rows, cfg.rows_per_part)
        atomic_write_text(staging / "resolved_manifest.toml", dump_toml(config))
        atomic_write_json(staging / CORPUS_META, meta)
        term_counts(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"corpus: train {meta['train']['rows']} rows / {meta['train']['tokens']} tokens, "
        f"valid {meta['valid']['rows']} rows; vocab {tok.vocab_size}; {time.time() - t_start:.1f}s -> {out_dir}")
    return out_dir


def corpus_is_current(config: RunConfig, corpus_dir: Path, source: str) -> bool:
    try:
        meta = load_corpus_meta(corpus_dir)
    except CorpusError:
        return False
    want = {"corpus": config_to_dict(config)["corpus"], "tokenizer": config_to_dict(config)["tokenizer"],
            "seed": config.seed}
    return meta.get("format_version") == FORMAT_VERSION and meta["config"] == want and meta["source"] == source
