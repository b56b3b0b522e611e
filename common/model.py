"""The transformer encoder shared by the main (RTD) and the auxiliary (MLM) model.

Paper section 4.1 / table "Configuration of model architectures": BERT-sized
layers with T5 relative position bias (32 buckets / max distance 128 for base,
128 / 256 for large), dropout 0.1. The auxiliary model has the same width and
fewer layers. The model knows nothing of parallelism or data.

LayerNorm placement: the paper uses post-LN layers with Admin initialisation
(Liu et al. 2020), whose purpose is to make post-LN train like pre-LN early on.
We use pre-LN layers (plus a final LayerNorm) instead: no profiling pass, and
it learns from the first steps: on the tiny preset post-LN with BERT initialisation
stayed at the base-rate RTD loss where pre-LN learned (docs/design.md, design notes).

This file imports torch and the standard library only: `make export` copies it verbatim into a
Hugging Face model directory, where the remote modeling file imports it relatively (export/, one
implementation of the model's math for both sides).
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

# common.tokenizer.PAD_ID, written out so this file stands alone in an export (a test checks they agree)
PAD_ID = 0


class EncoderShape(Protocol):
    """What the layers read from a config: common.config.ModelConfig, or an export's Hugging Face config."""
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_size: int
    rel_buckets: int
    rel_max_distance: int
    dropout: float
    rel_bias_locality: float


def relative_position_bucket(relative_position: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bidirectional bucketing: half the buckets per direction, exact for small
    distances, logarithmic up to `max_distance`, then the last bucket."""
    num_buckets //= 2
    bucket = (relative_position > 0).long() * num_buckets
    distance = relative_position.abs()
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """One learned scalar per (bucket, head), shared by all layers as in T5."""

    def __init__(self, num_heads: int, num_buckets: int, max_distance: int, locality: float = 0.0):
        super().__init__()
        self.num_buckets, self.max_distance, self.locality = num_buckets, max_distance, locality
        self.bias = nn.Embedding(num_buckets, num_heads)
        self.lookup = None  # as Encoder.lookup: the table's lookup, None: self.bias(buckets)

    def bucket_distances(self) -> torch.Tensor:
        """The smallest |relative position| that falls in each bucket (0 for a bucket no distance
        up to `max_distance` reaches)."""
        rel = torch.arange(-self.max_distance, self.max_distance + 1)
        buckets = relative_position_bucket(rel, self.num_buckets, self.max_distance)
        smallest = torch.full((self.num_buckets,), self.max_distance + 1)
        smallest.scatter_reduce_(0, buckets, rel.abs(), reduce="amin")
        return torch.where(smallest > self.max_distance, 0, smallest)

    @torch.no_grad()
    def init_locality(self) -> None:
        """Start attention local: bias = -s_h * ln(max(|d|, 1)) for head h, so a token weighs itself
        and its two neighbours alike and farther ones by |d|^-s_h; slopes s_h evenly from `locality`
        (head 0) down to 0 (the last head attends uniformly, as under T5's init).

        A deviation from the paper (section 4.1 takes T5's bias, initialised near zero): from a zero
        start the RTD loss waits at its base rate while the bias learns locality, which a local start
        gives at once (measurements: the fast-electra project's docs/design.md, design notes). Applies
        to every model built with it: main, aux, generator, fine-tuning."""
        slopes = self.locality * torch.linspace(1.0, 0.0, self.bias.embedding_dim)  # one head: [locality]
        prior = -torch.log(self.bucket_distances().clamp(min=1).float())[:, None] * slopes[None, :]
        self.bias.weight.copy_(prior.to(self.bias.weight.dtype))

    def forward(self, length: int) -> torch.Tensor:
        pos = torch.arange(length, device=self.bias.weight.device)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None], self.num_buckets, self.max_distance)
        # contiguous: a GPU's fused attention kernels take a bias only with its last dimension at stride 1 (the
        # permuted lookup has stride `heads` there), and otherwise SDPA falls back to its math path
        table = self.bias(buckets) if self.lookup is None else self.lookup(self.bias, buckets)
        return table.permute(2, 0, 1).unsqueeze(0).contiguous()  # (1, heads, L, L)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderShape):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.ln_attn = nn.LayerNorm(cfg.hidden_size, eps=1e-5)
        self.ffn_in = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.ffn_out = nn.Linear(cfg.ffn_size, cfg.hidden_size)
        self.ln_ffn = nn.LayerNorm(cfg.hidden_size, eps=1e-5)
        # A fused attention for (q, k, v, bias, dropout_p), returning None where it does not apply; set on a GPU by
        # common.attention.use_fused (kept out of this file, which imports torch alone: see the module docstring)
        self.fused_attention = None

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor, drop=None) -> torch.Tensor:
        """`drop`: dropout of another kind than this layer's own (per row, `common.augment.RowDropout`), with
        `hidden(t)` for the residual branches and `attention` (None, or a function of the attention
        probabilities); None: the layer's own dropout, active in training."""
        batch, length, width = x.shape
        qkv = self.qkv(self.ln_attn(x))
        q, k, v = qkv.view(batch, length, 3, self.num_heads, width // self.num_heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training and drop is None else 0.0
        attn = None
        if drop is not None and drop.attention is not None:  # dropout on the probabilities, as dropout_p does
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + attn_bias
            attn = drop.attention(torch.softmax(scores, dim=-1)) @ v
        elif self.fused_attention is not None:
            attn = self.fused_attention(q, k, v, attn_bias, p)
        if attn is None:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=p)
        attn = attn.transpose(1, 2).reshape(batch, length, width)
        branch = (lambda t: F.dropout(t, p, self.training)) if drop is None else drop.hidden
        x = x + branch(self.out(attn))
        h = self.ffn_out(F.gelu(self.ffn_in(self.ln_ffn(x))))
        return x + branch(h)


class Encoder(nn.Module):
    """Token embeddings -> N encoder layers; returns hidden states (B, L, H)."""

    def __init__(self, cfg: EncoderShape, vocab_size: int, num_layers: int, padding_idx: int = PAD_ID):
        super().__init__()
        # padding_idx: our [PAD] is 0; an export in a Hugging Face tokenizer's native order has its own
        self.embed = nn.Embedding(vocab_size, cfg.hidden_size, padding_idx=padding_idx)
        self.ln_embed = nn.LayerNorm(cfg.hidden_size, eps=1e-5)
        self.rel_bias = RelativePositionBias(cfg.num_heads, cfg.rel_buckets, cfg.rel_max_distance,
                                             cfg.rel_bias_locality)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(num_layers))
        self.ln_final = nn.LayerNorm(cfg.hidden_size, eps=1e-5)
        self.dropout = cfg.dropout
        # The token lookup as a function of (self.embed, ids), None: self.embed(ids); set for a compiled model by
        # common.embedding.use_eager_backward (kept out of this file, which imports torch alone)
        self.lookup = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, drop=None) -> torch.Tensor:
        """`attention_mask`: (B, L), False on padding; None where no row is padded (the caller knows it on the
        host), so the attention bias stays one (1, heads, L, L) for the batch instead of (B, heads, L, L): less
        memory for a large batch, and less for attention to read (docs/design.md, the generator).
        `drop`: per-row dropout in place of the model's own (`EncoderLayer.forward`)."""
        x = self.ln_embed(self.embed(input_ids) if self.lookup is None else self.lookup(self.embed, input_ids))
        x = F.dropout(x, self.dropout, self.training) if drop is None else drop.hidden(x)
        # Additive bias: relative positions, and -inf on padded keys. In the dtype the layers' q and k
        # will have: under bf16 autocast a float32 bias sends SDPA to its slow math path (fp32 matmuls).
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        bias = self.rel_bias(input_ids.shape[1]).to(dtype)
        if attention_mask is not None:
            pad = torch.zeros(attention_mask.shape, dtype=dtype, device=x.device)
            bias = bias + pad.masked_fill(~attention_mask.bool(), float("-inf"))[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias, drop)
        return self.ln_final(x)


class MLMHead(nn.Module):
    """Dense -> GELU -> LayerNorm -> logits through the (tied) input embeddings."""

    def __init__(self, cfg: EncoderShape, embedding: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=1e-5)
        self.embedding = embedding  # tied, not a copy
        self.bias = nn.Parameter(torch.zeros(embedding.num_embeddings))

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: a (positions, vocab) fp32 tensor to write the logits into (the sampler's kept buffer),
        the same values as without it. `weight`: the tied embedding matrix as already cast by the caller
        (a frozen model under autocast), the same values as autocast's own cast of it."""
        h = self.ln(F.gelu(self.dense(hidden)))
        weight = self.embedding.weight if weight is None else weight
        if out is None:
            return F.linear(h, weight, self.bias)
        return torch.addmm(self.bias, h, weight.t(), out=out)  # what F.linear runs, into `out`


class RTDHead(nn.Module):
    """One logit per token: > 0 means 'replaced'."""

    def __init__(self, cfg: EncoderShape):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.dense(hidden))).squeeze(-1)

    @torch.no_grad()
    def start_at_base_rate(self, rate: float) -> None:
        """Output bias = logit(rate): at initialisation every token scores the data's replaced
        fraction, so step 0 is the majority baseline and no updates go to learning the prior."""
        self.out.bias.fill_(math.log(rate / (1 - rate)))


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """BERT initialisation: N(0, 0.02) for matrices, zeros for biases, ones for LayerNorm; a
    relative-position bias with a locality prior starts from it (`RelativePositionBias.init_locality`)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    for m in module.modules():
        if isinstance(m, RelativePositionBias) and m.locality > 0:
            m.init_locality()


def at_positions(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, L, ...) values at `positions`: a (B, L) bool mask, or the same positions as flat row-major indices
    (`common.batching.flat_positions`, made on the host). The same values in the same order either way; the
    indices have a size known before the device runs, where a mask's count is read back (a host sync)."""
    if positions.dtype == torch.bool:
        return hidden[positions]
    return hidden.flatten(0, 1).index_select(0, positions)


class MaskedLM(nn.Module):
    """The auxiliary model: encoder + MLM head evaluated only at masked positions."""

    def __init__(self, cfg: EncoderShape, vocab_size: int, num_layers: int):
        super().__init__()
        self.encoder = Encoder(cfg, vocab_size, num_layers)
        self.head = MLMHead(cfg, self.encoder.embed)
        init_weights(self)

    def forward(self, input_ids, attention_mask, masked_positions) -> torch.Tensor:
        """`masked_positions`: bool (B, L), or `flat_positions` of it. Returns logits (num_masked, vocab) in
        row-major order."""
        return self.logits(self.masked_hidden(input_ids, attention_mask, masked_positions))

    def masked_hidden(self, input_ids, attention_mask, masked_positions, drop=None) -> torch.Tensor:
        """The encoder's output at the masked positions, (num_masked, hidden): what `logits` turns into
        a distribution, a chunk of positions at a time where the vocabulary is large."""
        return at_positions(self.encoder(input_ids, attention_mask, drop), masked_positions)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None,
               weight: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(hidden, out, weight)


class ReplacedTokenDetector(nn.Module):
    """The main model: encoder + RTD head, one logit per token."""

    def __init__(self, cfg: EncoderShape, vocab_size: int):
        super().__init__()
        self.encoder = Encoder(cfg, vocab_size, cfg.num_layers)
        self.head = RTDHead(cfg)
        init_weights(self)

    def forward(self, input_ids, attention_mask) -> torch.Tensor:
        return self.head(self.encoder(input_ids, attention_mask))


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
