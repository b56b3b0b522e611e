"""Augmentation functions that change the auxiliary model's input or modules (paper appendix C).

Temperature scaling and logarithmic interpolation change the output distribution and live
in `common.distributions`. Here: drop-token (the aux input) and dropout / attention
dropout at a per-row rate gamma (the aux modules). The aux model stays frozen and
untouched: `RowDropout` is dropout applied per row inside the model's own encoder forward,
each row's masks drawn from a generator of its own seeded from (seed, epoch, row id), so they do not depend on the rows it is batched with (the generator batches a shard,
fast-online a rank's slice: the same rows, the same masks); at rate 0 it equals the model's
own forward (a test checks it).
"""
from __future__ import annotations

import numpy as np
import torch

from common.curriculum import num_to_mask
from common.model import MaskedLM
from common.tokenizer import SPECIAL_IDS, UNK_ID


def choose_dropped_tokens(masked_ids: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Appendix C, 'Drop token': sorted positions of round(rate * n) of the n non-special tokens of the
    aux input (already holding [MASK]), to be replaced by [UNK]. Special tokens are never dropped."""
    candidates = np.flatnonzero(~np.isin(masked_ids, SPECIAL_IDS))
    k = num_to_mask(len(candidates), rate)
    return np.sort(rng.choice(candidates, size=k, replace=False)) if k else np.zeros(0, dtype=np.int64)


def drop_tokens(masked_ids: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """The aux input with a `rate` fraction of its non-special tokens replaced by [UNK] (a copy)."""
    out = masked_ids.copy()
    out[choose_dropped_tokens(masked_ids, rate, rng)] = UNK_ID
    return out


def row_generators(seed: int, epoch: int, row_ids, device) -> list[torch.Generator]:
    """One torch generator per row, seeded from (seed, epoch, row id): the dropout masks of a row
    depend on nothing else, not on the rows batched with it, the worker count or restarts."""
    gens = []
    for row_id in row_ids:
        state = np.random.SeedSequence([int(seed), int(epoch), int(row_id), 0xD809]).generate_state(2, dtype=np.uint32)
        gen = torch.Generator(device=device)
        gen.manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)  # 62 bits, a valid torch seed
        gens.append(gen)
    return gens


def _dropout(x: torch.Tensor, rates: torch.Tensor | None, gens: list | None, lengths: list[int]) -> torch.Tensor:
    """Inverted dropout with one rate per row (dim 0); rate 0 leaves a row exactly as it was. Row b's
    mask covers its own `lengths[b]` tokens ((tokens, width) for activations, (heads, tokens, tokens)
    for attention probabilities; None: every row all of its tokens), drawn from `gens[b]`; padding is kept
    (it is never read)."""
    if rates is None:
        return x
    if lengths is None:
        lengths = [x.shape[2] if x.dim() == 4 else x.shape[1]] * x.shape[0]
    keep = (1.0 - rates.float()).view(-1, *[1] * (x.dim() - 1))
    mask = torch.ones(x.shape, dtype=torch.bool, device=x.device)
    for b, (gen, n) in enumerate(zip(gens, lengths)):
        if x.dim() == 3:  # (batch, tokens, width)
            mask[b, :n] = torch.rand((n, *x.shape[2:]), generator=gen, device=x.device) < keep[b]
        else:             # (batch, heads, queries, keys)
            mask[b, :, :n, :n] = torch.rand((x.shape[1], n, n), generator=gen, device=x.device) < keep[b]
    return x * (mask / keep).to(x.dtype)


class RowDropout:
    """Per-row dropout for `common.model.Encoder.forward(..., drop=)` (paper appendix C): activations
    (embeddings, residual branches) at rate `dropout[b]` and / or attention probabilities at rate
    `attention_dropout[b]` for row b, drawn from `generators[b]` in the order the encoder reaches them."""

    def __init__(self, attention_mask: torch.Tensor | None, dropout: torch.Tensor | None = None,
                 attention_dropout: torch.Tensor | None = None, generators: list | None = None):
        lengths = None if attention_mask is None else attention_mask.sum(1).tolist()  # None: no row padded
        self.hidden = lambda x: _dropout(x, dropout, generators, lengths)
        self.attention = None if attention_dropout is None else (
            lambda probs: _dropout(probs, attention_dropout, generators, lengths))


def forward_with_dropout(model: MaskedLM, input_ids, attention_mask, masked_positions,
                         dropout: torch.Tensor | None = None, attention_dropout: torch.Tensor | None = None,
                         generators: list | None = None) -> torch.Tensor:
    """Appendix C, 'Dropout' / 'Drop attention': the aux MLM forward (the model's own encoder) with
    `RowDropout`. Returns logits (num_masked, vocab) like `MaskedLM.forward`."""
    drop = RowDropout(attention_mask, dropout, attention_dropout, generators)
    return model.logits(model.masked_hidden(input_ids, attention_mask, masked_positions, drop))
