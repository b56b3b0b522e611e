"""GPU paths (bf16 autocast in the aux forward, fp32 sampling). Skipped where no CUDA device is present."""
import numpy as np
import pytest
import torch

from common.checkpoint import AUX_FILE
from common.corpus import load_split
from common.corrupt import Corruptor

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_gpu_corruptor_keeps_the_label_rule_and_matches_cpu_masking(built):
    rows = load_split(built.corpus_dir, "train")[:16]
    temps = np.full(16, 1.5)
    gpu = Corruptor(built.aux_dir / AUX_FILE, seed=3, mask_prob=0.15, batch_tokens=256, device="cuda")
    cpu = Corruptor(built.aux_dir / AUX_FILE, seed=3, mask_prob=0.15, batch_tokens=256, device="cpu")
    assert next(gpu.model.parameters()).is_cuda
    out, ref = gpu(rows, np.arange(16), 0, temps), cpu(rows, np.arange(16), 0, temps)
    positions, _, _ = gpu.masked_batches(rows, np.arange(16), 0)
    for original, corrupted, labels, masked in zip(rows, out["input_ids"], out["labels"], positions):
        assert np.array_equal(labels, (corrupted != original).astype(np.int8))
        assert set(np.flatnonzero(labels).tolist()) <= set(masked.tolist())  # only masked positions change
    assert out["masked"] == ref["masked"]  # masking is seeded on the host: identical on any device
    assert out["replaced"] > 0
