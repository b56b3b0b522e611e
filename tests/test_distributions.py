"""Replaced-token distributions and the sampler (paper section 3, section 5.1, appendix C):
the footnote identity, smoothed one-hot mass, normalisation in fp32, and no NaN / special /
out-of-range sample at any temperature or gamma, in fp32, fp16 and bf16."""
import math

import numpy as np
import pytest
import torch

from common.curriculum import sample_replacements
from common.distributions import (aux_log_probs, log_interpolation, replacement_probs, sample_from_log_weights,
                                  sample_temperature, smoothed_one_hot_log_probs, temperature_scaled,
                                  term_frequency_log_probs, uniform_log_probs)
from common.tokenizer import SPECIAL_IDS, Reserved

V = 60
NUM_SPECIAL = len(SPECIAL_IDS)


def _logits(rows=32, scale=4.0, seed=0, dtype=torch.float32):
    return (torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _counts(seed=1):
    counts = np.random.default_rng(seed).zipf(1.3, size=V).astype(np.int64)
    counts[[7, 20]] = 0  # tokens the corpus never holds
    counts[list(SPECIAL_IDS)] = 1000  # [CLS] / [SEP] are counted in the corpus, never a replacement
    return counts


@pytest.mark.parametrize("gamma", [0.0, 0.2, 0.5, 0.9, 0.999])
def test_log_interpolation_with_uniform_is_temperature_scaling(gamma):
    """Appendix C footnote: gamma log p_UNF + (1 - gamma) log p_aux = (1/T) log p_aux + const, T = 1/(1-gamma)."""
    log_p = aux_log_probs(_logits())
    g = torch.full((len(log_p),), gamma)
    interpolated = replacement_probs(log_interpolation(uniform_log_probs(1, V)[0], log_p, g))
    tempered = replacement_probs(temperature_scaled(log_p, torch.full((len(log_p),), 1.0 / (1.0 - gamma))))
    assert torch.allclose(interpolated, tempered, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("alpha", [0.35, 0.01, 0.9])
def test_smoothed_one_hot_puts_one_minus_alpha_on_the_original(alpha):
    originals = torch.tensor([5, 6, 33, V - 1])
    probs = replacement_probs(smoothed_one_hot_log_probs(originals, V, alpha))
    rows = torch.arange(len(originals))
    assert probs.dtype == torch.float32
    assert torch.allclose(probs[rows, originals], torch.full((4,), 1.0 - alpha), atol=1e-6, rtol=0)
    others = probs.clone()
    others[rows, originals] = 0
    assert (others[:, list(SPECIAL_IDS)] == 0).all()
    rest = others[:, NUM_SPECIAL:]
    expected = alpha / (V - NUM_SPECIAL - 1)
    assert torch.allclose(rest[rest > 0], torch.tensor(expected), rtol=1e-5)
    assert int((rest > 0).sum()) == 4 * (V - NUM_SPECIAL - 1)


def test_samples_follow_smoothed_one_hot_and_term_frequency():
    n = 20000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    soh = sample_from_log_weights(smoothed_one_hot_log_probs(torch.full((n,), 9), V, 0.35), u)
    assert abs(float((soh == 9).double().mean()) - 0.65) < 0.015
    counts = _counts()
    tf = sample_from_log_weights(term_frequency_log_probs(counts).expand(n, V).clone(), u)
    freq = torch.bincount(tf, minlength=V).double() / n
    expected = counts.astype(np.float64)
    expected[list(SPECIAL_IDS)] = 0
    assert torch.allclose(freq, torch.from_numpy(expected / expected.sum()), atol=0.015)
    assert not torch.isin(tf, torch.tensor([7, 20, *SPECIAL_IDS])).any()


def _all_distributions(gamma: float) -> dict:
    logits = _logits(rows=8)
    g = torch.full((8,), gamma)
    originals = torch.arange(8) + 10
    log_tf = term_frequency_log_probs(_counts())
    soh = smoothed_one_hot_log_probs(originals, V, 0.35)
    unf = uniform_log_probs(8, V)
    return {
        "uniform": unf, "term_frequency": log_tf.expand(8, V), "smoothed_one_hot": soh,
        "uniform_to_soh": log_interpolation(unf[0], soh, g), "tf_to_soh": log_interpolation(log_tf, soh, g),
        "temperature": temperature_scaled(aux_log_probs(logits), 1.0 + g),
        "tf_interpolation": log_interpolation(log_tf, aux_log_probs(logits), g),
    }


@pytest.mark.parametrize("gamma", [0.0, 1e-12, 0.3, 1.0 - 1e-7, 1.0])
def test_every_distribution_sums_to_one_in_fp32_with_no_mass_on_specials(gamma):
    for name, log_w in _all_distributions(gamma).items():
        probs = replacement_probs(log_w)
        assert probs.dtype == torch.float32, name
        assert torch.isfinite(probs).all(), name
        assert torch.allclose(probs.sum(-1), torch.ones(len(probs)), atol=1e-5), name
        assert (probs[:, list(SPECIAL_IDS)] == 0).all(), name


def test_interpolation_end_points_are_exact_even_with_zero_mass():
    log_tf = term_frequency_log_probs(_counts())  # -inf at the never-seen tokens
    soh = smoothed_one_hot_log_probs(torch.tensor([10, 11]), V, 0.35)
    assert torch.equal(log_interpolation(log_tf, soh, torch.zeros(2)), soh)
    assert torch.equal(log_interpolation(log_tf, soh, torch.ones(2)), log_tf.expand(2, V))
    middle = log_interpolation(log_tf, soh, torch.full((2,), 0.5))
    assert not torch.isnan(middle).any() and (middle[:, [7, 20]] == float("-inf")).all()


def _nasty_logits(dtype):
    x = _logits(rows=64, scale=30.0, seed=5, dtype=torch.float32)
    big = torch.finfo(dtype).max
    x[0] = -float("inf")                      # no finite logit at all
    x[1] = float("nan")                       # a broken model
    x[2, 30] = float("inf")                   # fp16 overflow to +inf
    x[3, [11, 40]] = float("inf")             # two of them
    x[4, 12] = float("nan")                   # one NaN among finite logits
    x[5] = -big                               # all equal and hugely negative
    x[6, 8], x[6, 9] = big, -big              # extreme spread
    x[7, list(SPECIAL_IDS)] = big             # the aux model loves [MASK]
    x[8, NUM_SPECIAL:] = -float("inf")        # mass only on specials
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.0, 1e-30, 1e-6, 1e-3, 1.0, 2.0, 1e6, 1e30, math.inf])
def test_sampling_at_any_temperature_is_in_range_and_never_special(dtype, temperature):
    logits = _nasty_logits(dtype)
    keep = logits.clone()
    u = torch.rand(len(logits), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    u[:3] = torch.tensor([0.0, 1 - 1e-16, 0.5], dtype=torch.float64)
    t = torch.full((len(logits),), temperature)
    for out in (sample_temperature(logits, t, u), sample_replacements(logits, t, u)):
        assert out.dtype == torch.long and out.min() >= 0 and out.max() < V
        assert not torch.isin(out, torch.tensor(SPECIAL_IDS)).any()
        assert out[2] == 30 and int(out[3]) in (11, 40)  # an overflowed logit is the mode, not a NaN row
    assert torch.equal(logits.isnan(), keep.isnan()) and torch.equal(logits.nan_to_num(), keep.nan_to_num())
    probs = replacement_probs(temperature_scaled(aux_log_probs(logits), t))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(len(probs)), atol=1e-5)
    if temperature == 1.0:  # where the fast form is finite, the stable one agrees with it
        assert out[20] == sample_from_log_weights(aux_log_probs(logits[20:21]), u[20:21])[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gamma", [0.0, 1e-30, 0.5, 1.0 - 1e-7, 1.0])
def test_sampling_at_any_gamma_is_in_range_and_never_special(dtype, gamma):
    log_p = aux_log_probs(_nasty_logits(dtype))
    g = torch.full((len(log_p),), gamma)
    originals = torch.arange(len(log_p)) % (V - NUM_SPECIAL) + NUM_SPECIAL
    log_tf = term_frequency_log_probs(_counts())
    u = torch.rand(len(log_p), dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for log_w in (log_interpolation(log_tf, log_p, g),
                  log_interpolation(uniform_log_probs(1, V)[0], log_p, g),
                  log_interpolation(log_tf, smoothed_one_hot_log_probs(originals, V, 0.35), g)):
        probs = replacement_probs(log_w)
        assert torch.isfinite(probs).all() and (probs[:, list(SPECIAL_IDS)] == 0).all()
        out = sample_from_log_weights(log_w.clone(), u)
        assert out.min() >= NUM_SPECIAL and out.max() < V


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1e-6, 1.0, 1e6])
def test_reserved_ids_at_either_end_are_never_sampled(dtype, temperature):
    """An hf: tokenizer numbers its other special tokens and unused entries last (common/hf.py): no sampler
    returns one of them or a special, even where the aux model puts its mass there or its rows are broken."""
    reserved = Reserved(head=NUM_SPECIAL, tail=7)
    stop = reserved.stop(V)
    logits = _nasty_logits(torch.float32)
    logits[9:20, stop:] = 1e4                      # the aux model loves [unusedN]
    logits[20, :stop] = -float("inf")              # mass only on the reserved tail
    logits = logits.to(dtype)
    u = torch.rand(len(logits), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    u[:2] = torch.tensor([0.0, 1 - 1e-16], dtype=torch.float64)
    t = torch.full((len(logits),), temperature)
    log_p = aux_log_probs(logits, reserved)
    healthy = aux_log_probs(logits[9:20], reserved)  # (broken rows are made finite first; the sampler masks them)
    assert (healthy[:, :NUM_SPECIAL] == -float("inf")).all() and (healthy[:, stop:] == -float("inf")).all()
    assert torch.allclose(healthy.exp().sum(-1), torch.ones(len(healthy)), atol=1e-5)
    for out in (sample_temperature(logits, t, u, reserved), sample_from_log_weights(log_p.clone(), u, reserved),
                sample_from_log_weights(log_interpolation(uniform_log_probs(1, V)[0], log_p, t.clamp(max=1)), u,
                                        reserved)):
        assert out.min() >= NUM_SPECIAL and out.max() < stop
    assert torch.equal(sample_temperature(logits, t, u), sample_temperature(logits, t, u, Reserved()))



def test_smoothed_one_hot_and_uniform_keep_their_mass_with_an_hf_tokenizers_reserved_tail():
    """BERT-like: 994 unused entries numbered last get no mass from the sampler, so the distributions
    normalise over the ids a replacement may be: the original keeps exactly 1 - alpha (before: over
    V - 5, alpha came out 0.343 instead of 0.35), and uniform is 1 / (the sampled ids) on each."""
    from common.distributions import _fill_reserved, smoothed_one_hot_log_probs, uniform_log_probs
    vocab, reserved = 30_522, Reserved(head=5, tail=994)
    originals = torch.tensor([7, 1000, 29_000])
    soh = smoothed_one_hot_log_probs(originals, vocab, 0.35, reserved)
    sampled = torch.softmax(_fill_reserved(soh.clone(), reserved, float("-inf")), dim=-1)
    torch.testing.assert_close(sampled[torch.arange(3), originals], torch.full((3,), 0.65), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(soh.exp().sum(-1), torch.ones(3), rtol=1e-5, atol=1e-6)  # already a distribution
    uniform = uniform_log_probs(2, vocab, reserved=reserved).exp()
    torch.testing.assert_close(uniform.sum(-1), torch.ones(2), rtol=1e-5, atol=1e-6)
    assert uniform[0, -994:].sum() == 0 and uniform[0, :5].sum() == 0


def test_scratch_buffers_draw_the_same_ids_and_are_kept_from_call_to_call():
    """`scratch` (the Corruptor's kept (K, V) buffers for the scaled logits and the CDF) changes where the
    sampler writes, not what it draws: chunks of several sizes, NaN and infinite rows included, give the ids of
    fresh tensors; a smaller chunk reuses the buffers of a larger one instead of allocating."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(300, 512, generator=g) * 4
    logits[7] = float("nan")
    logits[11, 40] = float("inf")
    temperature = 1 + torch.rand(300, generator=g)
    uniforms = torch.rand(300, generator=g, dtype=torch.float64)
    scratch = {}
    for rows in (slice(0, 300), slice(0, 120), slice(120, 300), slice(5, 13)):
        fresh = sample_temperature(logits[rows], temperature[rows], uniforms[rows])
        kept = sample_temperature(logits[rows], temperature[rows], uniforms[rows], scratch=scratch)
        assert torch.equal(fresh, kept), rows
        log_w = torch.log_softmax(logits[rows].nan_to_num(nan=0.0), -1)
        assert torch.equal(sample_from_log_weights(log_w.clone(), uniforms[rows]),
                           sample_from_log_weights(log_w.clone(), uniforms[rows], scratch=scratch)), rows
    assert set(scratch) == {"scaled", "cdf"} and all(b.numel() == 300 * 512 for b in scratch.values())
    first = {k: b.data_ptr() for k, b in scratch.items()}
    sample_temperature(logits[:50], temperature[:50], uniforms[:50], scratch=scratch)
    assert {k: b.data_ptr() for k, b in scratch.items()} == first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [8, 1024])
def test_the_blocked_draw_for_compilation_is_the_step_by_step_draw(dtype, block):
    """`chunk_draws` (what the GPU compiles: the inverse CDF by blocks of ids, then inside one block) run eagerly
    leaves the same rows without mass as `temperature_draws`, broken rows and a reserved tail included, and
    draws the same id at every other position but where its sums round otherwise, next to a CDF boundary:
    there the neighbouring allowed id. Blocks of 8 over 60 ids: several blocks, the last one padded."""
    from common.distributions import chunk_draws, temperature_draws
    reserved = Reserved(head=NUM_SPECIAL, tail=7)
    logits = _nasty_logits(torch.float32)
    logits[9:20, reserved.stop(V):] = 1e4
    logits = logits.to(dtype)
    t = torch.linspace(0.05, 3.0, len(logits))
    u = torch.rand(len(logits), dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ids, dead = temperature_draws(logits, t, u, reserved)
    none = torch.full((len(logits),), -1)
    one_ids, one_dead, _ = chunk_draws(logits, t, u, none, reserved.head, reserved.stop(V), block=block)
    assert dead.any() and torch.equal(one_dead, dead)
    assert torch.equal(one_ids[~dead], ids[~dead])
    # many draws from ordinary rows: the same ids but at rounding, and those one id apart
    rows = 4000
    logits = (torch.randn(rows, V, generator=torch.Generator().manual_seed(6)) * 3.0).to(dtype)
    t = torch.rand(rows, generator=torch.Generator().manual_seed(7)) * 2.0 + 0.5
    u = torch.rand(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    ids, dead = temperature_draws(logits, t, u, reserved)
    one_ids, one_dead, _ = chunk_draws(logits, t, u, none[:1].expand(rows), reserved.head, reserved.stop(V),
                                       block=block)
    assert not dead.any() and not one_dead.any()
    differ = one_ids != ids
    assert differ.float().mean() <= 2e-3 and ((one_ids - ids)[differ].abs() == 1).all()
    assert ((one_ids >= reserved.head) & (one_ids < reserved.stop(V))).all()


def test_the_blocked_draw_counts_the_top1_hits_of_its_chunk():
    """`chunk_draws`' third output: how many rows have their largest logit at the original id (a tie for the
    largest counts too); -1 (a padding row) never."""
    from common.distributions import chunk_draws
    logits = _logits(rows=50, seed=9)
    originals = logits.argmax(dim=-1)
    originals[::3] = (originals[::3] + 1) % V  # a third of the rows miss
    originals[-5:] = -1
    logits[1, (originals[1] + 1) % V] = logits[1].max()  # a hit tied with a later id
    logits[2, (originals[2] + 2) % V] = logits[2].max()  # and with an earlier one, where argmax takes the other
    _, _, hits = chunk_draws(logits, torch.ones(50), torch.full((50,), 0.5, dtype=torch.float64), originals,
                             NUM_SPECIAL, V, block=16)
    assert int(hits) == 45 - len(range(0, 45, 3))
