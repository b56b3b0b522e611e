"""The ids every part of the project agrees on: the five special tokens and the reserved ids that are
never masked nor sampled (`Reserved`). Imported by the tokenizers (common/tokenizer.py) and the hf: bridge
(common/hf.py) alike, so neither needs the other for them."""
from __future__ import annotations

from dataclasses import dataclass

PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = 0, 1, 2, 3, 4
SPECIAL_IDS = (PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID)
SPECIAL_PIECES = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclass(frozen=True)
class Reserved:
    """The ids never sampled as a replacement: the first `head` of the vocabulary (the five specials) and its
    last `tail`. Ours reserve the specials only; an hf: tokenizer (common/hf.py) numbers its other special
    tokens and unused entries last, so that its frequent pieces get the small ids that compress best."""
    head: int = len(SPECIAL_IDS)
    tail: int = 0

    def __post_init__(self):
        assert self.head >= len(SPECIAL_IDS) and self.tail >= 0, self

    def stop(self, vocab_size: int) -> int:
        """The end of the ids a replacement may be: [head, stop)."""
        return vocab_size - self.tail

    @classmethod
    def of(cls, meta: dict) -> "Reserved":
        """From a tokenizer's or aux model's metadata: `reserved` (the head) and `reserved_tail`; files written
        before the tail existed numbered an hf: tokenizer's reserved block right after the specials."""
        return cls(int(meta.get("reserved") or len(SPECIAL_IDS)), int(meta.get("reserved_tail") or 0))
