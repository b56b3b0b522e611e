"""The trainer's optimizer (appendix A): its parameter groups, and the fused step it takes."""
from pathlib import Path

import torch

from common.config import load_manifest
from common.model import ReplacedTokenDetector
from common.optim import build_optimizer, per_tensor_loop


TINY = Path(__file__).resolve().parents[1] / "manifests" / "tiny.toml"


def groups_by_name(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    return [{names[id(p)] for p in g["params"]} for g in optimizer.param_groups]


def test_groups_decay_matrices_only_and_scale_the_two_slow_tables():
    model = ReplacedTokenDetector(load_manifest(TINY).model, 320)
    opt = build_optimizer(model, 1e-3, (0.9, 0.98), 1e-6, 0.01, rel_bias_lr_scale=4.0, embed_lr_scale=30.0)
    decay, no_decay, rel_bias, embed = groups_by_name(model, opt)
    assert embed == {"encoder.embed.weight"}
    assert rel_bias and all("rel_bias" in n for n in rel_bias)
    assert all(model.get_parameter(n).dim() >= 2 for n in decay)
    assert all(model.get_parameter(n).dim() == 1 for n in no_decay) and "encoder.ln_embed.weight" in no_decay
    assert set().union(decay, no_decay, rel_bias, embed) == {n for n, _ in model.named_parameters()}
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-3, 4e-3, 3e-2]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0, 0.0, 0.01]
    assert all(g["fused"] for g in opt.param_groups)


def test_fused_steps_are_those_of_the_per_tensor_loop():
    """Twenty steps, four learning rates, weight decay 0.1 (decay alone moves a weight by ~1e-5 here):
    the fused step's weights are the loop's up to float32 rounding (measured: at most 1.2e-7 apart)."""
    torch.manual_seed(0)
    cfg = load_manifest(TINY).model
    fused_model, loop_model = ReplacedTokenDetector(cfg, 320), ReplacedTokenDetector(cfg, 320)
    loop_model.load_state_dict(fused_model.state_dict())
    start = {n: p.detach().clone() for n, p in fused_model.named_parameters()}
    fused = build_optimizer(fused_model, 1e-3, (0.9, 0.98), 1e-6, 0.1, 4.0, 30.0)
    loop = per_tensor_loop(build_optimizer(loop_model, 1e-3, (0.9, 0.98), 1e-6, 0.1, 4.0, 30.0))
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        for a, b in zip(fused_model.parameters(), loop_model.parameters()):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        fused.step()
        loop.step()
    for (name, a), b in zip(fused_model.named_parameters(), loop_model.parameters()):
        assert not torch.equal(a, start[name]), name  # every tensor moved
        torch.testing.assert_close(a, b, rtol=0.0, atol=5e-7, msg=name)
