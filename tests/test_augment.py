"""Augmentations of the aux model (paper appendix C): drop-token and per-row (attention) dropout."""
import numpy as np
import pytest
import torch

from common.augment import choose_dropped_tokens, drop_tokens, forward_with_dropout, row_generators
from common.config import ModelConfig
from common.curriculum import num_to_mask, row_rng
from common.model import MaskedLM
from common.tokenizer import CLS_ID, MASK_ID, PAD_ID, SEP_ID, SPECIAL_IDS, UNK_ID


def _masked_row(seed=0, length=40):
    rng = np.random.default_rng(seed)
    ids = np.concatenate([[CLS_ID], rng.integers(5, 300, size=length), [SEP_ID], [PAD_ID] * 3])
    ids[rng.choice(np.arange(1, length + 1), size=6, replace=False)] = MASK_ID
    ids[[5, 17]] = UNK_ID  # an [UNK] in the text is special too
    return ids


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5, 1.0])
def test_drop_token_never_replaces_special_tokens_and_drops_the_exact_fraction(rate):
    ids = _masked_row()
    candidates = ~np.isin(ids, SPECIAL_IDS)
    for seed in range(10):
        dropped = choose_dropped_tokens(ids, rate, row_rng(seed, 0, 1))
        assert len(dropped) == num_to_mask(int(candidates.sum()), rate) == len(set(dropped.tolist()))
        assert candidates[dropped].all()
        out = drop_tokens(ids, rate, row_rng(seed, 0, 1))
        special = np.isin(ids, SPECIAL_IDS)
        assert np.array_equal(out[special], ids[special])  # [CLS] [SEP] [PAD] [MASK] [UNK] stay
        assert np.array_equal(out != ids, np.isin(np.arange(len(ids)), dropped))
        assert (out[out != ids] == UNK_ID).all()
    assert np.array_equal(drop_tokens(ids, 0.3, row_rng(3, 1, 2)), drop_tokens(ids, 0.3, row_rng(3, 1, 2)))


def _tiny_aux():
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, rel_buckets=8, rel_max_distance=16)
    return MaskedLM(cfg, vocab_size=60, num_layers=2).eval()


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 60, (3, 12), generator=gen)
    attn = torch.ones(3, 12, dtype=torch.bool)
    attn[2, 9:] = False  # a padded row
    ids[2, 9:] = PAD_ID
    flags = torch.zeros(3, 12, dtype=torch.bool)
    flags[:, [2, 5]] = True
    ids[flags] = MASK_ID
    return ids, attn, flags


@torch.no_grad()
def test_rate_zero_is_the_models_own_forward():
    model, (ids, attn, flags) = _tiny_aux(), _batch()
    plain = model(ids, attn, flags)
    zeros = torch.zeros(3)
    for kwargs in ({}, {"dropout": zeros}, {"attention_dropout": zeros}, {"dropout": zeros, "attention_dropout": zeros}):
        out = forward_with_dropout(model, ids, attn, flags, generators=row_generators(0, 0, range(3), "cpu"), **kwargs)
        assert torch.allclose(out, plain, atol=1e-5), kwargs


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dropout", "attention_dropout"])
def test_dropout_is_per_row_and_deterministic_in_its_generator(kind):
    model, (ids, attn, flags) = _tiny_aux(), _batch()
    plain = model(ids, attn, flags).view(3, 2, -1)
    rates = torch.tensor([0.0, 0.5, 0.0])
    run = lambda seed: forward_with_dropout(model, ids, attn, flags, generators=row_generators(seed, 0, range(3), "cpu"),
                                            **{kind: rates}).view(3, 2, -1)
    out = run(7)
    assert torch.allclose(out[[0, 2]], plain[[0, 2]], atol=1e-5)  # rows at rate 0 are untouched
    assert not torch.allclose(out[1], plain[1], atol=1e-3)        # the row at rate 0.5 is not
    assert torch.equal(out, run(7)) and not torch.equal(out, run(8))
    assert model.training is False  # the frozen model's own mode is never switched


def test_row_generators_depend_on_seed_epoch_and_row_only():
    draw = lambda *args: torch.rand(4, generator=row_generators(*args, device="cpu")[0])
    assert torch.equal(draw(1, 0, [5]), draw(1, 0, [5, 9]))  # a row's draws whatever it is batched with
    for other in ((2, 0, [5]), (1, 1, [5]), (1, 0, [9])):
        assert not torch.equal(draw(1, 0, [5]), draw(*other))


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dropout", "attention_dropout"])
def test_a_rows_dropout_does_not_depend_on_the_rows_batched_with_it(kind):
    """The generator batches a shard's rows by length; fast-online batches a rank's slice: the same row
    must get the same masks either way (issue: fast-online differed from the shards for these curricula)."""
    model, (ids, attn, flags) = _tiny_aux(), _batch()
    rates = torch.tensor([0.3, 0.5, 0.4])
    together = forward_with_dropout(model, ids, attn, flags, generators=row_generators(3, 1, [10, 11, 12], "cpu"),
                                    **{kind: rates}).view(3, 2, -1)
    for b in range(3):  # each row alone, at its own length
        n = int(attn[b].sum())
        alone = forward_with_dropout(model, ids[b:b + 1, :n], attn[b:b + 1, :n], flags[b:b + 1, :n],
                                     generators=row_generators(3, 1, [10 + b], "cpu"), **{kind: rates[b:b + 1]})
        torch.testing.assert_close(alone.view(2, -1), together[b], rtol=1e-5, atol=1e-5)
