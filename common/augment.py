"""Augmentation functions that change the auxiliary model's input or modules (paper appendix C).

Temperature scaling and logarithmic interpolation change the output distribution and live
in `common.distributions`. Here: drop-token (the aux input) and dropout / attention
dropout at a per-row rate gamma (the aux modules). The aux model stays frozen and
untouched: `forward_with_dropout` is the aux forward of `common.model` with dropout
applied per row from an explicit torch Generator; at rate 0 it equals the model's own
forward (a test checks it).
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


def batch_generator(seed: int, epoch: int, row_ids, device) -> torch.Generator:
    """Dropout masks of one aux batch, seeded from (seed, epoch, the batch's row ids in order).
    The batches of a shard depend only on its rows, so the shard's bytes do not depend on
    worker count or restarts; a different batching of the same rows gives other masks."""
    entropy = [int(seed), int(epoch), 0xD809, *map(int, row_ids)]
    state = np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32)
    gen = torch.Generator(device=device)
    gen.manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)  # 62 bits, a valid torch seed
    return gen


def _dropout(x: torch.Tensor, rates: torch.Tensor | None, gen: torch.Generator | None) -> torch.Tensor:
    """Inverted dropout with one rate per row (dim 0); rate 0 leaves a row exactly as it was."""
    if rates is None:
        return x
    keep = (1.0 - rates.float()).view(-1, *[1] * (x.dim() - 1))
    mask = torch.rand(x.shape, generator=gen, device=x.device) < keep
    return x * (mask / keep).to(x.dtype)


def _layer(layer, x, bias, dropout, attention_dropout, gen):
    """`common.model.EncoderLayer.forward` with per-row dropout (paper appendix C)."""
    batch, length, width = x.shape
    qkv = layer.qkv(layer.ln_attn(x))
    q, k, v = qkv.view(batch, length, 3, layer.num_heads, width // layer.num_heads).permute(2, 0, 3, 1, 4)
    if attention_dropout is None:
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    else:  # dropout on the attention probabilities, as scaled_dot_product_attention's dropout_p does
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + bias
        attn = _dropout(torch.softmax(scores, dim=-1), attention_dropout, gen) @ v
    attn = attn.transpose(1, 2).reshape(batch, length, width)
    x = x + _dropout(layer.out(attn), dropout, gen)
    h = layer.ffn_out(F.gelu(layer.ffn_in(layer.ln_ffn(x))))
    return x + _dropout(h, dropout, gen)


def forward_with_dropout(model: MaskedLM, input_ids, attention_mask, masked_positions,
                         dropout: torch.Tensor | None = None, attention_dropout: torch.Tensor | None = None,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """Appendix C, 'Dropout' / 'Drop attention': the aux MLM forward with every activation dropout
    (embeddings, residual branches) at rate `dropout[b]` and / or every attention dropout at rate
    `attention_dropout[b]` for row b. Returns logits (num_masked, vocab) like `MaskedLM.forward`."""
    enc = model.encoder
    x = _dropout(enc.ln_embed(enc.embed(input_ids)), dropout, generator)
    pad = torch.zeros(attention_mask.shape, dtype=x.dtype, device=x.device)
    pad = pad.masked_fill(~attention_mask.bool(), float("-inf"))[:, None, None, :]
    bias = enc.rel_bias(input_ids.shape[1]).to(x.dtype) + pad
    for layer in enc.layers:
        x = _layer(layer, x, bias, dropout, attention_dropout, generator)
    return model.head(enc.ln_final(x)[masked_positions])
