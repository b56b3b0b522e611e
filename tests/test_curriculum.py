"""The RTD corruption rules: masking, temperature, sampling, labels (paper section 3)."""
import numpy as np
import pytest
import torch

from common.curriculum import (choose_masked_positions, num_to_mask, row_fraction, row_rng, rtd_labels,
                               sample_replacements)
from tests.conftest import temperature_at
from common.tokenizer import CLS_ID, MASK_ID, PAD_ID, SEP_ID, SPECIAL_IDS, UNK_ID


def test_label_is_zero_when_sample_equals_original():
    original = np.array([CLS_ID, 10, 11, 12, 13, SEP_ID])
    corrupted = np.array([CLS_ID, 10, 99, 12, 13, SEP_ID])  # position 1 was masked but resampled to 10
    assert rtd_labels(original, corrupted).tolist() == [0, 0, 1, 0, 0, 0]
    assert rtd_labels(original, corrupted).dtype == np.int8


@pytest.mark.parametrize("length", [3, 8, 17, 40, 126])
def test_masking_exact_count_and_never_special(length):
    rng = np.random.default_rng(0)
    body = rng.integers(5, 300, size=length)
    body[::7] = UNK_ID  # an [UNK] inside the text is special too
    ids = np.concatenate([[CLS_ID], body, [SEP_ID]])
    candidates = int((~np.isin(ids, SPECIAL_IDS)).sum())
    for seed in range(20):
        positions = choose_masked_positions(ids, 0.15, row_rng(seed, 0, 5))
        assert len(positions) == num_to_mask(candidates, 0.15) == int(np.floor(0.15 * candidates + 0.5))
        assert len(set(positions.tolist())) == len(positions)
        assert not np.isin(ids[positions], SPECIAL_IDS).any()


def test_round_half_up():
    assert num_to_mask(10, 0.15) == 2   # 1.5 -> 2 (Python's round would give 2 too)
    assert num_to_mask(30, 0.15) == 5   # 4.5 -> 5 (Python's round(4.5) == 4)
    assert num_to_mask(3, 0.15) == 0


def test_temperature_schedule_end_points_and_per_row_u():
    """The generator's per-row temperatures (`common.plan.epoch_curriculum`) against eq. (exp-decay) written out
    apart (tests.conftest.temperature_at): T0 at u = 0, 1 + e^-1 at u = tau, 1 + e^-10 at u = 1, falling."""
    from common.config import GenerateConfig
    from common.plan import epoch_curriculum
    u = row_fraction(np.array([0, 5, 9]), 10)
    assert u.tolist() == [0.0, 0.5, 0.9]
    rows = np.array([0, 10, 100])  # u = 0, tau, 1 of 100 rows
    temperatures, gammas = epoch_curriculum(GenerateConfig(t0=2.0, tau=0.1), 0, rows, 100)
    assert temperatures[0] == 2.0
    assert temperatures[1:] == pytest.approx([1 + np.exp(-1), 1 + np.exp(-10)], rel=1e-12)
    assert temperatures == pytest.approx(temperature_at(rows / 100, 2.0, 0.1), rel=1e-12)
    assert gammas == pytest.approx(temperatures - 1.0)
    temperatures, _ = epoch_curriculum(GenerateConfig(t0=3.0, tau=0.5), 0, np.arange(100), 100)
    assert np.all(np.diff(temperatures) < 0) and temperatures == pytest.approx(temperature_at(np.arange(100) / 100, 3.0, 0.5))


def test_per_row_rng_depends_only_on_seed_epoch_row():
    a = row_rng(1, 2, 3).random(4)
    assert np.array_equal(a, row_rng(1, 2, 3).random(4))
    assert not np.array_equal(a, row_rng(1, 2, 4).random(4))
    assert not np.array_equal(a, row_rng(1, 3, 3).random(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1e-3, 1.0, 2.0, 1e3])
def test_sampling_in_range_never_special(dtype, temperature):
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    logits = (torch.randn(400, vocab, generator=gen) * 30).to(dtype)
    logits[:, MASK_ID] = 1e4 if dtype == torch.float32 else 6e4 if dtype == torch.float16 else 1e30  # aux loves [MASK]
    uniforms = torch.rand(400, generator=gen, dtype=torch.float64)
    uniforms[:3] = torch.tensor([0.0, 1 - 1e-16, 0.5])
    out = sample_replacements(logits, torch.full((400,), temperature), uniforms)
    assert out.dtype == torch.long and out.min() >= 0 and out.max() < vocab
    assert not torch.isin(out, torch.tensor(SPECIAL_IDS)).any()


def test_sampling_follows_the_tempered_distribution():
    logits = torch.log(torch.tensor([[1e-9, 1e-9, 1e-9, 1e-9, 1e-9, 0.7, 0.2, 0.1]])).repeat(20000, 1)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for t in (1.0, 2.0):
        out = sample_replacements(logits.clone(), torch.full((20000,), t), u)
        freq = torch.bincount(out, minlength=8)[5:].double() / 20000
        expected = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64) ** (1 / t)
        assert torch.allclose(freq, expected / expected.sum(), atol=0.015)


def test_low_temperature_is_argmax_and_sampling_is_deterministic():
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(2))
    u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cold = sample_replacements(logits.clone(), torch.full((64,), 1e-4), u)
    masked = logits.clone()
    masked[:, list(SPECIAL_IDS)] = -float("inf")
    assert torch.equal(cold, masked.argmax(-1))
    t = torch.full((64,), 1.5)
    assert torch.equal(sample_replacements(logits.clone(), t, u), sample_replacements(logits.clone(), t, u))
    assert PAD_ID not in cold.tolist()
