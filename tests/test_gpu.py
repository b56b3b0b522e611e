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


def test_gpu_aux_logits_are_those_of_a_mask_and_of_autocasts_own_weight_cast(built):
    """Two changes to the aux forward, each of which must leave a GPU shard's bytes as they were (else a new
    generation key): a batch without padding given no mask (one attention bias, not one per row) and the head's
    weight cast to bf16 once, against autocast casting it at every call (both held on an H200, session 26)."""
    from common.batching import attention_mask
    from common.corrupt import head_weight
    rows = [r for r in load_split(built.corpus_dir, "train") if len(r) == 32][:8]
    corruptor = Corruptor(built.aux_dir / AUX_FILE, seed=3, mask_prob=0.15, batch_tokens=8 * 32, device="cuda")
    assert corruptor.head_weight is not None and corruptor.head_weight.dtype == torch.bfloat16
    _, _, [(_, ids, attn, flags)] = corruptor.masked_batches(rows, np.arange(8), 0)
    assert attn is None
    with torch.no_grad():
        no_mask = corruptor.aux_logits(ids, None, flags)
        masked = corruptor.aux_logits(ids, attention_mask([32] * 8, 32).cuda(), flags)
        corruptor.head_weight = None  # autocast's own cast, at every call
        recast = corruptor.aux_logits(ids, None, flags)
    assert torch.equal(no_mask, masked) and torch.equal(no_mask, recast)
    assert torch.equal(head_weight(corruptor.model, corruptor.autocast), corruptor.model.head.embedding.weight.bfloat16())


def test_bench_gpu_runs_every_part_at_a_small_shape(tmp_path):
    """`make bench-gpu`'s measures at the tiny shape: each part writes its figures, none fails. (Its
    FlexAttention part is left out: on torch 2.11 / H100 its compiled kernel asked for more shared
    memory than the GPU has, docs/benchmarks.md.)"""
    import json
    import subprocess
    import sys
    from tests.conftest import ROOT
    result = subprocess.run([sys.executable, "-m", "bench.gpu", "--manifest", "manifests/tiny.toml", "--rows", "4",
                             "--accum", "2", "--steps", "2", "--gen-rows", "64", "--gen-shards", "2", "--only", "mfu,efficiency,generation",
                             "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads((tmp_path / "base-gpu.json").read_text())
    assert out["errors"] == {} and 0 < out["mfu"]["mfu"] < 1
    assert 0 < out["generation"]["gen_vs_forward"] and out["efficiency"]["offline_vs_electra_time"] > 0
