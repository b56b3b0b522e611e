"""Turning variable-length rows into padded tensors, masked model inputs, and grouping rows by length."""
from __future__ import annotations

import numpy as np
import torch

from common.augment import drop_tokens
from common.curriculum import GENERATOR_STREAM, row_draws
from common.tokenizer import MASK_ID, PAD_ID, Reserved


NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.uint8: np.uint8, torch.float32: np.float32}


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through page-locked memory and without waiting: a copy from pageable
    memory waits for the device's queue to drain first, so the host could not run ahead of the device."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pad_rows(rows: list[np.ndarray], pad_value: int = PAD_ID, dtype=torch.long) -> torch.Tensor:
    """(B, longest) tensor, rows left-aligned, padded with `pad_value`."""
    longest = max(len(r) for r in rows)
    out = np.full((len(rows), longest), pad_value, dtype=NUMPY_DTYPES[dtype])  # built in `dtype`, no conversion
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out)


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


def flat_positions(flags: torch.Tensor) -> torch.Tensor:
    """The True positions of a (B, L) host mask as flat row-major int64 indices (`common.model.at_positions`)."""
    return flags.flatten().nonzero().squeeze(1)


def masked_inputs(rows: list[np.ndarray], row_ids: np.ndarray, epoch: np.ndarray | int, seed: int,
                  mask_prob: float, pad_to: int, stream: int = GENERATOR_STREAM, reserved: Reserved = Reserved(),
                  vocab_size: int = 0, drop_rates: np.ndarray | None = None) -> dict:
    """The one place rows are masked (generate/, fast-online, electra, the aux MLM): per row, masked positions
    and sampling uniforms drawn by `common.curriculum.row_draws` (from `stream`), as padded tensors:
    original_ids, masked_ids, masked_flags, uniforms (row-major over flags), and each row's positions (a list
    of arrays). With `drop_rates`, row i's masked input also gets that fraction of [UNK]s (appendix C), drawn
    after its other draws."""
    epochs = np.broadcast_to(np.asarray(epoch), (len(rows),))
    # filled as numpy arrays: a row's slice assignment costs about a tenth of a torch tensor's
    original = np.zeros((len(rows), pad_to), dtype=np.int64)
    flags = np.zeros((len(rows), pad_to), dtype=bool)
    masked = None if drop_rates is None else np.zeros((len(rows), pad_to), dtype=np.int64)
    positions, uniforms = [], []
    for i, (r, rid, e) in enumerate(zip(rows, row_ids, epochs)):
        pos, u, rng = row_draws(r, mask_prob, seed, int(e), int(rid), stream, reserved, vocab_size)
        positions.append(pos)
        uniforms.append(u)
        original[i, :len(r)] = r
        flags[i, pos] = True
        if masked is not None:
            m = original[i, :len(r)].copy()
            m[pos] = MASK_ID
            masked[i, :len(r)] = drop_tokens(m, float(drop_rates[i]), rng)
    if masked is None:
        masked = np.where(flags, MASK_ID, original)
    return {"original_ids": torch.from_numpy(original), "masked_ids": torch.from_numpy(masked),
            "masked_flags": torch.from_numpy(flags), "positions": positions,
            "uniforms": torch.from_numpy(np.concatenate(uniforms) if uniforms else np.zeros(0))}
