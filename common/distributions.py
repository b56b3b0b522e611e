"""Replaced-token distributions and the one sampler they share (paper sections 3, 5.1, appendix C).

Every distribution is a (K, V) tensor of fp32 log-weights, one row per masked position,
defined up to a constant per row: the sampler normalises them (so interpolations are
renormalised there), gives special tokens zero mass and draws one token per row by
inverse CDF with the row's own uniform. Reserved tokens are outside every distribution:
"the vocabulary" below means the tokens that are not reserved (our five specials, and an hf:
tokenizer's own specials and unused block), so a sample is never [PAD] ... [MASK].

The paper's own path, `sample_temperature`, is five passes over (K, V): since
log p_aux = logits - logsumexp(logits), Softmax(log p_aux / T) = Softmax(logits / T),
and the normalisation is folded into u. Rows that come out without mass there (an
fp16/bf16 overflow, NaN logits, an extreme T) are redone in a stable form: NaN logits
count as -inf, +inf as the largest float, T is clamped to [1e-30, 1e30], log-softmax
first; a row with nothing left is sampled uniformly. 0 * log 0 is taken as 0.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from common.tokenizer import SPECIAL_IDS, Reserved

TEMPERATURE_RANGE = (1e-30, 1e30)
assert SPECIAL_IDS == tuple(range(len(SPECIAL_IDS)))  # the special tokens are the first columns
# An hf: tokenizer (common/hf.py) numbers its other special tokens and unused entries last: the
# `reserved.tail` last columns are never sampled either.
RESERVED = Reserved()  # our tokenizer's: the five specials


def _fill_reserved(x: torch.Tensor, reserved: Reserved, value: float) -> torch.Tensor:
    """`x` (K, V) with `value` in the reserved columns, in place."""
    x[:, :reserved.head] = value
    if reserved.tail:
        x[:, reserved.stop(x.shape[1]):] = value
    return x


def non_special(vocab_size: int, device="cpu", reserved: Reserved = RESERVED) -> torch.Tensor:
    """Bool (V,): True for the tokens a replacement may be."""
    keep = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    keep[reserved.head:reserved.stop(vocab_size)] = True
    return keep


def aux_log_probs(logits: torch.Tensor, reserved: Reserved = RESERVED) -> torch.Tensor:
    """log p_aux over the non-special tokens, fp32, from aux logits of any float dtype (paper eq. 1)."""
    x = _fill_reserved(logits.to(torch.float32, copy=True), reserved, float("-inf"))
    if not torch.isfinite(x[:, reserved.head:reserved.stop(x.shape[1])]).all():  # fp16/bf16 overflow, broken model
        x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
        dead = ~torch.isfinite(x).any(dim=-1)
        if dead.any():
            x[dead] = torch.where(non_special(x.shape[1], x.device, reserved), 0.0, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def temperature_scaled(log_p: torch.Tensor, temperature: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Paper section 3, eq. 1: log p / T, one T per row (a new tensor, or `out`; normalised by the sampler)."""
    t = temperature.float()
    if t.device.type == "cpu" and torch.isnan(t).any():  # on a GPU the check would wait for the device: the
        raise ValueError("a temperature is NaN")  # Corruptor checks the temperatures on the host, before the copy
    return torch.div(log_p, t.clamp(*TEMPERATURE_RANGE)[:, None], out=out)


def scratch_buffer(scratch: dict | None, name: str, like: torch.Tensor, shape: tuple[int, int] | None = None
                   ) -> torch.Tensor | None:
    """A (K, V) fp32 tensor shaped as `like` (or `shape`, on `like`'s device) for an `out=` argument, cut from
    a flat buffer that `scratch` keeps from call to call (None without `scratch`: the op allocates). On CPU a
    fresh (K, V) tensor per call costs its page faults (glibc gives blocks that large back to the kernel when
    freed) about as much as the pass that fills it; a GPU's caching allocator keeps blocks anyway."""
    if scratch is None:
        return None
    rows, cols = shape or like.shape
    flat = scratch.get(name)
    if flat is None or flat.numel() < rows * cols or flat.device != like.device:
        flat = scratch[name] = torch.empty(rows * cols, dtype=torch.float32, device=like.device)
    return flat[:rows * cols].view(rows, cols)


def uniform_log_probs(num_rows: int, vocab_size: int, device="cpu", reserved: Reserved = RESERVED) -> torch.Tensor:
    """Paper section 5.1, 'Uniform': 1 / |V| on every token a replacement may be (|V|: the vocabulary
    less the reserved ids, an hf: tokenizer's unused entries included)."""
    count = reserved.stop(vocab_size) - reserved.head
    row = torch.where(non_special(vocab_size, device, reserved), -math.log(count), float("-inf"))
    return row.repeat(num_rows, 1)


def term_frequency_log_probs(counts: np.ndarray, device="cpu") -> torch.Tensor:
    """Paper section 5.1, 'Term frequency': each token's share of the training corpus, (V,) fp32.
    Special tokens are left out; a token the corpus never holds gets -inf (zero mass)."""
    counts = np.asarray(counts, dtype=np.float64).copy()
    counts[list(SPECIAL_IDS)] = 0.0
    if counts.sum() <= 0:
        raise ValueError("the term counts hold no non-special token")
    with np.errstate(divide="ignore"):
        return torch.from_numpy(np.log(counts / counts.sum())).float().to(device)


def smoothed_one_hot_log_probs(originals: torch.Tensor, vocab_size: int, alpha: float,
                               reserved: Reserved = RESERVED) -> torch.Tensor:
    """Paper section 5.1, 'Smoothed one-hot': 1 - alpha on the original token, alpha / (|V| - 1)
    on each other token a replacement may be, so the sampler (which gives the reserved ids no mass)
    keeps exactly alpha off the original. `originals`: (K,) token ids, never reserved."""
    rest = math.log(alpha / (reserved.stop(vocab_size) - reserved.head - 1))
    out = uniform_log_probs(len(originals), vocab_size, originals.device, reserved)
    out[out > float("-inf")] = rest
    out.scatter_(1, originals.long()[:, None], math.log(1.0 - alpha))
    return out


def log_interpolation(log_easy: torch.Tensor, log_hard: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """Appendix C: p_easy^gamma * p_hard^(1-gamma) in log space, one gamma per row (K,); renormalised
    by the sampler. Used for TF -> aux (augmentation), UNF -> SOH and TF -> SOH (appendix B).
    0 * log 0 counts as 0, so gamma = 0 gives p_hard and gamma = 1 gives p_easy exactly."""
    g = gamma.float().to(log_hard.device)[:, None]
    easy = torch.where(g > 0, g * log_easy, 0.0)
    hard = torch.where(g < 1, (1.0 - g) * log_hard, 0.0)
    return easy + hard


def _uniform_rows(probs: torch.Tensor, rows: torch.Tensor, reserved: Reserved = RESERVED) -> torch.Tensor:
    probs = probs.clone()
    keep = non_special(probs.shape[1], probs.device, reserved)
    probs[rows] = keep.float() / keep.sum()
    return probs


def replacement_probs(log_weights: torch.Tensor, reserved: Reserved = RESERVED) -> torch.Tensor:
    """The distribution a row of log-weights stands for: softmax in fp32, zero on the reserved ids (the
    specials; an hf: tokenizer's unused entries too), uniform where nothing is left. Rows sum to 1."""
    x = _fill_reserved(log_weights.to(torch.float32, copy=True), reserved, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    dead = ~(probs.sum(dim=-1) > 0)  # NaN or no mass
    return _uniform_rows(probs, dead, reserved) if dead.any() else probs


def _inverse_cdf(log_weights: torch.Tensor, uniforms: torch.Tensor, reserved: Reserved = RESERVED,
                 scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, rows without mass). Five passes over (K, V), in place on `log_weights`; the CDF in `scratch`."""
    _fill_reserved(log_weights, reserved, float("-inf"))
    on_cpu = log_weights.device.type == "cpu"
    if on_cpu:  # the values alone: max(dim) also finds indices, ~7x slower on CPU
        log_weights -= log_weights.amax(dim=-1, keepdim=True)
    else:  # on a GPU the mode comes with the maximum in the same pass
        top, mode = log_weights.max(dim=-1, keepdim=True)
        log_weights -= top
    weights = log_weights.exp_()  # unnormalised probabilities, the largest is 1
    cdf = torch.cumsum(weights, dim=-1, out=scratch_buffer(scratch, "cdf", weights))
    # Scale u by the last cdf entry (the total mass) so rounding in the sum never pushes u past the end.
    # First index whose cdf exceeds u: its own weight is > 0.
    targets = (uniforms.double() * cdf[:, -1].double()).float()[:, None]
    idx = torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp_(max=weights.shape[1] - 1)
    # Only rounding at the very end can land past the mass; fall back to the mode there.
    bad = weights.gather(1, idx[:, None]).squeeze(1) <= 0
    if not on_cpu:  # every row's mode, chosen where needed: asking whether any is would wait for the device
        idx = torch.where(bad, mode.squeeze(1), idx)
    elif bad.any():  # on CPU argmax is a slow reduction: only the rows that need it
        idx = idx.clone()
        idx[bad] = weights[bad].argmax(dim=-1)
    return idx, ~(cdf[:, -1] > 0)  # NaN (inf - inf, a NaN input) or no mass at all


def sample_from_log_weights(log_weights: torch.Tensor, uniforms: torch.Tensor,
                            reserved: Reserved = RESERVED, scratch: dict | None = None) -> torch.Tensor:
    """One token per row of (K, V) fp32 log-weights, by inverse CDF with `uniforms` (K,) in [0, 1).
    Deterministic, never a special (reserved) token, always in [0, V); a row without mass is sampled
    uniformly. `log_weights` is overwritten. `scratch`: buffers kept across calls (`scratch_buffer`)."""
    idx, dead = _inverse_cdf(log_weights, uniforms, reserved, scratch)
    if dead.any():
        flat = torch.where(non_special(log_weights.shape[1], log_weights.device, reserved), 0.0, float("-inf"))
        idx[dead] = _inverse_cdf(flat.repeat(int(dead.sum()), 1), uniforms[dead], reserved)[0]
    return idx


def sample_temperature(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor,
                       reserved: Reserved = RESERVED, scratch: dict | None = None) -> torch.Tensor:
    """Paper section 3, eq. 1: x_hat ~ Softmax(log p_aux / T) = Softmax(logits / T), one T per row.
    `logits` (any float dtype) are left intact; rows the fast form leaves without mass are redone
    from the stable log p_aux. `scratch`: buffers kept across calls (`scratch_buffer`), the same draws."""
    idx, dead = temperature_draws(logits, temperature, uniforms, reserved, scratch)
    if dead.any():
        idx[dead] = redraw_without_mass(logits[dead], temperature[dead], uniforms[dead], reserved)
    return idx


def temperature_draws(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor,
                      reserved: Reserved = RESERVED, scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_temperature`'s fast form alone (paper section 3, eq. 1): (ids, rows it left without mass), never
    waiting for the device. The caller redraws those rows (`redraw_without_mass`), at a time of its choosing."""
    # bf16 logits are widened inside the division (fp32 temperatures): one pass, the same values as widening first
    scaled = temperature_scaled(logits, temperature, out=scratch_buffer(scratch, "scaled", logits))
    return _inverse_cdf(scaled, uniforms, reserved, scratch)


def chunk_draws(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor, originals: torch.Tensor,
                head: int, stop: int, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`temperature_draws` (paper section 3, eq. 1) as one pure function of a chunk, for `torch.compile`, and
    the chunk's aux top-1 hits: rows whose original id (`originals`; -1 on padding rows) has the row's largest
    logit. The inverse CDF in two levels: the mass of each `block` of ids, a search among the blocks, then the
    running sum inside the one block the uniform falls in (recomputed from the logits). So the (K, V) entries
    are read twice (the maxima; the blocks' masses) and nothing of size (K, V) is written: the step-by-step form
    writes the scaled logits, their exp and their cumulative sum, and finds the mode. The same distribution;
    the sums round in another order, so a draw near a boundary of the CDF can land on the neighbouring id
    (measured in tests/test_distributions.py and docs/benchmarks.md); a uniform that rounding carries past the
    mass takes the last id with mass, where the step-by-step form takes the mode. `head` / `stop`: the ids a
    replacement may be, [head, stop)."""
    rows, vocab = logits.shape
    blocks = -(-vocab // block)
    own = logits.gather(1, originals.clamp(min=0)[:, None]).squeeze(1)
    hits = ((own == logits.amax(dim=-1)) & (originals >= 0)).sum()
    t = temperature.float().clamp(*TEMPERATURE_RANGE)[:, None]
    col = torch.arange(blocks * block, device=logits.device)
    allowed = (col >= head) & (col < stop)
    wide = F.pad(logits, (0, blocks * block - vocab)) if blocks * block > vocab else logits
    x = torch.where(allowed, wide.float() / t, float("-inf"))
    top = x.amax(dim=-1, keepdim=True)
    mass = (x - top).exp().view(rows, blocks, block).sum(dim=-1)  # (K, blocks)
    cdf = mass.cumsum(dim=-1)
    total = cdf[:, -1:]
    targets = (uniforms.double()[:, None] * total.double()).float()
    last_block = torch.where(mass > 0, torch.arange(blocks, device=logits.device), 0).amax(dim=-1, keepdim=True)
    which = torch.minimum(torch.searchsorted(cdf, targets, right=True), last_block)  # (K, 1)
    before = torch.where(which > 0, cdf.gather(1, (which - 1).clamp(min=0)), 0.0)
    inside = which * block + torch.arange(block, device=logits.device)  # (K, block) ids of that block
    weights = (x.gather(1, inside) - top).exp()
    last = torch.where(weights > 0, torch.arange(block, device=logits.device), 0).amax(dim=-1, keepdim=True)
    within = torch.minimum(torch.searchsorted(before + weights.cumsum(dim=-1), targets, right=True), last)
    return (which * block + within).squeeze(1), ~(total.squeeze(1) > 0), hits


def redraw_without_mass(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor,
                        reserved: Reserved = RESERVED) -> torch.Tensor:
    """The rows `temperature_draws` left without mass (logits / T overflowing, or NaN), drawn from the stable
    log p_aux / T (paper eq. 1), or uniformly where that has no mass either."""
    return sample_from_log_weights(temperature_scaled(aux_log_probs(logits, reserved), temperature), uniforms, reserved)
