"""Every curriculum through the generator's own Corruptor, on the fixture corpus and 2-layer aux
(paper section 5.1, appendix C): the label rule, no special / out-of-range replacement at extreme
strengths, determinism, and the default path left exactly as it was."""

import numpy as np
import pytest

from common.checkpoint import AUX_FILE
from common.config import GenerateConfig
from common.corpus import TERM_COUNTS_FILE, load_corpus_meta, load_split, term_counts
from common.tokenizer import SPECIAL_IDS
from common.plan import epoch_curriculum, generation_key
from common.corrupt import Corruptor

CURRICULA = [
    ("aux", "temperature", 1.0), ("aux", "tf_interpolation", 1.0), ("aux", "dropout", 0.9),
    ("aux", "attention_dropout", 0.9), ("aux", "drop_token", 1.0), ("uniform", "temperature", 1.0),
    ("term_frequency", "temperature", 1.0), ("smoothed_one_hot", "temperature", 1.0),
    ("uniform_to_soh", "temperature", 1.0), ("tf_to_soh", "temperature", 1.0),
]


def _corruptor(built, distribution="aux", augmentation="temperature", gamma_max=1.0):
    cfg = GenerateConfig(distribution=distribution, augmentation=augmentation, gamma_max=gamma_max,
                         mask_prob=0.15, batch_tokens=200)
    return Corruptor.from_config(built.aux_dir / AUX_FILE, 3, cfg, built.corpus_dir)


def _check_rows(rows, out, vocab):
    for original, corrupted, labels in zip(rows, out["input_ids"], out["labels"]):
        assert np.array_equal(labels, (corrupted != original).astype(np.int8))
        special = np.isin(original, SPECIAL_IDS)
        assert np.array_equal(corrupted[special], original[special])
        assert not np.isin(corrupted[~special], SPECIAL_IDS).any() and corrupted.max() < vocab


@pytest.mark.parametrize("distribution,augmentation,top", CURRICULA)
def test_every_curriculum_keeps_the_rules_at_extreme_strengths(built, distribution, augmentation, top):
    rows = load_split(built.corpus_dir, "train")[:24]
    vocab = load_corpus_meta(built.corpus_dir)["vocab_size"]
    corruptor = _corruptor(built, distribution, augmentation, top)
    ids = np.arange(24)
    gammas = np.resize([0.0, 1e-9, 0.5, top], 24)
    temps = 1.0 + gammas if augmentation == "temperature" and distribution == "aux" else np.ones(24)
    out = corruptor(rows, ids, epoch=0, temperatures=temps, gammas=gammas)
    _check_rows(rows, out, vocab)
    again = corruptor(rows, ids, epoch=0, temperatures=temps, gammas=gammas)
    assert all(np.array_equal(a, b) for a, b in zip(out["input_ids"], again["input_ids"]))
    assert out["masked"] > 0 and (out["aux_top1"] == 0) == (distribution != "aux")
    # without gammas (the validation rows) every curriculum is the plain aux model at the given T
    plain = _corruptor(built)(rows, ids, epoch=0, temperatures=np.ones(24))
    valid = corruptor(rows, ids, epoch=0, temperatures=np.ones(24))
    assert all(np.array_equal(a, b) for a, b in zip(plain["input_ids"], valid["input_ids"]))


def test_strength_zero_of_dropout_and_drop_token_is_the_plain_aux_model(built):
    """Drop-token draws come after a row's other draws and dropout at rate 0 multiplies by 1: the
    masked positions and samples of the default path are untouched."""
    rows = load_split(built.corpus_dir, "train")[:30]
    ids, ones = np.arange(30), np.ones(30)
    plain = _corruptor(built)(rows, ids, 1, ones)
    for augmentation in ("dropout", "drop_token"):
        out = _corruptor(built, "aux", augmentation, 0.5)(rows, ids, 1, ones, gammas=np.zeros(30))
        assert all(np.array_equal(a, b) for a, b in zip(plain["input_ids"], out["input_ids"])), augmentation
    default = _corruptor(built)
    temps = np.linspace(2.0, 1.0, 30)
    with_gammas = default(rows, ids, 1, temps, gammas=temps - 1.0)
    assert all(np.array_equal(a, b) for a, b in zip(default(rows, ids, 1, temps)["input_ids"], with_gammas["input_ids"]))


def test_model_free_distributions_replace_as_often_as_they_should(built):
    rows = load_split(built.corpus_dir, "train")
    n = len(rows)
    ids, ones = np.arange(n), np.ones(n)
    rate = lambda out: out["replaced"] / out["masked"]
    assert rate(_corruptor(built, "uniform")(rows, ids, 0, ones, np.zeros(n))) > 0.98
    soh = _corruptor(built, "smoothed_one_hot")(rows, ids, 0, ones, np.zeros(n))
    assert abs(rate(soh) - 0.35) < 0.05 and soh["masked"] > 400  # alpha = 0.35 of the mass elsewhere
    unf_to_soh = _corruptor(built, "uniform_to_soh")
    easy, hard = (rate(unf_to_soh(rows, ids, 0, ones, np.full(n, g))) for g in (1.0, 0.0))
    assert easy > 0.98 and abs(hard - 0.35) < 0.05


def test_a_rows_corruption_does_not_depend_on_the_other_rows(built):
    """Per-row draws (masking, uniforms, drop-token positions) come from the row's own rng; with no aux
    model the whole corruption is per row. (The aux forward depends on its batch only by rounding.)"""
    rows = load_split(built.corpus_dir, "train")[:40]
    ids, gammas = np.arange(40), np.linspace(0.9, 0.1, 40)
    c = _corruptor(built, "tf_to_soh")
    full = c(rows, ids, 2, np.ones(40), gammas)
    half = c(rows[10:30], ids[10:30], 2, np.ones(20), gammas[10:30])
    assert all(np.array_equal(a, b) for a, b in zip(full["input_ids"][10:30], half["input_ids"]))

    def aux_inputs(lo, hi):
        _, _, batches = _corruptor(built, "aux", "drop_token").masked_batches(rows[lo:hi], ids[lo:hi], 2, gammas[lo:hi])
        return {lo + int(i): row[:len(rows[lo + int(i)])].numpy() for b, t, _, _ in batches for i, row in zip(b, t)}
    full, half = aux_inputs(0, 40), aux_inputs(10, 30)
    assert all(np.array_equal(full[i], half[i]) for i in range(10, 30))
    assert sum(int((full[i] == 1).sum()) for i in full) > 40  # [UNK]s were dropped in


def test_term_counts_are_stored_beside_the_corpus_and_rebuilt_when_missing_or_stale(built):
    path = built.corpus_dir / TERM_COUNTS_FILE
    counts = term_counts(built.corpus_dir)
    assert path.is_file()  # written by build_corpus
    expected = np.bincount(np.concatenate(load_split(built.corpus_dir, "train")), minlength=len(counts))
    assert np.array_equal(counts, expected)
    stored = path.read_bytes()
    try:
        path.unlink()  # a corpus built before the file existed
        assert np.array_equal(term_counts(built.corpus_dir), expected) and path.read_bytes() == stored
        np.save(path, expected[:-1])  # stale: the wrong size
        assert np.array_equal(term_counts(built.corpus_dir), expected) and path.read_bytes() == stored
    finally:
        path.write_bytes(stored)
    with pytest.raises(ValueError, match="needs term counts"):
        Corruptor(built.aux_dir / AUX_FILE, 3, 0.15, 200, distribution="term_frequency")


def test_generation_key_changes_with_every_setting_that_changes_the_bytes(built):
    meta = load_corpus_meta(built.corpus_dir)
    keys = {generation_key(1, GenerateConfig(**change), meta, "x", 100) for change in (
        {}, {"schedule": "constant"}, {"distribution": "uniform"}, {"augmentation": "drop_token", "gamma_max": 0.2},
        {"augmentation": "drop_token", "gamma_max": 0.3}, {"distribution": "uniform_to_soh", "soh_alpha": 0.3},
        {"distribution": "uniform_to_soh"}, {"t0": 3.0}, {"zstd_level": 3}, {"batch_tokens": 4096})}
    assert len(keys) == 10
    base = generation_key(1, GenerateConfig(), meta, "x", 100)
    assert generation_key(1, GenerateConfig(), meta, "x", 101) != base       # the stream's length
    assert generation_key(1, GenerateConfig(), meta, "y", 100) != base       # the aux model
    assert generation_key(1, GenerateConfig(tasks_in_flight=2), meta, "x", 100) == base  # scheduling only
    assert generation_key(1, GenerateConfig(actors_per_gpu=4), meta, "x", 100) == base


@pytest.mark.parametrize("distribution,augmentation", [("aux", "temperature"), ("aux", "tf_interpolation"),
                                                       ("aux", "dropout"), ("uniform_to_soh", "temperature")])
def test_sampling_a_chunk_of_positions_at_a_time_draws_what_the_whole_batch_draws(built, distribution, augmentation):
    """Issue 30: the head and the sampler run over chunks of masked positions (memory: one chunk x V), each
    position keeping its distribution and its uniform. Chunks of 1 and of 7 positions against all at once:
    the same ids, labels and aux top-1 hits (bitwise on CPU)."""
    rows = load_split(built.corpus_dir, "train")[:24]
    ids = np.arange(100, 124)
    temps, gammas = np.linspace(2.0, 1.0, 24), np.linspace(0.9, 0.1, 24)
    outs = []
    for positions in (10**6, 7, 1):
        corruptor = _corruptor(built, distribution, augmentation, gamma_max=0.9)
        corruptor.chunk_entries = positions * corruptor.vocab_size
        outs.append(corruptor(rows, ids, 2, temps, gammas))
    whole = outs[0]
    assert whole["masked"] > 7 * 4  # several chunks of 7 per batch
    for out in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(out["input_ids"], whole["input_ids"]))
        assert all(np.array_equal(a, b) for a, b in zip(out["labels"], whole["labels"]))
        assert (out["replaced"], out["aux_top1"]) == (whole["replaced"], whole["aux_top1"])


@pytest.mark.parametrize("augmentation", ["temperature", "dropout"])
def test_compiled_draws_pad_the_last_chunk_to_one_shape_and_draw_what_the_steps_draw(built, augmentation):
    """On a GPU the temperature draw of a chunk runs under torch.compile (`common.distributions.chunk_draws`),
    forced here on the CPU: every chunk, a batch's last one padded, is one static shape, so one graph serves
    every batch; the padding changes nothing of the real positions (their aux top-1 hits, their masking), and
    the draws are those of the step-by-step draw but where the compiled sums round otherwise (near a CDF
    boundary), measured here at 98% or more of the positions."""
    import torch
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    rows = load_split(built.corpus_dir, "train")[:24]
    ids, temps = np.arange(100, 124), np.linspace(2.0, 1.0, 24)
    gammas = None if augmentation == "temperature" else np.linspace(0.5, 0.1, 24)  # the aux model's dropout rates
    outs = []
    for compiled in (False, True):
        corruptor = Corruptor(built.aux_dir / AUX_FILE, seed=11, mask_prob=0.15, batch_tokens=256,
                              augmentation=augmentation, compile_draws=compiled)
        corruptor.chunk_entries = 7 * corruptor.vocab_size
        outs.append(corruptor(rows, ids, 2, temps if gammas is None else np.ones(24), gammas))
    steps, fused = outs
    assert fused["masked"] == steps["masked"] > 7 * 4 and fused["masked"] % 7  # several chunks, a partial one
    assert fused["aux_top1"] == steps["aux_top1"]
    assert counters["stats"]["unique_graphs"] == 1  # every batch's chunks, the last partial ones too
    same = np.concatenate([a == b for a, b in zip(fused["input_ids"], steps["input_ids"])])
    changed = np.concatenate([(a != r) | (b != r) for a, b, r in zip(fused["input_ids"], steps["input_ids"], rows)])
    assert changed.sum() > 20 and same[changed].mean() >= 0.98
    for out in (fused, steps):
        _check_rows(rows, out, corruptor.vocab_size)


def test_aux_top1_counts_the_masked_positions_whose_original_the_aux_model_ranks_first(built):
    """The Corruptor's `aux_top1` (the generation manifest's aux top-1) equals the count of masked positions
    where the aux model's argmax is the original token, computed here from its logits directly."""
    import torch
    rows = load_split(built.corpus_dir, "train")[:40]
    corruptor = _corruptor(built)
    ids = np.arange(40)
    out = corruptor(rows, ids, epoch=0, temperatures=np.full(40, 1.7))
    positions, _, batches = corruptor.masked_batches(rows, ids, 0)
    expected = 0
    with torch.no_grad():
        for batch, inputs, attn, flags in batches:
            logits = corruptor.model.logits(corruptor.aux_hidden(inputs, attn, flags))
            originals = torch.from_numpy(np.concatenate([rows[i][positions[i]] for i in batch])).long()
            expected += int((logits.argmax(-1) == originals).sum())
    assert 0 < expected == out["aux_top1"] < out["masked"]


def test_top1_hits_decides_ties_and_nans_as_argmax_does():
    """The CPU form (argmax only over rows whose original reaches the max) against argmax over every row,
    on rows built to tie at the max before, at and after the original, and with NaN logits."""
    import torch
    from common.corrupt import top1_hits
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(400, 50, generator=gen).round(decimals=1)  # rounded: ties at the max are common
    originals = torch.randint(0, 50, (400,), generator=gen)
    originals[:100] = logits[:100].argmax(-1)  # hits
    logits[100:150, 7] = logits[100:150].amax(-1)  # a tie at 7 with the max...
    originals[100:125], originals[125:150] = 7, 40  # ...the original at it, or after it
    logits[125:150, 40] = logits[125:150, 7]
    logits[150:160, 3] = float("nan")
    originals[150:155], originals[155:160] = 3, 4  # the NaN itself, or another id in a NaN row
    reference = (logits.argmax(-1) == originals).sum()
    assert 100 < int(reference) < 400
    assert int(top1_hits(logits, originals)) == int(reference)
    assert int(top1_hits(logits[:0], originals[:0])) == 0


def test_the_aux_heads_kept_logits_buffer_changes_no_value_and_is_reused(built):
    """On CPU the Corruptor writes the aux head's logits into a buffer kept from chunk to chunk: the values of
    the head's own call, bitwise, for chunks of any size; one buffer reused; the same corruption as a
    Corruptor whose head allocates its logits each time."""
    import torch
    rows = load_split(built.corpus_dir, "train")[:24]
    ids, temps = np.arange(24), np.linspace(2.0, 1.0, 24)
    kept, plain = _corruptor(built), _corruptor(built)
    plain._head = lambda hidden: plain.model.logits(hidden)
    outs = [c(rows, ids, 1, temps) for c in (kept, plain)]
    for key in ("input_ids", "labels"):
        assert all(np.array_equal(a, b) for a, b in zip(outs[0][key], outs[1][key]))
    assert outs[0]["aux_top1"] == outs[1]["aux_top1"] > 0
    assert "logits" in kept.scratch and "logits" not in plain.scratch
    pointer = kept.scratch["logits"].data_ptr()
    _, _, batches = kept.masked_batches(rows, ids, 1)
    with torch.no_grad():
        hidden = kept.aux_hidden(*batches[0][1:])
        for part in (slice(0, len(hidden)), slice(3, 10), slice(0, 1)):
            assert torch.equal(kept._head(hidden[part]), kept.model.logits(hidden[part]))
    assert kept.scratch["logits"].data_ptr() == pointer


# (distribution, augmentation) -> [generate] keys it never reads, with a value other than the default
UNREAD = {("aux", "temperature"): {"gamma_max": 0.4, "soh_alpha": 0.2},
          ("aux", "drop_token"): {"t0": 3.0, "soh_alpha": 0.2},
          ("uniform", "temperature"): {"t0": 3.0, "tau": 0.3, "schedule": "constant", "gamma_max": 0.4,
                                       "temperature_granularity": "epoch", "soh_alpha": 0.2},
          ("smoothed_one_hot", "temperature"): {"tau": 0.3, "t0": 3.0, "gamma_max": 0.4, "schedule": "polynomial"},
          ("uniform_to_soh", "temperature"): {"t0": 3.0}}


@pytest.mark.parametrize("distribution,augmentation", list(UNREAD))
def test_keys_a_curriculum_never_reads_change_neither_its_rows_nor_its_generation_key(built, distribution, augmentation):
    """Editing such a key regenerates nothing; a config that never set one keeps the key it had before
    2026-11-26 (the hex below: every folder generated with defaults; changed once since, on purpose, when
    validation came to read rows spread over the held-out split, DRAWS_VERSION)."""
    meta = load_corpus_meta(built.corpus_dir)
    plain = GenerateConfig(distribution=distribution, augmentation=augmentation, mask_prob=0.15, batch_tokens=200,
                           epochs=2)
    edited = GenerateConfig(**{**plain.__dict__, **UNREAD[distribution, augmentation]})
    assert generation_key(1, edited, meta, "x", 100) == generation_key(1, plain, meta, "x", 100)
    rows, ids = load_split(built.corpus_dir, "train")[:24], np.arange(24)
    outs = []
    for cfg in (plain, edited):
        temps, gammas = epoch_curriculum(cfg, 1, ids + 30, 100)
        corruptor = Corruptor.from_config(built.aux_dir / AUX_FILE, 3, cfg, built.corpus_dir)
        outs.append(corruptor(rows, ids, epoch=1, temperatures=temps, gammas=gammas)["input_ids"])
    assert all(np.array_equal(a, b) for a, b in zip(*outs))
    edited_used = GenerateConfig(**{**plain.__dict__, "mask_prob": 0.2})
    assert generation_key(1, edited_used, meta, "x", 100) != generation_key(1, plain, meta, "x", 100)
    defaults_meta = {"train": {"parts": [{"sha256": "a"}]}, "valid": {"parts": [{"sha256": "b"}]},
                     "tokenizer_sha256": "t"}
    assert generation_key(1, GenerateConfig(), defaults_meta, "x", 100) == \
        "3df24148204e348f9df67abcd125381e54ca1f8567ad65e4a9cfe8b677daf396"
