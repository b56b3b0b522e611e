"""The encoder: shapes, tied MLM head at masked positions only, padding invariance, buckets."""
import pytest
import torch

from common.config import ConfigError, ModelConfig
from common.model import MaskedLM, ReplacedTokenDetector, count_parameters, relative_position_bucket

CFG = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, rel_buckets=8, rel_max_distance=16)


def test_rtd_one_logit_per_token_and_padding_does_not_change_outputs():
    torch.manual_seed(0)
    model = ReplacedTokenDetector(CFG, 100).eval()
    ids = torch.randint(5, 100, (1, 10))
    short = model(ids, torch.ones_like(ids, dtype=torch.bool))
    padded_ids = torch.cat([ids, torch.zeros(1, 6, dtype=torch.long)], 1)
    mask = torch.arange(16)[None] < 10
    padded = model(padded_ids, mask)
    assert short.shape == (1, 10) and padded.shape == (1, 16)
    assert torch.allclose(short, padded[:, :10], atol=1e-5)


def test_mlm_head_is_tied_and_only_scores_masked_positions(tmp_path):
    model = MaskedLM(CFG, 100, num_layers=1).eval()
    assert model.head.embedding.weight is model.encoder.embed.weight
    ids = torch.randint(5, 100, (3, 12))
    flags = torch.zeros(3, 12, dtype=torch.bool)
    flags[0, 2] = flags[2, 5] = flags[2, 7] = True
    with torch.no_grad():
        logits = model(ids, torch.ones_like(flags), flags)
        hidden = model.encoder(ids, torch.ones_like(flags))
        # row-major: row 0's position 2, then row 2's positions 5 and 7, each the head at that position alone
        expected = model.head(torch.stack([hidden[0, 2], hidden[2, 5], hidden[2, 7]]))
    assert logits.shape == (3, 100) and torch.allclose(logits, expected, atol=1e-6)
    # a file saved and loaded (the aux model's path) holds the tied weight once and loads it tied
    from common.checkpoint import safe_load
    torch.save(model.state_dict(), tmp_path / "m.pt")
    state = safe_load(tmp_path / "m.pt")
    assert state["head.embedding.weight"].data_ptr() == state["encoder.embed.weight"].data_ptr()
    clone = MaskedLM(CFG, 100, num_layers=1).eval()
    clone.load_state_dict(state)
    assert clone.head.embedding.weight is clone.encoder.embed.weight
    assert torch.equal(clone.encoder.embed.weight, model.encoder.embed.weight)
    with torch.no_grad():
        assert torch.equal(clone(ids, torch.ones_like(flags), flags), logits)
    assert count_parameters(model) == count_parameters(clone)


def test_the_head_weight_cast_once_gives_autocasts_own_logits():
    """The Corruptor's frozen head weight, cast once (`common.corrupt.head_weight`), under the autocast a GPU
    runs (bf16; here the CPU's): bit for bit the logits of autocast casting the fp32 weight itself."""
    from common.corrupt import head_weight
    torch.manual_seed(0)
    model = MaskedLM(CFG, 1000, num_layers=1).eval()
    assert head_weight(model, None) is None  # no autocast (a CPU run): the fp32 weight as it is
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    weight = head_weight(model, autocast)
    assert weight.dtype == torch.bfloat16 and weight.shape == (1000, 32)
    hidden = torch.randn(57, 32)
    with torch.no_grad(), autocast:
        own = model.logits(hidden)
        cast_once = model.logits(hidden, weight=weight)
    assert own.dtype == cast_once.dtype == torch.bfloat16
    assert torch.equal(own, cast_once)
    assert model.head.embedding.weight.dtype == torch.float32  # the model's own weights untouched


def test_relative_buckets_are_bidirectional_and_bounded():
    rel = torch.arange(-300, 301)
    buckets = relative_position_bucket(rel, 32, 128)
    assert buckets.min() == 0 and buckets.max() == 31
    assert (buckets[rel > 0] >= 16).all() and (buckets[rel <= 0] < 16).all()
    near = relative_position_bucket(torch.arange(0, 8), 32, 128)
    assert near.tolist() == [0, 17, 18, 19, 20, 21, 22, 23]  # exact for small distances
    assert relative_position_bucket(torch.tensor([200, 1000]), 32, 128).tolist() == [31, 31]


def test_locality_prior_weighs_distances_by_power_law_per_head():
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, rel_buckets=32, rel_max_distance=128,
                      rel_bias_locality=2.0)
    torch.manual_seed(0)
    model = ReplacedTokenDetector(cfg, 100)
    bias = model.encoder.rel_bias(20)[0]  # (heads, L, L)
    query = 10
    for head, slope in enumerate([2.0, 4 / 3, 2 / 3, 0.0]):
        row = bias[head, query]
        # itself and its two neighbours alike, then |d|^-slope (exact buckets up to distance 7)
        assert torch.allclose(row[[9, 10, 11]], torch.zeros(3), atol=1e-6)
        for d in (2, 3, 7):
            expected = -slope * torch.log(torch.tensor(float(d)))
            assert torch.allclose(row[query - d], expected, atol=1e-5) and torch.allclose(row[query + d], expected, atol=1e-5)
    # the attention it gives a fresh query: head 0 puts most weight within distance 3, the last is uniform
    weights = torch.softmax(bias[:, query], dim=-1)
    assert weights[0, 7:14].sum() > 0.6 and torch.allclose(weights[3], torch.full((20,), 1 / 20))
    # off by default: T5's near-zero initialisation, and a negative slope is refused
    plain = ReplacedTokenDetector(CFG, 100).encoder.rel_bias.bias.weight
    assert plain.abs().max() < 0.2
    with pytest.raises(ConfigError, match="rel_bias_locality"):
        ModelConfig(rel_bias_locality=-1.0)


def test_the_attention_bias_has_the_dtype_of_q_and_k_and_a_fused_kernels_layout(monkeypatch):
    """A float32 bias beside bf16 q/k sends SDPA to its math path on GPU (fp32 matmuls, seen on an H100
    at the base shape: attention 66% of an update). Under autocast the bias is built in the autocast
    dtype; without it (the CPU trainer) in the activations' dtype, so CPU numerics do not change."""
    import common.model as model_module
    seen, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        # a GPU's fused kernels take a bias whose last dimension has stride 1 (an H200 took its math path
        # with the permuted lookup's stride of `heads` there: trainer MFU 0.096, 0.178 once fused)
        seen.append((q.dtype, attn_mask.dtype, attn_mask.stride(-1) == 1 and attn_mask.is_contiguous()))
        return real(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = ReplacedTokenDetector(CFG, 100).eval()
    ids = torch.randint(5, 100, (2, 10))
    mask = torch.arange(10)[None] < torch.tensor([[10], [7]])
    plain = model(ids, mask)
    assert seen and all(pair == (torch.float32, torch.float32, True) for pair in seen)
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(ids, mask)
    assert seen and all(pair == (torch.bfloat16, torch.bfloat16, True) for pair in seen)
    assert torch.allclose(low.float()[mask], plain[mask], atol=0.1)  # bf16 tolerance, padding still masked


def test_no_mask_means_no_row_padded_and_one_bias_for_the_batch(monkeypatch):
    """`attention_mask=None` (the caller knows on the host that no row is padded): the same outputs and
    gradients as an all-True mask, with one (1, heads, L, L) bias where a mask makes one per row (B, heads,
    L, L): 3.2 GB for a generation batch of 512 rows of 512 tokens at the base width in bf16. Bit for bit but
    the relative-position table's gradient, summed over the rows in another order (within 1e-12 here)."""
    import common.model as model_module
    shapes, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        shapes.append(tuple(attn_mask.shape))
        return real(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = ReplacedTokenDetector(CFG, 100).eval()  # no dropout: the two passes comparable (gradients still flow)
    ids = torch.randint(5, 100, (3, 12))
    outputs, grads = [], []
    for mask in (torch.ones(3, 12, dtype=torch.bool), None):
        shapes.clear()
        model.zero_grad()
        out = model(ids, mask)
        out.pow(2).sum().backward()
        outputs.append(out)
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        assert shapes == [(3 if mask is not None else 1, CFG.num_heads, 12, 12)] * CFG.num_layers
    assert torch.equal(outputs[0], outputs[1])
    table = "encoder.rel_bias.bias.weight"
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0] if name != table)
    assert torch.allclose(grads[0][table], grads[1][table], rtol=0, atol=1e-12) and grads[0][table].abs().max() > 1e-8
