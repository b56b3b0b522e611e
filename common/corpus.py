"""Reading a packed corpus (built by `python -m corpus`, `corpus/build.py`).

A corpus folder holds:
    tokenizer.model, tokenizer.json     SentencePiece BPE model and its sha256
    train/part-00000.parquet ...        CORPUS_SCHEMA rows, documents in order
    valid/part-00000.parquet            rows of the held-out documents
    train.tokens.npy, train.offsets.npy the same rows flat, for memory-mapped random access
    valid.tokens.npy, valid.offsets.npy (the generator's actors read rows without loading the corpus)
    train.term_counts.npy               int64 count of every token id in the train split (term frequency,
                                        paper section 5.1); made lazily for corpora built before it existed
    corpus.json                         counts, document names, hashes (written last)
    resolved_manifest.toml
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.io import atomic_path
from common.shards import CORPUS_SCHEMA, list_column, read_parquet
from common.sources import CorpusError

CORPUS_META = "corpus.json"
TERM_COUNTS_FILE = "train.term_counts.npy"


class SplitRows:
    """Rows of one split, memory-mapped: `rows[i]` is row_id i as an int32 array, read on demand.
    Memory stays flat in corpus size (only touched pages are read); sizes are checked on open."""

    def __init__(self, corpus_dir: str | Path, split: str):
        meta = load_corpus_meta(corpus_dir)[split]
        arrays = {}
        for kind in ("tokens", "offsets"):
            record = meta["flat"][kind]
            path = Path(corpus_dir) / record["path"]
            if not path.is_file() or path.stat().st_size != record["bytes"]:
                raise CorpusError(f"{path} is missing or has another size than corpus.json says; rebuild the corpus")
            arrays[kind] = np.load(path, mmap_mode="r")
        self.tokens, self.offsets = arrays["tokens"], arrays["offsets"]
        if len(self.offsets) != meta["rows"] + 1:
            raise CorpusError(f"{corpus_dir}: {split} offsets hold {len(self.offsets) - 1} rows, corpus.json says {meta['rows']}")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array(self.tokens[self.offsets[i]:self.offsets[i + 1]])  # a copy, never a view of the map


def count_terms(tokens: np.ndarray, vocab_size: int, chunk: int = 1 << 24) -> np.ndarray:
    """Occurrences of every id in `tokens` (a memory map is read in chunks), int64 (vocab_size,)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), chunk):
        counts += np.bincount(np.asarray(tokens[start:start + chunk]), minlength=vocab_size)[:vocab_size]
    return counts


def term_counts(corpus_dir: str | Path) -> np.ndarray:
    """Paper section 5.1, term frequency: token counts of the train split, computed once and stored beside
    the corpus (atomically; a corpus built before this file existed gets it on first use). A stored
    file is trusted only if it has one count per id and its counts add up to the split's tokens."""
    corpus_dir = Path(corpus_dir)
    meta = load_corpus_meta(corpus_dir)
    path = corpus_dir / TERM_COUNTS_FILE
    if path.is_file():
        counts = np.load(path)
        if counts.shape == (meta["vocab_size"],) and int(counts.sum()) == meta["train"]["tokens"]:
            return counts
    rows = SplitRows(corpus_dir, "train")
    counts = count_terms(rows.tokens, meta["vocab_size"])
    if int(counts.sum()) != meta["train"]["tokens"]:  # ids past the vocabulary were cut off by count_terms
        raise CorpusError(f"{corpus_dir}: train tokens hold ids outside the vocabulary; rebuild the corpus")
    try:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, counts)
    except OSError as e:  # a read-only corpus: use the counts without storing them
        print(f"corpus: could not store {path} ({e}); term counts are recomputed on each use")
    return counts


def load_corpus_meta(corpus_dir: str | Path) -> dict:
    path = Path(corpus_dir) / CORPUS_META
    if not path.is_file():
        raise CorpusError(f"no corpus at {corpus_dir} ({CORPUS_META} missing): run `make corpus` first")
    return json.loads(path.read_text())


def load_split(corpus_dir: str | Path, split: str) -> list[np.ndarray]:
    """All rows of one split, in row_id order, as int32 arrays (row i has row_id i)."""
    meta = load_corpus_meta(corpus_dir)
    rows: list[np.ndarray] = []
    for part in meta[split]["parts"]:
        table = read_parquet(Path(corpus_dir) / part["path"], CORPUS_SCHEMA)
        rows.extend(list_column(table, "input_ids"))
    if len(rows) != meta[split]["rows"]:
        raise CorpusError(f"{corpus_dir}: {split} holds {len(rows)} rows, corpus.json says {meta[split]['rows']}")
    return rows


if __name__ == "__main__":  # the old name of `python -m corpus`, kept for one release
    import runpy
    runpy.run_module("corpus", run_name="__main__", alter_sys=True)
