"""common/embedding.py: the token lookup whose backward the compiler leaves to ATen."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from common.embedding import lookup, use_eager_backward
from common.model import ReplacedTokenDetector
from tests.conftest import tiny_config


@pytest.mark.parametrize("padding_idx", [0, 7, None])
def test_the_lookup_gives_nn_embeddings_values_and_gradient(padding_idx):
    """Eagerly, bit for bit: the output, and the table's gradient with repeated ids and the padding row."""
    torch.manual_seed(0)
    table = nn.Embedding(50, 16, padding_idx=padding_idx)
    ids = torch.randint(0, 50, (3, 40))
    ids[:, :4] = 7 if padding_idx is None else padding_idx
    weights = torch.randn(3, 40, 16)
    grads = []
    for way in (table, lambda i: lookup(table, i)):
        table.zero_grad(set_to_none=True)
        out = way(ids)
        (out * weights).sum().backward()
        grads.append((out.detach(), table.weight.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    if padding_idx is not None:
        assert not grads[1][1][padding_idx].any()
    assert grads[1][1].abs().sum() > 0


def test_a_compiled_detector_runs_the_lookups_backward_as_aten_and_matches_eager(tmp_path):
    """Under torch.compile (Inductor, on the CPU here) the backward is the custom op, which runs ATen's
    embedding_dense_backward, not Inductor's decomposition; the gradients those of the eager model within
    float32 rounding. A lookup with options it does not cover is refused."""
    from torch.profiler import profile
    config = tiny_config(tmp_path)
    torch.manual_seed(0)
    eager = ReplacedTokenDetector(config.model, 300).eval()
    routed = ReplacedTokenDetector(config.model, 300).eval()
    routed.load_state_dict(eager.state_dict())
    assert use_eager_backward(routed) == 2 and eager.encoder.lookup is None  # tokens, relative positions
    ids = torch.randint(0, 300, (2, 24))
    ids[:, -3:] = 0
    eager(ids, None).square().sum().backward()
    compiled = torch.compile(routed)
    compiled(ids, None).sum().backward()  # compiled here, not under the profiler (compiling may run the ops)
    routed.zero_grad(set_to_none=True)
    with profile() as prof:
        compiled(ids, None).square().sum().backward()
    ops = {e.key for e in prof.key_averages()}
    assert {"fast_electra::embedding", "fast_electra::embedding_backward", "aten::embedding_dense_backward"} <= ops
    assert sum(e.count for e in prof.key_averages() if e.key == "fast_electra::embedding_backward") == 2
    for a, b in zip(eager.parameters(), routed.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="plain nn.Embedding"):
        lookup(nn.Embedding(5, 2, max_norm=1.0), torch.tensor([1]))
