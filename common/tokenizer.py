"""SentencePiece BPE tokenizer: cased, byte fallback, fixed special ids, ids in frequency order.

Paper section 4.1: "a cased sentence piece BPE vocabulary of 128K tokens"; the
tiny preset uses 8K. The special tokens have fixed ids so every stage agrees.

Our ids are SentencePiece's pieces renumbered by frequency in the tokenizer's
training sample (specials 0-4 first, then the most frequent piece, ...). The
model does not care about the numbering, but the shards do: with frequent tokens
on small ids the high bytes of the int32 column are mostly zero, and Parquet's
BYTE_STREAM_SPLIT + zstd store a token in about 1.4 bytes instead of 2.0
(measured on the tiny corpus, see bench/results/generate.md).
"""
from __future__ import annotations

import hashlib
import io
import itertools
import json
from pathlib import Path
from typing import Iterable

import numpy as np
import sentencepiece as spm

from common.io import atomic_write_json, atomic_path, sha256_file

from common.vocab import CLS_ID, MASK_ID, PAD_ID, SEP_ID, SPECIAL_IDS, SPECIAL_PIECES, UNK_ID, Reserved  # noqa: F401

MODEL_FILE = "tokenizer.model"
META_FILE = "tokenizer.json"


def frequency_order(counts: np.ndarray) -> np.ndarray:
    """SentencePiece id of each of our ids: specials keep 0-4, the rest by descending count
    (ties by SentencePiece id, so the order is deterministic)."""
    keys = counts.astype(np.float64).copy()
    keys[list(SPECIAL_IDS)] = np.inf
    order = np.argsort(-keys, kind="stable")
    assert order[:len(SPECIAL_IDS)].tolist() == list(SPECIAL_IDS)
    return order


def tokenizer_sha256(model_sha256: str, sp_of: list[int]) -> str:
    """Identity of the tokenizer: the SentencePiece model and our id order."""
    return hashlib.sha256(json.dumps({"model": model_sha256, "order": sp_of}).encode()).hexdigest()


def train_tokenizer(lines: Iterable[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Train a BPE model on `lines`; writes tokenizer.model and tokenizer.json (sha256, vocab, id order)."""
    out_dir = Path(out_dir)
    lines = list(lines)
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buffer,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        normalization_rule_name="identity",  # cased, text kept as written
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=CLS_ID, eos_id=SEP_ID,
        pad_piece="[PAD]", unk_piece="[UNK]", bos_piece="[CLS]", eos_piece="[SEP]",
        user_defined_symbols=["[MASK]"],
        shuffle_input_sentence=False,  # the caller samples lines with a seeded RNG
        max_sentence_length=4 * 8192,  # bytes: corpus.build cuts sample lines at 8,192 characters, 4 bytes at most each
        num_threads=2,  # fixed: the model's bytes depend on it (1, 2, 4 and 8 threads gave four models)
        minloglevel=2,
    )
    model_path = out_dir / MODEL_FILE
    with atomic_path(model_path) as tmp:
        tmp.write_bytes(buffer.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    counts = np.zeros(sp.get_piece_size(), dtype=np.int64)
    for ids in sp.encode(lines):
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=counts.size)
    sp_of = frequency_order(counts).tolist()
    model_sha = sha256_file(model_path)
    atomic_write_json(out_dir / META_FILE, {"vocab_size": sp.get_piece_size(), "model_sha256": model_sha,
                                            "sha256": tokenizer_sha256(model_sha, sp_of),
                                            "special": dict(zip(SPECIAL_PIECES, SPECIAL_IDS)), "sp_id_of": sp_of})
    return model_path


class Tokenizer:
    """Thin wrapper over a SentencePiece model with the project's fixed special ids and frequency order."""

    def __init__(self, model_path: str | Path):
        self.path = Path(model_path)
        meta_path = self.path.with_name(META_FILE)
        if not self.path.is_file() or not meta_path.is_file():
            raise FileNotFoundError(f"tokenizer {self.path} or its {META_FILE} does not exist (run `make corpus`)")
        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        meta = json.loads(meta_path.read_text())
        model_sha = sha256_file(self.path)
        if meta.get("model_sha256") != model_sha or "sp_id_of" not in meta:
            raise ValueError(f"tokenizer {self.path} has sha256 {model_sha[:12]}, its {META_FILE} says "
                             f"{str(meta.get('model_sha256'))[:12]} (rebuild it with `make corpus`)")
        self.sp_of = np.asarray(meta["sp_id_of"], dtype=np.int64)          # our id -> SentencePiece id
        self.ours_of = np.empty_like(self.sp_of)
        self.ours_of[self.sp_of] = np.arange(self.sp_of.size)               # SentencePiece id -> our id
        self.ours_of32 = self.ours_of.astype(np.int32)
        self.sha256 = tokenizer_sha256(model_sha, meta["sp_id_of"])
        if meta["sha256"] != self.sha256 or self.sp_of.size != self.sp.get_piece_size():
            raise ValueError(f"tokenizer {self.path}: {META_FILE} does not match the model")
        for piece, idx in zip(SPECIAL_PIECES, SPECIAL_IDS):
            if self.sp.id_to_piece(int(self.sp_of[idx])) != piece:
                raise ValueError(f"tokenizer {self.path}: id {idx} is not {piece!r}")

    reserved = Reserved()  # ids never sampled as replacements: the specials (an hf: tokenizer reserves more)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode_native(self, texts: list[str]) -> list[list[int]]:
        """SentencePiece's own ids, one thread (the corpus stage's workers are the parallelism)."""
        return self.sp.encode(texts, num_threads=1)

    def piece(self, idx: int) -> str:
        return self.sp.id_to_piece(int(self.sp_of[idx]))

    def encode(self, text: str) -> list[int]:
        return self.ours_of[np.asarray(self.sp.encode(text), dtype=np.int64)].tolist()

    def encode_batch(self, texts: list[str], num_threads: int | None = None) -> list[list[int]]:
        """`num_threads`: SentencePiece's threads for the batch (None: its default, all cores)."""
        return [self.ours_of[np.asarray(ids, dtype=np.int64)].tolist()
                for ids in self.sp.encode(texts, num_threads=num_threads)]

    def to_ours(self, pieces: list[list[int]]) -> np.ndarray:
        """SentencePiece's ids of several texts -> ours, one after another, as one int32 array."""
        return self.ours_of32[np.array(list(itertools.chain.from_iterable(pieces)), dtype=np.int32)]

    def decode(self, ids) -> str:
        return self.sp.decode(self.sp_of[np.asarray(ids, dtype=np.int64)].tolist())


def tokenizer_reserved(folder: str | Path) -> "Reserved":
    """The ids a corpus folder's tokenizer never masks or samples (`Reserved`), read from its metadata
    without loading the tokenizer: ours reserve the five specials, an hf: tokenizer its whole block."""
    meta_path = Path(folder) / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return Reserved.of(meta) if meta.get("kind") == "hf" else Reserved()


def open_tokenizer(folder: str | Path):
    """The tokenizer a corpus folder was built with: ours (SentencePiece), or an hf: aux model's
    (common/hf.py), by what its tokenizer.json says."""
    folder = Path(folder)
    meta_path = folder / META_FILE
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("kind") == "hf":
            from common.hf import HFTokenizer
            return HFTokenizer(folder, meta)
    return Tokenizer(folder / MODEL_FILE)
