"""Augmentation functions that change the auxiliary model's input or modules (paper appendix C).

Temperature scaling and logarithmic interpolation change the output distribution and live
in `common.distributions`. Here: drop-token (the aux input) and dropout / attention
dropout at a per-row rate gamma (the aux modules). The aux model stays frozen and
untouched: `forward_with_dropout` is the aux forward of `common.model` with dropout
applied per row, each row's masks drawn from a generator of its own seeded from (seed, epoch,
row id), so they do not depend on the rows it is batched with (the generator batches a shard,
fast-online a rank's slice: the same rows, the same masks); at rate 0 it equals the model's
own forward (a test checks it).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

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
    for attention probabilities), drawn from `gens[b]`; padding is kept (it is never read)."""
    if rates is None:
        return x
    keep = (1.0 - rates.float()).view(-1, *[1] * (x.dim() - 1))
    mask = torch.ones(x.shape, dtype=torch.bool, device=x.device)
    for b, (gen, n) in enumerate(zip(gens, lengths)):
        if x.dim() == 3:  # (batch, tokens, width)
            mask[b, :n] = torch.rand((n, *x.shape[2:]), generator=gen, device=x.device) < keep[b]
        else:             # (batch, heads, queries, keys)
            mask[b, :, :n, :n] = torch.rand((x.shape[1], n, n), generator=gen, device=x.device) < keep[b]
    return x * (mask / keep).to(x.dtype)


def _layer(layer, x, bias, dropout, attention_dropout, gens, lengths):
    """`common.model.EncoderLayer.forward` with per-row dropout (paper appendix C)."""
    batch, length, width = x.shape
    qkv = layer.qkv(layer.ln_attn(x))
    q, k, v = qkv.view(batch, length, 3, layer.num_heads, width // layer.num_heads).permute(2, 0, 3, 1, 4)
    if attention_dropout is None:
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    else:  # dropout on the attention probabilities, as scaled_dot_product_attention's dropout_p does
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + bias
        attn = _dropout(torch.softmax(scores, dim=-1), attention_dropout, gens, lengths) @ v
    attn = attn.transpose(1, 2).reshape(batch, length, width)
    x = x + _dropout(layer.out(attn), dropout, gens, lengths)
    h = layer.ffn_out(F.gelu(layer.ffn_in(layer.ln_ffn(x))))
    return x + _dropout(h, dropout, gens, lengths)


def forward_with_dropout(model: MaskedLM, input_ids, attention_mask, masked_positions,
                         dropout: torch.Tensor | None = None, attention_dropout: torch.Tensor | None = None,
                         generators: list | None = None) -> torch.Tensor:
    """Appendix C, 'Dropout' / 'Drop attention': the aux MLM forward with every activation dropout
    (embeddings, residual branches) at rate `dropout[b]` and / or every attention dropout at rate
    `attention_dropout[b]` for row b, its masks drawn from `generators[b]` (`row_generators`).
    Returns logits (num_masked, vocab) like `MaskedLM.forward`."""
    enc = model.encoder
    lengths = attention_mask.sum(1).tolist()
    x = _dropout(enc.ln_embed(enc.embed(input_ids)), dropout, generators, lengths)
    pad = torch.zeros(attention_mask.shape, dtype=x.dtype, device=x.device)
    pad = pad.masked_fill(~attention_mask.bool(), float("-inf"))[:, None, None, :]
    bias = enc.rel_bias(input_ids.shape[1]).to(x.dtype) + pad
    for layer in enc.layers:
        x = _layer(layer, x, bias, dropout, attention_dropout, generators, lengths)
    return model.head(enc.ln_final(x)[masked_positions])
