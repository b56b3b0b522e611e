"""SentencePiece BPE tokenizer: cased, byte fallback, fixed special ids.

Paper section 4.1: "a cased sentence piece BPE vocabulary of 128K tokens"; the
tiny preset uses 8K. The special tokens have fixed ids so every stage agrees.
"""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Iterable

import sentencepiece as spm

from common.io import atomic_write_json, atomic_path, sha256_file

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
SPECIAL_IDS = (PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID)
SPECIAL_PIECES = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MODEL_FILE = "tokenizer.model"
META_FILE = "tokenizer.json"


def train_tokenizer(lines: Iterable[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Train a BPE model on `lines`; writes tokenizer.model and tokenizer.json (sha256, vocab)."""
    out_dir = Path(out_dir)
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
        max_sentence_length=16384,
        num_threads=2,
        minloglevel=2,
    )
    model_path = out_dir / MODEL_FILE
    with atomic_path(model_path) as tmp:
        tmp.write_bytes(buffer.getvalue())
    tok = Tokenizer(model_path, check_meta=False)
    atomic_write_json(out_dir / META_FILE, {"vocab_size": tok.vocab_size, "sha256": sha256_file(model_path),
                                            "special": dict(zip(SPECIAL_PIECES, SPECIAL_IDS))})
    return model_path


class Tokenizer:
    """Thin wrapper over a SentencePiece model with the project's fixed special ids."""

    def __init__(self, model_path: str | Path, check_meta: bool = True):
        self.path = Path(model_path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer model {self.path} does not exist (run `make corpus`)")
        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        for piece, idx in zip(SPECIAL_PIECES, SPECIAL_IDS):
            if self.sp.id_to_piece(idx) != piece:
                raise ValueError(f"tokenizer {self.path}: id {idx} is {self.sp.id_to_piece(idx)!r}, expected {piece!r}")
        self.sha256 = sha256_file(self.path)
        meta = self.path.with_name(META_FILE)
        if check_meta and meta.is_file():
            recorded = json.loads(meta.read_text())["sha256"]
            if recorded != self.sha256:
                raise ValueError(f"tokenizer {self.path} has sha256 {self.sha256[:12]}, its {META_FILE} says {recorded[:12]}")

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])
