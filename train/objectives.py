"""The training objectives: RTD on the shards (the product, paper section 3) and the original
ELECTRA joint training, the baseline Fast-ELECTRA saves against. The trainer, `bench/` and the
experiments all compute their losses here.

`electra`, paper section 2: a generator G (an MLM) and the discriminator D are trained together,
    L = L_MLM(G) + lambda * L_RTD(D),  lambda = `train.electra_lambda` (appendix A: 70 base, 50 large),
with masking and sampling done online, no gradient through the sampling, and the token
embeddings (and their LayerNorm) shared between G and D. The generator here has the main
model's width and the aux model's depth, `[aux] num_layers` (paper appendix A: the generator and the
auxiliary model have one size, 4 layers at base, 6 at large). Masked
positions and sampling uniforms are generate/'s own per-row draws (`common.curriculum.row_draws`),
at T = 1: ELECTRA samples from its generator as it is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.batching import attention_mask, masked_inputs, to_device
from common.config import ModelConfig
from common.curriculum import sample_replacements
from common.model import MaskedLM, ReplacedTokenDetector
from common.tokenizer import Reserved


class ElectraPair(nn.Module):
    """Generator + discriminator with shared token embeddings and embedding LayerNorm."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, generator_layers: int, reserved: Reserved = Reserved()):
        super().__init__()
        self.reserved = reserved  # never sampled: the specials, and an hf: tokenizer's unused entries
        self.discriminator = ReplacedTokenDetector(cfg, vocab_size)
        self.generator = MaskedLM(cfg, vocab_size, generator_layers)
        shared = self.discriminator.encoder
        self.generator.encoder.embed = shared.embed          # the same modules, not copies
        self.generator.encoder.ln_embed = shared.ln_embed
        self.generator.head.embedding = shared.embed          # MLM output layer tied to them too

    def forward(self, masked_ids, attention_mask, masked_flags, original_ids, uniforms):
        """Returns (generator MLM loss summed over masked positions, discriminator logits (B, L),
        RTD labels (B, L) float, generator top-1 hits)."""
        gen_logits = self.generator(masked_ids, attention_mask, masked_flags)   # (M, V) at masked positions
        originals = original_ids[masked_flags]
        mlm_sum = F.cross_entropy(gen_logits.float(), originals, reduction="sum")
        with torch.no_grad():  # no gradient through the sampling (paper section 2)
            ones = torch.ones(len(originals), device=gen_logits.device)
            sampled = sample_replacements(gen_logits.detach(), ones, uniforms, self.reserved)
            corrupted = original_ids.masked_scatter(masked_flags, sampled)
            labels = (corrupted != original_ids).float()
            hits = (gen_logits.argmax(-1) == originals).sum()
        return mlm_sum, self.discriminator(corrupted, attention_mask), labels, hits


def electra_tensors(rows: dict, seed: int = 0, mask_prob: float = 0.15, reserved: Reserved = Reserved(),
                    vocab_size: int = 0) -> dict:
    """`electra`: original rows -> padded originals, [MASK]ed inputs, masked flags and uniforms."""
    lengths = [len(r) for r in rows["input_ids"]]
    batch = masked_inputs(rows["input_ids"], rows["row_id"], rows["epoch"], seed, mask_prob, max(lengths),
                          reserved=reserved, vocab_size=vocab_size)
    return {**batch, "attention_mask": attention_mask(lengths, max(lengths)), "padded": min(lengths) < max(lengths)}


ELECTRA_INPUTS = ("masked_ids", "masked_flags", "original_ids", "uniforms")  # with the mask: ElectraPair's
MLM_INPUTS = ("masked_ids", "attention_mask", "masked_index", "targets")


def forward_losses(model, batch: dict, device, electra: bool) -> tuple:
    """One micro-batch through the model: (RTD loss summed over its non-pad tokens, and for `electra`
    the generator's MLM loss summed over its masked positions and its top-1 hits; else None, None).
    A batch of `train.mlm.mlm_tensors` (the aux model's own training) gives (None, MLM loss sum, hits)."""
    if "targets" in batch:
        mlm, hits = model(*(to_device(batch[k], device) for k in MLM_INPUTS))
        return None, mlm, hits
    mask = to_device(batch["attention_mask"], device)  # page-locked, not waiting for the device (common.batching)
    # no row padded (`padded`, from the rows' lengths where the batch was made): the model gets no mask and keeps
    # one attention bias for the micro-batch, not one per row (`common.model.Encoder.forward`); the loss still
    # weighs by the mask
    model_mask = mask if batch.get("padded", True) else None
    if electra:  # the generator masks, predicts and samples; the discriminator detects
        ids, flags, originals, uniforms = (to_device(batch[k], device) for k in ELECTRA_INPUTS)
        mlm, logits, labels, hits = model(ids, model_mask, flags, originals, uniforms)
    else:
        logits, labels = model(to_device(batch["input_ids"], device), model_mask), to_device(batch["labels"], device)
        mlm = hits = None
    # pads weighted out rather than indexed away: a boolean index has a data-dependent size, which a GPU
    # answers by waiting for the device (a host sync per micro-batch)
    # (a pad's logit is set to 0 first: whatever it is, its gradient stays 0, as under the index)
    per_token = F.binary_cross_entropy_with_logits(logits.float().masked_fill(~mask, 0.0), labels.float(),
                                                   reduction="none")
    rtd = torch.where(mask, per_token, 0.0).sum()
    return rtd, mlm, hits


def objective(rtd_sum, mlm_sum, tokens: float, masked: float, electra_lambda: float):
    """The loss to differentiate: RTD mean over tokens (paper section 3), for `electra`
    L_MLM + lambda * L_RTD (paper section 2), for `mlm` the MLM mean over masked positions.
    `tokens` / `masked`: the counts the sums are over."""
    if rtd_sum is None:
        return mlm_sum / masked
    rtd = rtd_sum / tokens
    return rtd if mlm_sum is None else mlm_sum / masked + electra_lambda * rtd
