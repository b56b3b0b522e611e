"""The paper's optimizer and schedule (appendix A): Adam(0.9, 0.98), eps 1e-6,
weight decay 0.01, linear warm-up then linear decay to zero, clipping by norm."""
from __future__ import annotations

import torch
from torch import nn


def build_optimizer(model: nn.Module, lr: float, betas, eps: float, weight_decay: float,
                    rel_bias_lr_scale: float = 1.0, embed_lr_scale: float = 1.0) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only (biases and LayerNorm are not decayed).

    Two tables learn slowly at a small step count, and get their own learning-rate multipliers
    (1 = the paper, for 125K-step runs, and every preset but reproduce.toml's; docs/design.md, design notes):
    - the relative-position bias (`rel_bias_lr_scale`, no decay): Adam moves each entry by about lr
      per step, and without absolute positions it is the model's only sense of order;
    - the token embeddings (`embed_lr_scale`): a row is only updated when its token is in the batch.

    `fused=True`: one kernel over all tensors, on CPU as on CUDA; its weights are the per-tensor loop's
    up to float32 rounding (tests/test_optim.py). `make bench-train` times both (docs/benchmarks.md).
    """
    decay, no_decay, rel_bias, embed = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if "rel_bias" in name:
            rel_bias.append(p)
        elif name.endswith("encoder.embed.weight"):
            embed.append(p)
        else:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0},
              {"params": rel_bias, "weight_decay": 0.0, "lr": lr * rel_bias_lr_scale},
              {"params": embed, "weight_decay": weight_decay, "lr": lr * embed_lr_scale}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=True)


def per_tensor_loop(optimizer: torch.optim.AdamW) -> torch.optim.AdamW:
    """torch's per-tensor AdamW (fused=False, foreach=False) over `optimizer`'s parameter groups and
    settings: the step `build_optimizer` took before `fused=True`, kept to compare against."""
    return torch.optim.AdamW([{k: v for k, v in g.items() if k not in ("fused", "foreach")}
                              for g in optimizer.param_groups], fused=False, foreach=False)


def warmup_linear_decay(warmup_steps: int, total_steps: int):
    """LR multiplier at update `step` (0-based): (step+1)/warmup, then linear to 0 at total."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return factor


def build_scheduler(optimizer, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear_decay(warmup_steps, total_steps))
