"""The token embedding's lookup for a compiled model: its backward through ATen's own kernel.

Under torch.compile, Inductor decomposes the lookup's backward into a zero-filled (vocab, hidden) float32
tensor and an index_put with accumulation; at the base shape (128,000 x 768) that kernel took 1.92 ms a
micro-batch on an H200, about ten times its memory traffic (docs/benchmarks.md, session 34's profile).
Wrapped as custom ops the lookup and its backward stay opaque to the compiler, so the backward runs
`aten.embedding_dense_backward` as eager PyTorch does. Same values as `nn.Embedding` (a test compares them);
the model (common/model.py) takes it through `Encoder.lookup` and `RelativePositionBias.lookup` (whose
(L, L) bucket ids go to 32 rows: the decomposition's atomic adds would all meet there), set by
`use_eager_backward`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.model import Encoder, RelativePositionBias


@torch.library.custom_op("fast_electra::embedding_backward", mutates_args=())
def embedding_backward(grad: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx: int) -> torch.Tensor:
    """The gradient of a (num_weights, hidden) table from the lookup's output gradient (padding_idx -1: none)."""
    return torch.ops.aten.embedding_dense_backward(grad, ids, num_weights, padding_idx, False)


@embedding_backward.register_fake
def _(grad, ids, num_weights, padding_idx):
    return grad.new_empty(num_weights, grad.shape[-1])


@torch.library.custom_op("fast_electra::embedding", mutates_args=())
def embedding(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """`F.embedding(ids, weight, padding_idx)`, as one op the compiler does not look into."""
    return F.embedding(ids, weight, None if padding_idx < 0 else padding_idx)


@embedding.register_fake
def _(weight, ids, padding_idx):
    return weight.new_empty(*ids.shape, weight.shape[1])


def _setup(ctx, inputs, output):
    weight, ids, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx


def _backward(ctx, grad):
    ids, = ctx.saved_tensors
    return embedding_backward(grad.contiguous(), ids, ctx.num_weights, ctx.padding_idx), None, None


embedding.register_autograd(_backward, setup_context=_setup)


def lookup(table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """`table(ids)` through the custom ops (an `Encoder.lookup` or `RelativePositionBias.lookup`)."""
    if table.max_norm is not None or table.scale_grad_by_freq or table.sparse:
        raise ValueError("the custom-op lookup covers a plain nn.Embedding only "
                         "(no max_norm, scale_grad_by_freq, sparse)")
    return embedding(table.weight, ids, -1 if table.padding_idx is None else table.padding_idx)


def use_eager_backward(model: nn.Module) -> int:
    """Route every table lookup of `model`'s encoders (tokens, relative-position buckets) through `lookup`
    (for a model about to be compiled). Returns how many modules take it."""
    modules = [m for m in model.modules() if isinstance(m, (Encoder, RelativePositionBias))]
    for module in modules:
        module.lookup = lookup
    return len(modules)
