"""Turning variable-length rows into padded tensors, and grouping rows by length."""
from __future__ import annotations

import numpy as np
import torch

from common.tokenizer import PAD_ID


def pad_rows(rows: list[np.ndarray], pad_value: int = PAD_ID, dtype=torch.long) -> torch.Tensor:
    """(B, longest) tensor, rows left-aligned, padded with `pad_value`."""
    longest = max(len(r) for r in rows)
    out = np.full((len(rows), longest), pad_value, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out).to(dtype)


def attention_mask(lengths: list[int] | np.ndarray, longest: int) -> torch.Tensor:
    lengths = torch.as_tensor(np.asarray(lengths))
    return torch.arange(longest)[None, :] < lengths[:, None]


def length_batches(lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Row indices grouped so that rows * longest <= batch_tokens, rows sorted by length
    (stable), so almost no padding is computed. Deterministic in `lengths` alone."""
    order = np.argsort(lengths, kind="stable")
    batches, current, longest = [], [], 0
    for i in order:
        new_longest = max(longest, int(lengths[i]))
        if current and new_longest * (len(current) + 1) > batch_tokens:
            batches.append(np.array(current))
            current, new_longest = [], int(lengths[i])
        current.append(i)
        longest = new_longest
    if current:
        batches.append(np.array(current))
    return batches
