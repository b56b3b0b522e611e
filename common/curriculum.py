"""Masking, schedules and sampling: the RTD corruption of paper section 3 and the
schedule functions of appendix C.

Everything random is drawn from a per-row numpy Generator seeded from
(seed, epoch, row id), so a row's corruption never depends on batching, worker
count or restarts. Sampling is inverse-CDF on fp32 probabilities with one
uniform per masked position.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from common.distributions import sample_temperature
from common.tokenizer import Reserved

OURS = Reserved()  # our tokenizer's reserved ids: the five specials

VALID_EPOCH = 1_000_000  # the "epoch" whose seeds make the held-out validation rows


def exponential_decay(u, gamma_max: float, tau: float):
    """Paper section 3, eq. (exp-decay), as a strength: gamma(u) = gamma_max exp(-u / tau)."""
    return gamma_max * np.exp(-np.asarray(u, dtype=np.float64) / tau)


def constant(u, gamma_max: float, tau: float):
    """Appendix C, 'Constant': gamma(u) = gamma_0 (tau unused)."""
    return np.full(np.shape(u), gamma_max, dtype=np.float64)


def polynomial_decay(u, gamma_max: float, tau: float):
    """Appendix C, 'Polynomial decay': gamma(u) = gamma_max (1 - u)^tau; a larger tau decays faster."""
    return gamma_max * (1.0 - np.clip(np.asarray(u, dtype=np.float64), 0.0, 1.0)) ** tau


def stepwise_decay(u, gamma_max: float, tau: float):
    """Appendix C, 'Stepwise decay': gamma(u) = gamma_max (1 - floor(u tau) / tau), tau decays."""
    return gamma_max * (1.0 - np.floor(np.clip(np.asarray(u, dtype=np.float64), 0.0, 1.0) * tau) / tau)


SCHEDULE_FUNCTIONS = {"exponential": exponential_decay, "constant": constant,
                      "polynomial": polynomial_decay, "stepwise": stepwise_decay}


def strength_at(u, schedule: str, gamma_max: float, tau: float) -> np.ndarray:
    """Appendix C: the curriculum's strength gamma at fraction of training u (an array, float64)."""
    return SCHEDULE_FUNCTIONS[schedule](u, gamma_max, tau)


def row_fraction(stream_index: np.ndarray, total_rows: int) -> np.ndarray:
    """u of each row: its global index in the training stream / total rows of all epochs."""
    return np.asarray(stream_index, dtype=np.float64) / float(total_rows)


# The stream a row's draws come from: the generator's (and fast-online's, ELECTRA's) or the aux model's
# own MLM training. numpy pads a seed shorter than four words with zeros, so [seed, epoch, row] is
# [seed, epoch, row, 0]: any nonzero fourth word is a stream that never coincides with the generator's.
GENERATOR_STREAM = 0
AUX_MLM_STREAM = 0x41554D  # "AUM"


def row_rng(seed: int, epoch: int, row_id: int, stream: int = GENERATOR_STREAM) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, row_id, stream] if stream else [seed, epoch, row_id])


def num_to_mask(num_candidates: int, mask_prob: float) -> int:
    """round(mask_prob * n), half rounded up (Python's round() would round half to even)."""
    return int(math.floor(mask_prob * num_candidates + 0.5))


def mask_candidates(input_ids: np.ndarray, reserved: Reserved = OURS, vocab_size: int = 0) -> np.ndarray:
    """Positions that may be masked: every token but the reserved ones (the specials; with an hf:
    tokenizer also its other special and unused entries, `reserved.tail` ids below `vocab_size`)."""
    ids = np.asarray(input_ids)
    kept = ids >= reserved.head
    if reserved.tail:
        kept &= ids < reserved.stop(vocab_size)
    return np.flatnonzero(kept)


def masked_count(rows, mask_prob: float, reserved: Reserved = OURS, vocab_size: int = 0) -> int:
    """How many positions `choose_masked_positions` masks in these rows, without drawing them."""
    return sum(num_to_mask(len(mask_candidates(r, reserved, vocab_size)), mask_prob) for r in rows)


def choose_masked_positions(input_ids: np.ndarray, mask_prob: float, rng: np.random.Generator,
                            reserved: Reserved = OURS, vocab_size: int = 0) -> np.ndarray:
    """Sorted positions to mask: exactly round(mask_prob * n) of the n non-reserved tokens
    (appendix A: 15%, special tokens never masked)."""
    candidates = mask_candidates(input_ids, reserved, vocab_size)
    k = num_to_mask(len(candidates), mask_prob)
    return np.sort(rng.choice(candidates, size=k, replace=False)) if k else np.zeros(0, dtype=np.int64)


def row_draws(input_ids: np.ndarray, mask_prob: float, seed: int, epoch: int, row_id: int,
              stream: int = GENERATOR_STREAM, reserved: Reserved = OURS, vocab_size: int = 0):
    """A row's random draws, in the order every path makes them (generate/, fast-online, ELECTRA; the aux
    model's MLM training from a `stream` of its own): its masked positions, then one sampling uniform per
    position. Returns (positions, uniforms, rng); the rng goes on for any later draw of the row
    (appendix C's token dropping)."""
    rng = row_rng(seed, epoch, row_id, stream)
    positions = choose_masked_positions(input_ids, mask_prob, rng, reserved, vocab_size)
    return positions, rng.random(len(positions)), rng


def sample_replacements(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor,
                        reserved: Reserved = OURS) -> torch.Tensor:
    """x_hat ~ Softmax(log p_aux / T) (paper section 3, eq. 1), in fp32, never a special token.

    logits: (K, V) aux outputs at masked positions (any float dtype, left intact); temperature: (K,);
    uniforms: (K,) in [0, 1), one per position. Inverse-CDF sampling, deterministic; five passes
    over (K, V) (see `common.distributions.sample_temperature`).
    """
    return sample_temperature(logits, temperature, uniforms, reserved)


def rtd_labels(original: np.ndarray, corrupted: np.ndarray) -> np.ndarray:
    """1 where the token differs from the original. A sample equal to the original is
    labelled 0 (original), as in the reference ELECTRA."""
    return (original != corrupted).astype(np.int8)
