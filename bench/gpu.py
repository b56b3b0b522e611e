"""`make bench-gpu`: the base preset's shape on a GPU, measured as ratios in one run.

    python -m bench.gpu [--manifest manifests/base.toml] [--rows 32] [--accum 4] [--steps 12]

Synthetic data (random non-special token ids, full-length rows): compute does not depend on the text,
so nothing has to be prepared at the base shape (12 x 768, aux 4 layers, sequence 512, 128K vocabulary).
  mfu               the trainer's own update function (`train.trainer.update`: train/objectives.py's loss under
                    bf16 autocast, clip, fused AdamW, schedule) with `--accum` micro-batches of `--rows` rows;
                    model FLOPs per update as executed (bench.flops: layers + softmax + RTD head, embedding
                    lookups free, backward = 2 x forward) / seconds / the GPU's dense bf16 peak (its datasheet;
                    also over a bf16 matmul measured in the same run); the attention backend that ran, by the
                    profiler's name (`sdpa_kernels`)
  gen_vs_forward    generation tokens/s as a GPU actor of generate/job.py runs it (ShardWriter, two shards in
                    flight, the model behind one lock) / the aux model's pure bf16 forward on the same batches;
                    the aux forward's attention backend (`aux_sdpa_kernels`) and its model FLOPs / the bf16 peak
                    (`forward_vs_peak`: encoder layers over every token, MLM head at masked positions)
  efficiency        bench-efficiency's comparison at the base shape: fast-offline (RTD on corrupted rows) vs
                    electra (generator 4 layers + discriminator, joint loss, online sampling), the same rows
                    and update (train/objectives.py), seconds per update and peak memory, one after the other
  attention         one layer's attention with the T5 bias, forward + backward (and forward alone, as the aux
                    model runs it): common/attention.py's kernel, SDPA with an additive bias (common/model.py),
                    FlexAttention (bias as a score modification, compiled) and others; outputs compared
  mfu_sdpa, mfu_compiled_sdpa   mfu and mfu_compiled with `[train] attention = "sdpa"` (the baseline)
  mfu_compiled_inductor_embedding   mfu_compiled with the table lookups' backward (tokens, relative positions)
                    left to Inductor (before common/embedding.py)
  fused_tiles       common/attention.py's kernels with each tile shape (forward, then backward); the fastest are
                    used by the parts after it
`--mps`: start a CUDA MPS control daemon of this run's own (its pipe and log folders in a temporary folder)
before any CUDA work, so this process and the ones it starts (generation_processes) are its clients: their
kernels may run side by side instead of taking turns on the GPU; stopped at exit, its logs copied to --out.
Writes bench/results/base-gpu.json and .md (the device's name inside). Needs CUDA (the measures take a
device: tests/test_bench.py runs them on the CPU at a tiny shape).
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench import machine
from bench.flops import Encoder, encoder_forward_flops, output_layer_flops
from common import attention as fused_attention
from common.checkpoint import save_aux
from common.config import GenerateConfig, load_manifest
from common.corrupt import Corruptor
from common.curriculum import masked_count
from common.embedding import use_eager_backward
from common.io import atomic_write_json, atomic_write_text
from common.model import MaskedLM, RelativePositionBias, ReplacedTokenDetector, relative_position_bucket
from common.optim import build_optimizer, build_scheduler
from common.plan import plan_tasks
from common.tokenizer import SPECIAL_IDS
from generate.worker import ShardWriter, mean_phases

RESULTS = Path("bench/results")
ATTENTION_WAYS = ("sdpa_dense_bias", "fused", "fused_dropout", "sdpa_dense_dropout", "sdpa_efficient", "sdpa_head_bias",
                  "sdpa_no_bias", "compiled_manual", "flex_table", "flex_dense", "sdpa_bias_no_grad",
                  "sdpa_bias_no_grad_dropout", "split_bias_grad")
# Dense bf16 tensor-core peak, FLOP/s, from NVIDIA's datasheets (no sparsity), the first name the device's
# contains: the PCIe and NVL cards before their SXM parts ("NVIDIA H100 80GB HBM3", "NVIDIA H200").
BF16_PEAK = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12), ("H100", 989.4e12),
             ("H200", 989.4e12), ("A100", 312e12), ("L40S", 362e12))


def bf16_peak(name: str) -> float | None:
    """None for a device not in the table: no utilisation is reported rather than one against another card's peak."""
    return next((v for k, v in BF16_PEAK if k in name), None)


def device_seconds(fn, repeats: int, device: torch.device = torch.device("cuda")) -> list[float]:
    """Wall seconds of each of `repeats` calls, the device's queue drained before and after each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory since the last reset: the GPU's allocations, or on CPU the process's peak RSS."""
    from train.trainer import peak_memory_mb
    return peak_memory_mb(device) / 1024


def reset_peak_memory(device: torch.device) -> None:
    """The peak from here on, what an earlier measure left (reference cycles included) freed first. On CPU the
    process's VmHWM set back to its RSS (Linux), so that each part's peak is its own, not the process's."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:  # not Linux: the process's peak, as before
            pass


def matmul_flops_per_s(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    device_seconds(lambda: a @ b, 3)
    return 2 * n**3 / statistics.median(device_seconds(lambda: a @ b, 10))


def synthetic_rows(n: int, length: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(len(SPECIAL_IDS), vocab, length).astype(np.int32) for _ in range(n)]


def update_flops(config, rows: int) -> float:
    """Model FLOPs of one training update of the main model over `rows` full rows, as executed."""
    m, L, V = config.model, config.corpus.max_seq_len, config.tokenizer.vocab_size
    enc = Encoder(m.hidden_size, m.ffn_size, m.num_heads, m.num_layers, V)
    forward = (encoder_forward_flops(enc, L, softmax=True) - 2 * L * V * m.hidden_size
               + output_layer_flops(m.hidden_size, m.hidden_size, L) + output_layer_flops(m.hidden_size, 1, L))
    return 3 * forward * rows


def aux_forward_flops(config, rows: int, masked: int) -> float:
    """Model FLOPs of the aux model's forward as generation runs it: its encoder over `rows` full rows (layers and
    softmax; embedding lookups free) and its MLM head (the d x d transform, then the d x V output layer) at the
    `masked` positions only."""
    m, L, V = config.model, config.corpus.max_seq_len, config.tokenizer.vocab_size
    enc = Encoder(m.hidden_size, m.ffn_size, m.num_heads, config.aux.num_layers, V)
    encoder = encoder_forward_flops(enc, L, softmax=True) - 2 * L * V * m.hidden_size
    return (rows * encoder + output_layer_flops(m.hidden_size, m.hidden_size, masked)
            + output_layer_flops(m.hidden_size, V, masked))


def trainer_update(model, optimizer, scheduler, rows: dict, accum: int, config, device: torch.device,
                   objective_name: str = "fast-offline", compiled_model=None):
    """The trainer's own update as (update, one micro-batch's forward + backward): `train.trainer.update` (its
    forward and loss of train/objectives.py under bf16 autocast on a GPU, backward, clip, fused AdamW, schedule)
    over `accum` micro-batches of `rows`, each made into tensors in its turn as the trainer does (`to_tensors`,
    or `electra_tensors` masking on the host), and `train.trainer.accumulate` over one of them.
    `compiled_model`: the model under torch.compile, passed where the trainer passes it."""
    from train import trainer
    from train.data import to_tensors
    from train.objectives import electra_tensors
    tc, g = dataclasses.replace(config.train, objective=objective_name), config.generate
    electra = objective_name == "electra"
    to_batch = partial(electra_tensors, seed=config.seed, mask_prob=g.mask_prob) if electra else to_tensors
    count_masked = partial(masked_count, mask_prob=g.mask_prob)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    forward_model = model if compiled_model is None else compiled_model  # a compiled module has no truth value

    def update():
        trainer.update(forward_model, model, optimizer, scheduler, [rows] * accum, to_batch, device, autocast, 1, tc,
                       count_masked)

    def forward_backward():
        trainer.accumulate(forward_model, [rows], to_batch, device, autocast, 1, tc.objective, tc.electra_lambda,
                           count_masked)
    return update, forward_backward


def sdpa_kernels(fn) -> list[str]:
    """The fused-attention backends `fn` runs, as the profiler names them (aten::_scaled_dot_product_*: flash,
    efficient, cudnn, math, flash_attention_for_cpu; fast_electra::attention_*: common/attention.py), sorted.
    The CPU's op events carry the names on any device."""
    from torch.profiler import ProfilerActivity
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = ("aten::_scaled_dot_product", "fast_electra::attention")
    return sorted({e.key for e in prof.key_averages() if e.key.startswith(names)})


def profile_call(fn, device: torch.device) -> dict:
    """Where one call's time goes: prints the ops by device time and by host time, and returns the call's wall
    seconds under the profiler, the device's kernel time in it (`device_busy_fraction`: kernel seconds / wall
    seconds) and how many times the host waited for the device (synchronising calls and copies)."""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    for key in (["device_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
        print(averages.table(sort_by=key, row_limit=25, max_name_column_width=60), flush=True)
    events = prof.events()
    kernel_us = sum(e.time_range.elapsed_us() for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    waits = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "aten::_local_scalar_dense")
    counts = {w: sum(1 for e in events if e.name == w) for w in waits}
    return {"profiled_wall_s": wall, "device_kernel_s": kernel_us / 1e6, "device_busy_fraction": kernel_us / 1e6 / wall,
            "host_waits": counts}


def synthetic_batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict:
    """Full-length rows as the trainer reads them from shards (RTD labels at the mask rate) and as electra
    reads them from the corpus (row ids, epoch)."""
    rng = np.random.default_rng(seed + 1)
    return {"input_ids": synthetic_rows(rows, length, vocab, seed),
            "labels": [(rng.random(length) < 0.15).astype(np.int8) for _ in range(rows)],
            "row_id": np.arange(rows), "epoch": 0}


def measure_mfu(config, rows: int, accum: int, steps: int, profile: bool = False, compiled: bool = False,
                device: torch.device = torch.device("cuda"), attention: str = "auto",
                inductor_embedding: bool = False) -> dict:
    """`compiled`: the same update with the model under torch.compile (`[train] compile`, as the trainer does,
    the table lookups' backward through ATen: common/embedding.py). `attention`: `[train] attention`, "auto"
    (the fused kernel where the trainer would take it) or "sdpa". `inductor_embedding`: compiled, the lookups
    left to Inductor (before common/embedding.py, for comparison)."""
    tc, V, L = config.train, config.tokenizer.vocab_size, config.corpus.max_seq_len
    torch.manual_seed(0)
    model = ReplacedTokenDetector(config.model, V).to(device)
    if attention == "auto" and device.type == "cuda":  # as train.trainer.build_model does
        fused_attention.use_fused(model)
    if compiled and not inductor_embedding:  # as train.trainer does before torch.compile
        use_eager_backward(model)
    optimizer = build_optimizer(model, tc.lr, tc.betas, tc.eps, tc.weight_decay, tc.rel_bias_lr_scale, tc.embed_lr_scale)
    scheduler = build_scheduler(optimizer, 10, 10_000)
    update, forward_backward = trainer_update(model, optimizer, scheduler, synthetic_batch(rows, L, V), accum, config,
                                              device, compiled_model=torch.compile(model) if compiled else None)

    device_seconds(update, 2, device)
    reset_peak_memory(device)
    seconds = statistics.median(device_seconds(update, steps, device))
    micro = statistics.median(device_seconds(forward_backward, steps, device))
    # where two updates' GPU time goes, by kernel, and whether the host keeps the device busy
    profiled = profile_call(lambda: (update(), update()), device) if profile else {}
    flops = update_flops(config, rows * accum)
    kernels = sdpa_kernels(forward_backward)  # the attention of the trainer's own forward and backward
    optimizer.zero_grad(set_to_none=True)
    return {"sdpa_kernels": kernels, "attention": attention, "inductor_embedding": inductor_embedding,
            "fused_tiles": list(current_tiles().values()),
            "rows_per_micro_batch": rows, "micro_batches": accum, "tokens_per_update": rows * accum * L,
            "seconds_per_update": seconds, "seconds_per_micro_batch_fwd_bwd": micro,
            "model_flops_per_update": flops, "achieved_flops_per_s": flops / seconds,
            "fwd_bwd_flops_per_s": update_flops(config, rows) / micro,
            "peak_memory_gib": peak_memory_gib(device),
            "parameters": sum(p.numel() for p in model.parameters()), **profiled}


def measure_efficiency(config, rows: int, accum: int, steps: int, device: torch.device = torch.device("cuda"),
                       blocks: int = 3) -> dict:
    """fast-offline vs electra at the manifest's shape: seconds per update and peak memory (paper section 4.3),
    both through the trainer's update on the same rows. Peak memory: each alone. Seconds: both built, timed in
    `blocks` alternating blocks (as bench/efficiency.py on the CPU), so a drift of the machine's speed during the
    run weighs on both alike; one mode timed after the other gave 0.540-0.693 over three H200 calls."""
    from train.objectives import ElectraPair
    tc, V, L = config.train, config.tokenizer.vocab_size, config.corpus.max_seq_len
    batch = synthetic_batch(rows, L, V, seed=2)

    def build(name: str):
        torch.manual_seed(0)
        model = (ElectraPair(config.model, V, config.aux.num_layers) if name == "electra" else ReplacedTokenDetector(config.model, V)).to(device)
        if config.train.attention == "auto" and device.type == "cuda":  # as train.trainer.build_model does
            fused_attention.use_fused(model)
        optimizer = build_optimizer(model, tc.lr, tc.betas, tc.eps, tc.weight_decay, tc.rel_bias_lr_scale,
                                    tc.embed_lr_scale)
        return trainer_update(model, optimizer, build_scheduler(optimizer, 10, 10_000), batch, accum, config,
                              device, name)[0]

    def peak_alone(name: str) -> float:
        # a function of its own: its model, optimizer and closures are gone when the next one's peak is reset
        # (kept alive by the scheduler and the closures, fast-offline's weights and moments counted in electra's)
        reset_peak_memory(device)
        device_seconds(build(name), 2, device)
        return peak_memory_gib(device)

    modes, out = ("fast-offline", "electra"), {}
    for name in modes:
        out[f"{name}_peak_memory_gib"] = peak_alone(name)
    updates = {name: build(name) for name in modes}
    for update in updates.values():
        device_seconds(update, 1, device)  # warm-up: the allocator's blocks, cuBLAS's handles, autotuning
    times, blocks = {name: [] for name in modes}, max(1, min(blocks, steps))
    for _ in range(blocks):
        for name, update in updates.items():
            times[name] += device_seconds(update, max(1, steps // blocks), device)
    for name in modes:
        out[f"{name}_s_per_update"] = statistics.median(times[name])
    out["timed_blocks"], out["timed_updates_per_mode"] = blocks, len(times["electra"])
    out["offline_vs_electra_time"] = out["fast-offline_s_per_update"] / out["electra_s_per_update"]
    out["offline_vs_electra_memory"] = out["fast-offline_peak_memory_gib"] / out["electra_peak_memory_gib"]
    out["rows_per_micro_batch"], out["micro_batches"] = rows, accum
    return out


def measure_generation(config, rows_per_shard: int, shards: int, device: torch.device = torch.device("cuda"),
                       profile: bool = False, depths: tuple[int, ...] = (2,), chunk_entries: int | None = None) -> dict:
    """Tokens/s of ShardWriter with two shards in flight (generate/job.py's GPU actor) over the aux
    model's pure forward on the same masked batches; also with each of `depths` shards in flight
    (`[generate] tasks_in_flight`), `generation_tokens_per_s_by_depth`. `chunk_entries`: the sampler's
    positions x V per chunk, if not the Corruptor's own."""
    g, V, L = config.generate, config.tokenizer.vocab_size, config.corpus.max_seq_len
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        torch.manual_seed(config.seed)
        aux = MaskedLM(config.model, V, config.aux.num_layers)
        aux_path = save_aux(aux, config.model, config.aux.num_layers, V, "synthetic", tmp, {"steps": 0})
        corruptor = Corruptor(aux_path, config.seed, g.mask_prob, g.batch_tokens, device=str(device))
        corruptor.chunk_entries = chunk_entries or corruptor.chunk_entries
        rows = synthetic_rows(rows_per_shard * (shards + 1), L, V, seed=1)
        plan = GenerateConfig(epochs=1, rows_per_shard=rows_per_shard, valid_rows=0)
        tasks = plan_tasks(len(rows), 0, plan, config.seed)  # one epoch of the synthetic rows, T from 2 down
        writer = ShardWriter({"train": rows}, corruptor, tmp, g.zstd_level)
        reset_peak_memory(device)
        writer(tasks[-1])  # warm-up (kernels, allocator), not timed
        lock = threading.Lock()
        by_depth = {}
        for depth in dict.fromkeys((2, *depths)):  # the actor's default first: the peak is read after it
            with ThreadPoolExecutor(max_workers=depth) as pool:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                records = list(pool.map(lambda t: writer(t, lock), tasks[:-1]))
                by_depth[depth] = time.perf_counter() - t0
            if depth == 2:
                peak = peak_memory_gib(device)
                phases = mean_phases(records)
                # a long job's rate: seconds a shard between the first shard done and the last, the pipeline's
                # fill left out (the first shard's preparation and device work, which nothing overlaps: the
                # whole run's time, the figure above, counts it once in only a few shards)
                ends = sorted(r["finished_at"] for r in records)
                steady_s = (ends[-1] - ends[0]) / max(len(ends) - 1, 1)
        generation_s = by_depth[2]
        tokens, masked = sum(r["tokens"] for r in records), sum(r["masked"] for r in records)
        prepared = [corruptor.prepare([rows[i] for i in t.row_ids], t.row_ids, 0)[2] for t in tasks[:-1]]

        @torch.no_grad()
        def forward_only():
            for batches in prepared:
                for _, ids, attn, flags in batches:
                    corruptor.aux_logits(ids, attn, flags)
        reset_peak_memory(device)
        forward_s = min(device_seconds(forward_only, 3, device))
        forward_peak = peak_memory_gib(device)  # the forward alone, each batch's logits at its masked positions
        same_logits = logits_as_before(corruptor, *prepared[0][0][1:])
        kernels = sdpa_kernels(torch.no_grad()(lambda: corruptor.aux_logits(*prepared[0][0][1:])))
        single_s = min(device_seconds(lambda: writer(tasks[0]), 2, device))
        profiled = profile_call(lambda: writer(tasks[0]), device) if profile else {}
    return {"rows_per_shard": rows_per_shard, "shards": shards, "tokens": tokens, "batch_tokens": g.batch_tokens,
            "generation_tokens_per_s": tokens / generation_s, "forward_tokens_per_s": tokens / forward_s,
            "one_shard_at_a_time_tokens_per_s": rows_per_shard * L / single_s,
            "gen_vs_forward": forward_s / generation_s, "peak_memory_gib": peak,
            "chunk_entries": corruptor.chunk_entries, "aux_sdpa_kernels": kernels,
            "forward_peak_memory_gib": forward_peak, "peak_vs_forward_peak": peak / forward_peak, **same_logits,
            "generation_tokens_per_s_by_depth": {d: tokens / s for d, s in by_depth.items()},
            "phase_seconds_per_shard": phases, "generation_seconds_per_shard": generation_s / len(records),
            "gen_vs_forward_by_depth": {d: forward_s / s for d, s in by_depth.items()},
            "steady_seconds_per_shard": steady_s, "gen_vs_forward_steady": forward_s / len(records) / steady_s,
            "forward_flops_per_s": aux_forward_flops(config, tokens // L, masked) / forward_s, **profiled}


@torch.no_grad()
def measure_draws(config, device: torch.device = torch.device("cuda"), repeats: int = 20, seed: int = 0,
                  warmup: int = 3) -> dict:
    """One chunk of sampling at the base vocabulary (the Corruptor's positions x V, bf16 logits of spread 4, T in
    [0.5, 2.5]): milliseconds of the step-by-step temperature draw with its separate top-1 count, and of the
    compiled blocked draw that counts them itself (`common.distributions.chunk_draws`, as a GPU Corruptor runs
    it); the fraction of positions where both draw the same id, and whether the counts agree."""
    from common.corrupt import top1_hits
    from common.distributions import chunk_draws, temperature_draws
    from common.memory import LOGIT_CHUNK_ENTRIES
    from common.tokenizer import Reserved
    V = config.tokenizer.vocab_size
    rows = max(1, LOGIT_CHUNK_ENTRIES // V)
    reserved = Reserved(head=len(SPECIAL_IDS), tail=0)
    g = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(rows, V, generator=g, device=device) * 4.0).to(torch.bfloat16)
    t = torch.rand(rows, generator=g, device=device) * 2.0 + 0.5
    u = torch.rand(rows, generator=g, device=device, dtype=torch.float64)
    # half the rows hit (the argmax, the first of ties, which both counts take), half miss (the smallest logit)
    originals = torch.where(torch.arange(rows, device=device) % 2 == 0, logits.argmax(dim=-1), logits.argmin(dim=-1))
    compiled = torch.compile(chunk_draws, dynamic=False)

    def steps():
        return (*temperature_draws(logits, t, u, reserved), top1_hits(logits, originals))

    def blocked():
        return compiled(logits, t, u, originals, reserved.head, V)
    (a, _, hits_a), (b, _, hits_b) = steps(), blocked()
    timed = {}
    for name, fn in (("steps", steps), ("blocked", blocked)):
        if warmup:
            device_seconds(fn, warmup, device)
        timed[name] = 1e3 * statistics.median(device_seconds(fn, repeats, device))
    return {"positions": rows, "vocab": V, "step_by_step_ms": timed["steps"], "blocked_compiled_ms": timed["blocked"],
            "same_id_fraction": float((a == b).float().mean()), "top1_hits_equal": int(hits_a) == int(hits_b)}


@torch.no_grad()
def logits_as_before(corruptor, ids, attn, flags, rows: int = 8) -> dict:
    """Whether the aux logits of a batch's first `rows` full rows are those of before session 25's two changes, bit
    for bit: without a mask (one attention bias) as with an all-True one, and with the head's weight cast once as
    with autocast casting it at every call. A GPU shard's bytes depend on both (else: a new generation key)."""
    from common.batching import attention_mask
    assert attn is None, "full rows (synthetic_rows) go to the aux model without a mask"
    ids, flags = ids[:rows], flags[:rows]
    one_bias = corruptor.aux_logits(ids, None, flags).clone()  # on CPU the kept buffer: copied before the next
    full = attention_mask([ids.shape[1]] * len(ids), ids.shape[1]).to(ids.device)
    per_row = corruptor.aux_logits(ids, full, flags).clone()
    kept, corruptor.head_weight = corruptor.head_weight, None
    try:
        recast = corruptor.aux_logits(ids, None, flags).clone()
    finally:
        corruptor.head_weight = kept
    return {"no_mask_logits_equal": bool(torch.equal(one_bias, per_row)),
            "head_weight_logits_equal": bool(torch.equal(one_bias, recast))}


def _generation_process(aux_path: str, config_path: str, tasks: list, out_dir: str, device: str, ready, go,
                        results, chunk_entries: int | None = None) -> None:
    """One of `measure_generation_processes`' processes: a GPU actor of generate/job.py as it would be with
    several actors sharing a GPU (its own Corruptor, two shards in flight behind its own lock)."""
    config = load_manifest(config_path)
    g, V, L = config.generate, config.tokenizer.vocab_size, config.corpus.max_seq_len
    corruptor = Corruptor(aux_path, config.seed, g.mask_prob, g.batch_tokens, device=device)
    corruptor.chunk_entries = chunk_entries or corruptor.chunk_entries
    rows = synthetic_rows(tasks[0].spec.num_rows, L, V, seed=1)  # the plan's rows, all of them
    writer = ShardWriter({"train": rows}, corruptor, out_dir, g.zstd_level)
    writer(dataclasses.replace(tasks[0], path=f"warm-up-{os.getpid()}.parquet"))  # compile, kernels: not timed
    if device == "cuda":
        torch.cuda.synchronize()
    ready.put(os.getpid())
    go.wait()
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=2) as pool:
        records = list(pool.map(lambda t: writer(t, lock), tasks))
    results.put((sum(r["tokens"] for r in records), time.perf_counter(), mean_phases(records),
                 [r["finished_at"] for r in records]))


def _from_processes(queue, procs):
    """The next item `procs` put on `queue`; an error as soon as one of them has died instead."""
    import queue as queues
    while True:
        try:
            return queue.get(timeout=2)
        except queues.Empty:
            failed = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a generation process exited with code {failed[0]} (its traceback above)")


def measure_generation_processes(config, manifest: str, rows_per_shard: int, shards: int, processes: int,
                                 device: torch.device = torch.device("cuda"), chunk_entries: int | None = None) -> dict:
    """Tokens/s of generation by `processes` processes sharing the device, each an actor with two shards in
    flight on its share of `shards` shards (the host work of one process, Python's, is what bounds one actor:
    `gen_vs_forward`). From the moment all are ready (aux model loaded, a shard done) to the last one done."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    V = config.tokenizer.vocab_size
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        torch.manual_seed(config.seed)
        aux = MaskedLM(config.model, V, config.aux.num_layers)
        aux_path = save_aux(aux, config.model, config.aux.num_layers, V, "synthetic", tmp, {"steps": 0})
        plan = GenerateConfig(epochs=1, rows_per_shard=rows_per_shard, valid_rows=0)
        shards = -(-shards // processes) * processes  # as many for each process: none waits on another's last
        tasks = plan_tasks(rows_per_shard * shards, 0, plan, config.seed)
        ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_generation_process, args=(str(aux_path), manifest, tasks[i::processes], tmp,
                                                                device.type, ready, go, results, chunk_entries))
                 for i in range(processes)]
        for proc in procs:
            proc.start()
        for _ in procs:
            _from_processes(ready, procs)
        t0 = time.perf_counter()
        go.set()
        done = [_from_processes(results, procs) for _ in procs]
        for proc in procs:
            proc.join()
        seconds = max(end for _, end, _, _ in done) - t0
        tokens = sum(n for n, *_ in done)
        phases = {name: sum(d[2][name] for d in done) / processes for name in done[0][2]}  # per shard, mean
        # a long job's rate: shards done after each process's first, over the time from the last of those firsts
        # to the end (every process's pipeline fill left out; with 2 shards a process there is no steady part)
        ends = sorted(end for d in done for end in d[3])
        steady = (len(ends) - processes) / (ends[-1] - ends[processes - 1]) if len(ends) > processes else None
    return {"processes": processes, "shards": shards, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "steady_tokens_per_s": steady and steady * tokens / len(ends), "phase_seconds_per_shard": phases}


def _bias_grad(q, k, v, bias, out, grad):
    """The gradient of softmax(q k^T / sqrt(d) + bias) v with respect to a (1, H, L, L) bias, from the output and
    its gradient: dS = P * (dO v^T - rowsum(dO * O)), summed over the batch (no attention dropout)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + bias.float()
    probs = torch.softmax(scores, dim=-1)
    dprobs = grad.float() @ v.float().transpose(-2, -1)
    row = (grad.float() * out.float()).sum(-1, keepdim=True)
    return (probs * (dprobs - row)).sum(0, keepdim=True).to(bias.dtype)


class _SplitBiasGrad(torch.autograd.Function):
    """Identity on the attention's output whose backward gives the bias its gradient (`_bias_grad`), so that the
    attention itself runs with a bias that needs none (a fused kernel that does not compute one)."""

    @staticmethod
    def forward(ctx, out, q, k, v, bias, bias_grad):
        ctx.save_for_backward(out, q, k, v, bias)
        ctx.bias_grad = bias_grad
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        out, q, k, v, bias = ctx.saved_tensors
        return grad, None, None, None, ctx.bias_grad(q, k, v, bias, out, grad), None


def split_bias_attention(q, k, v, bias, bias_grad=_bias_grad):
    """SDPA with the bias detached (q, k, v get their gradients from the fused kernel), the bias's gradient
    computed beside it (an experiment: no attention dropout)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.detach())
    return _SplitBiasGrad.apply(out, q.detach(), k.detach(), v.detach(), bias, bias_grad)


def measure_attention(config, rows: int, repeats: int = 10, device: torch.device = torch.device("cuda"),
                      variants: tuple[str, ...] | None = None) -> dict:
    """One layer's attention with the T5 bias at the base shape, full-length rows, each way the trainer could
    run it: forward + backward (q, k, v and the bias table get gradients) and forward alone, milliseconds;
    the largest difference of outputs and gradients from the first way; the fused backend that ran (profiler).
      sdpa_dense_bias      the model's way: a (B, H, L, L) bias (relative positions + padding) in bf16
      sdpa_dense_dropout   the same with the manifest's attention dropout (not the same function: timed only)
      sdpa_efficient       the same bias with SDPA held to its memory-efficient backend
      sdpa_head_bias       a (1, H, L, L) bias, no padding term, broadcast over the batch
      sdpa_no_bias         no bias at all (cuDNN on an H200): a floor, not the same function
      compiled_manual      q k^T / sqrt(d) + bias, softmax, @ v under torch.compile
      flex_table           FlexAttention, the score modification indexing the (buckets, H) table
      flex_dense           FlexAttention, the score modification indexing a dense bf16 (H, L, L) bias
      sdpa_bias_no_grad    the (1, H, L, L) bias detached: q, k, v get gradients, the table none (timed only)
      sdpa_bias_no_grad_dropout  the same with attention dropout (timed only)
      split_bias_grad      the detached bias's SDPA, the bias's gradient beside it (`split_bias_attention`,
                           that gradient compiled where not on a CPU)
    Flex runs with kernel options small enough for the GPU's shared memory (its defaults asked for 278,528
    bytes on an H100). A way that fails is reported with its error, the others still measured."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    m, L = config.model, config.corpus.max_seq_len
    h, d = m.num_heads, m.hidden_size // m.num_heads
    torch.manual_seed(0)
    dt = torch.bfloat16
    q, k, v = (torch.randn(rows, h, L, d, device=device, dtype=dt, requires_grad=True) for _ in range(3))
    rel = RelativePositionBias(h, m.rel_buckets, m.rel_max_distance).to(device)  # the model's own lookup
    torch.nn.init.normal_(rel.bias.weight, std=0.5)
    table = rel.bias.weight
    pos = torch.arange(L, device=device)
    buckets = relative_position_bucket(pos[None, :] - pos[:, None], m.rel_buckets, m.rel_max_distance)
    pad = torch.zeros(rows, 1, 1, L, device=device, dtype=dt)  # full rows: the padding term is all zeros

    def head_bias():
        return rel(L).to(dt)  # (1, H, L, L), as common/model.py's encoder builds it

    def sdpa_dense(p=0.0):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=head_bias() + pad, dropout_p=p)

    def sdpa_efficient():
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return sdpa_dense()

    def manual(q, k, v, bias):
        return torch.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d)) + bias, dim=-1) @ v

    compiled_manual = torch.compile(manual, dynamic=False)
    small = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64,
             "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_stages": 1, "bwd_num_warps": 4}

    def flex(kind):
        from torch.nn.attention.flex_attention import flex_attention
        compiled = torch.compile(flex_attention, dynamic=False)

        def run():
            if kind == "table":
                def score_mod(score, b, head, q_idx, kv_idx):
                    return score + table[buckets[q_idx, kv_idx], head]
            else:
                dense = head_bias()[0]

                def score_mod(score, b, head, q_idx, kv_idx):
                    return score + dense[head, q_idx, kv_idx]
            return compiled(q, k, v, score_mod=score_mod, kernel_options=small)
        return run

    compiled_bias_grad = _bias_grad if device.type == "cpu" else torch.compile(_bias_grad, dynamic=False)
    ways = {"sdpa_dense_bias": sdpa_dense, "sdpa_dense_dropout": lambda: sdpa_dense(m.dropout),
            "fused": lambda: fused_attention.attention(q, k, v, head_bias()),
            "fused_dropout": lambda: fused_attention.attention(q, k, v, head_bias(), m.dropout),
            "sdpa_efficient": sdpa_efficient,
            "sdpa_head_bias": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=head_bias()),
            "sdpa_no_bias": lambda: F.scaled_dot_product_attention(q, k, v),
            "compiled_manual": lambda: compiled_manual(q, k, v, head_bias() + pad),
            "flex_table": flex("table"), "flex_dense": flex("dense"),
            "sdpa_bias_no_grad": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=head_bias().detach()),
            "sdpa_bias_no_grad_dropout": lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=head_bias().detach(), dropout_p=m.dropout),
            "split_bias_grad": lambda: split_bias_attention(q, k, v, head_bias(), compiled_bias_grad)}
    same_function = ("sdpa_dense_bias", "fused", "sdpa_efficient", "sdpa_head_bias", "compiled_manual", "flex_table",
                     "flex_dense", "split_bias_grad")
    g = torch.randn(rows, h, L, d, device=device, dtype=dt)
    out, reference = {"rows": rows, "length": L, "heads": h, "head_dim": d}, None
    for name in variants or ATTENTION_WAYS:
        fn = ways[name]
        try:
            for t in (q, k, v, table):
                t.grad = None
            y = fn()
            y.backward(g)
            got = [y.detach().float()] + [torch.zeros_like(t, dtype=torch.float32) if t.grad is None else t.grad.float().clone()
                                          for t in (q, k, v, table)]
            if name in same_function:
                if reference is None:
                    reference = got
                else:  # outputs, then q, k, v and table gradients, each relative to the first way's largest
                    out[f"{name}_max_rel_diff"] = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
                                                     for a, b in zip(got, reference))

            def fwd_bwd():
                fn().backward(g)
            device_seconds(fwd_bwd, 2, device)
            out[f"{name}_fwd_bwd_ms"] = 1e3 * statistics.median(device_seconds(fwd_bwd, repeats, device))
            with torch.no_grad():
                device_seconds(fn, 2, device)
                out[f"{name}_fwd_ms"] = 1e3 * statistics.median(device_seconds(fn, repeats, device))
            if name.startswith(("sdpa", "split", "fused")):
                out[f"{name}_kernels"] = sdpa_kernels(fwd_bwd)
        except Exception as e:  # noqa: BLE001 -- a way the GPU refuses is a result too
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:600]
            print(f"bench.gpu: attention {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    timed = {k[:-len("_fwd_bwd_ms")]: v for k, v in out.items() if k.endswith("_fwd_bwd_ms")}
    same = {k: v for k, v in timed.items() if k in same_function}
    if same:
        out["fastest_same_function"] = min(same, key=same.get)
    return out


FWD_TILES = ((64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2), (64, 64, 4, 2))
BWD_TILES = ((32, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (32, 128, 4, 3), (128, 32, 8, 3))


def measure_fused_tiles(config, rows: int, repeats: int = 10, device: torch.device = torch.device("cuda"),
                        profile: bool = False) -> dict:
    """common/attention.py's kernels with each (BLOCK_M, BLOCK_N, warps, stages) of FWD_TILES (the backward's
    tiles as committed), then each of BWD_TILES (the forward's as committed): one layer at the manifest's shape,
    full rows, a (1, H, L, L) bias with its gradient, the manifest's attention dropout; fwd+bwd ms (and the
    forward alone for the forward's tiles). The module's tiles are restored after. `profile`: where one forward
    and backward's device time goes with the fastest tiles (printed)."""
    m, L = config.model, config.corpus.max_seq_len
    h, d = m.num_heads, m.hidden_size // m.num_heads
    torch.manual_seed(0)
    q, k, v = (torch.randn(rows, h, L, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, h, L, L, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(rows, h, L, d, device=device, dtype=torch.bfloat16)
    A = fused_attention
    kept = current_tiles()
    out = {"rows": rows, "length": L, "fwd_bwd_ms": {}, "fwd_ms": {}, "errors": {}}
    try:
        for which, tiles in (("fwd", FWD_TILES), ("bwd", BWD_TILES)):
            for tile in tiles:
                key = f"{which} {tile}"
                apply_tiles({"best_fwd": tile, "best_bwd": kept["best_bwd"]} if which == "fwd" else
                            {"best_fwd": kept["best_fwd"], "best_bwd": tile})
                A._fitted.clear()  # each tile tried afresh: one the GPU refuses must not pass as its fallback
                try:
                    def fwd_bwd():
                        A.attention(q, k, v, bias, m.dropout).backward(g)
                    device_seconds(fwd_bwd, 2, device)
                    out["fwd_bwd_ms"][key] = 1e3 * statistics.median(device_seconds(fwd_bwd, repeats, device))
                    if which == "fwd":
                        with torch.no_grad():
                            fwd = partial(A.attention, q, k, v, bias, m.dropout)
                            device_seconds(fwd, 2, device)
                            out["fwd_ms"][key] = 1e3 * statistics.median(device_seconds(fwd, repeats, device))
                    ran = {kind: tiles for (kind, *_, asked), tiles in A._fitted.items() if tiles != asked}
                    swept = "forward" if which == "fwd" else "backward"
                    if swept in ran:  # the GPU's shared memory refused the tile: what was timed was a fallback
                        out["fwd_bwd_ms"].pop(key), out["fwd_ms"].pop(key, None)
                        out["errors"][key] = f"shared memory: ran the fallback tiles {ran[swept]}"
                    elif ran:  # the other kernel's committed tiles fell back: the same for every tile of this sweep
                        out.setdefault("notes", {})[key] = f"the other kernel ran its fallback tiles {ran}"
                except Exception as e:  # noqa: BLE001 -- a tile the GPU refuses (shared memory) is a result too
                    out["errors"][key] = f"{type(e).__name__}: {e}"[:300]
    finally:
        apply_tiles(kept)
        A._fitted.clear()
    if out["fwd_bwd_ms"]:
        out["fastest"] = min(out["fwd_bwd_ms"], key=out["fwd_bwd_ms"].get)
    for which, tiles in (("fwd", FWD_TILES), ("bwd", BWD_TILES)):
        timed = {t: out["fwd_bwd_ms"][f"{which} {t}"] for t in tiles if f"{which} {t}" in out["fwd_bwd_ms"]}
        if timed:
            out[f"best_{which}"] = list(min(timed, key=timed.get))
    if profile and "best_fwd" in out and "best_bwd" in out:
        apply_tiles(out)
        try:
            out["profile_best"] = profile_call(lambda: A.attention(q, k, v, bias, m.dropout).backward(g), device)
        finally:
            apply_tiles(kept)
    return out


def current_tiles() -> dict:
    """common/attention.py's tiles now, in `apply_tiles`'s form."""
    A = fused_attention
    return {"best_fwd": [A.FWD_BLOCK_M, A.FWD_BLOCK_N, A.FWD_WARPS, A.FWD_STAGES],
            "best_bwd": [A.BWD_BLOCK_M, A.BWD_BLOCK_N, A.BWD_WARPS, A.BWD_STAGES]}


def apply_tiles(tiles: dict) -> None:
    """The fastest forward and backward tiles of `measure_fused_tiles` for the rest of this run's parts."""
    A = fused_attention
    if "best_fwd" in tiles:
        A.FWD_BLOCK_M, A.FWD_BLOCK_N, A.FWD_WARPS, A.FWD_STAGES = tiles["best_fwd"]
    if "best_bwd" in tiles:
        A.BWD_BLOCK_M, A.BWD_BLOCK_N, A.BWD_WARPS, A.BWD_STAGES = tiles["best_bwd"]


PARTS = ("mfu", "mfu_compiled", "mfu_compiled_inductor_embedding", "mfu_sdpa", "mfu_compiled_sdpa", "fused_tiles",
         "efficiency", "generation", "draws", "attention", "generation_processes")


def start_mps(folder: Path) -> dict:
    """A CUDA MPS control daemon for this process and its children (module docstring, `--mps`); what happened,
    for the results. Must run before this process first uses CUDA."""
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        return {"started": False, "error": "nvidia-cuda-mps-control is not on PATH"}
    dirs = {"CUDA_MPS_PIPE_DIRECTORY": folder / "pipe", "CUDA_MPS_LOG_DIRECTORY": folder / "log"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    before = {k: os.environ.get(k) for k in dirs}
    os.environ.update({k: str(v) for k, v in dirs.items()})
    started = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=60)
    if started.returncode != 0:  # the environment as it was: a daemon of the machine's own stays reachable
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        return {"started": False, "error": f"exit {started.returncode}: {started.stderr.strip()[:500]}"}

    def stop():  # not waited for: the daemon quits once its clients, this process among them, have exited
        quit_ = subprocess.Popen([exe], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 text=True, start_new_session=True)
        quit_.stdin.write("quit\n")
        quit_.stdin.close()
    atexit.register(stop)
    return {"started": True, "folder": str(folder)}


def mps_servers() -> str:
    """The MPS daemon's running servers (their process ids), as its control program answers."""
    exe = shutil.which("nvidia-cuda-mps-control")
    answer = subprocess.run([exe], input="get_server_list\n", text=True, capture_output=True, timeout=60)
    return (answer.stdout + answer.stderr).strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu")
    parser.add_argument("--manifest", default="manifests/base.toml")
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per update")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--gen-rows", type=int, default=2048, help="rows per generated shard")
    # 16: each of 4 processes makes 4 shards, so the first one's masking and the last one's write, which nothing
    # overlaps, weigh less (6 shards over 4 processes gave 0.591 of the forward where 16 gave 0.652, H200)
    parser.add_argument("--gen-shards", type=int, default=16)
    parser.add_argument("--gen-depths", default="2", help="shards in flight to time generation at, comma-separated")
    parser.add_argument("--gen-processes", default="2,4", help="generation_processes: processes sharing the GPU")
    parser.add_argument("--gen-chunk-entries", type=int, default=None,
                        help="generation: the sampler's positions x V per chunk (default: the Corruptor's)")
    parser.add_argument("--only", default="mfu,efficiency,generation,attention")
    parser.add_argument("--attention-ways", default="", help="attention: the ways to time, comma-separated (all)")
    parser.add_argument("--profile", action="store_true", help="print the update's GPU time by kernel")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--mps", action="store_true", help="run under a CUDA MPS daemon of its own (docstring)")
    args = parser.parse_args(argv)
    unknown = [part for part in args.only.split(",") if part not in PARTS]
    if unknown:  # said before a GPU's time is spent, not after the other parts
        parser.error(f"--only: unknown part(s) {', '.join(unknown)}; the parts: {', '.join(PARTS)}")
    mps = start_mps(Path(tempfile.mkdtemp(prefix="bench-gpu-mps-"))) if args.mps else None
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    config = load_manifest(args.manifest)
    name = torch.cuda.get_device_name()
    result = {"device": name, "torch": torch.__version__, "manifest": args.manifest, "cpu_count": os.cpu_count(),
              "machine": machine(), "bf16_peak_flops": bf16_peak(name), "matmul_bf16_flops_per_s": matmul_flops_per_s()}
    if mps is not None:
        result["mps"] = mps
    measures = {"mfu": lambda: measure_mfu(config, args.rows, args.accum, args.steps, args.profile),
                "mfu_compiled": lambda: measure_mfu(config, args.rows, args.accum, args.steps, args.profile, compiled=True),
                "mfu_compiled_inductor_embedding": lambda: measure_mfu(config, args.rows, args.accum, args.steps,
                                                                       args.profile, compiled=True,
                                                                       inductor_embedding=True),
                "mfu_sdpa": lambda: measure_mfu(config, args.rows, args.accum, args.steps, attention="sdpa"),
                "mfu_compiled_sdpa": lambda: measure_mfu(config, args.rows, args.accum, args.steps, compiled=True,
                                                         attention="sdpa"),
                "fused_tiles": lambda: measure_fused_tiles(config, args.rows, profile=args.profile),
                "efficiency": lambda: measure_efficiency(config, args.rows, args.accum, args.steps),
                "generation": lambda: measure_generation(config, args.gen_rows, args.gen_shards, profile=args.profile,
                                                    depths=tuple(int(d) for d in args.gen_depths.split(",")),
                                                    chunk_entries=args.gen_chunk_entries),
                "draws": lambda: measure_draws(config),
                "attention": lambda: measure_attention(config, args.rows, variants=tuple(args.attention_ways.split(","))
                                                       if args.attention_ways else None),
                "generation_processes": lambda: {
                    str(n): measure_generation_processes(config, args.manifest, args.gen_rows, args.gen_shards, n,
                                                         chunk_entries=args.gen_chunk_entries)
                    for n in map(int, args.gen_processes.split(","))}}
    assert set(measures) == set(PARTS)
    errors = {}
    for part in args.only.split(","):
        started = time.perf_counter()
        try:  # one part failing (out of memory, a kernel missing) still leaves the others' figures
            result[part] = measures[part]()
        except Exception as e:  # noqa: BLE001 -- reported in the results, and the exit code says so
            errors[part] = f"{type(e).__name__}: {e}"[:2000]
            # the whole traceback where it can be read: a GPU is lent rarely, a rerun to see it costs its time
            print(f"bench.gpu: {part} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
            continue
        result.setdefault("part_seconds", {})[part] = time.perf_counter() - started  # for planning a GPU call
        if mps is not None and mps["started"]:
            result["mps"].setdefault("servers_after", {})[part] = mps_servers()
        if part == "fused_tiles":
            apply_tiles(result[part])  # the parts after it run the fastest tiles
        if part.startswith("mfu"):
            r = result[part]
            r["mfu"] = r["achieved_flops_per_s"] / result["bf16_peak_flops"] if result["bf16_peak_flops"] else None
            r["vs_matmul"] = r["achieved_flops_per_s"] / result["matmul_bf16_flops_per_s"]
        if part == "generation":  # the aux forward alone against the GPU's peak
            r = result[part]
            r["forward_vs_peak"] = r["forward_flops_per_s"] / result["bf16_peak_flops"] if result["bf16_peak_flops"] else None
        print(json.dumps({part: result[part]}, indent=1), flush=True)
        write(result, errors, args)  # after every part: a run stopped later keeps what it measured
    write(result, errors, args)
    if mps is not None and mps["started"]:  # the daemon's own account (clients connected, failures)
        shutil.copytree(Path(mps["folder"]) / "log", Path(args.out) / "mps-log", dirs_exist_ok=True)
    print(markdown(result, args))
    return 1 if errors else 0


def write(result: dict, errors: dict, args) -> None:
    result["errors"] = errors
    atomic_write_json(Path(args.out) / "base-gpu.json", result)
    atomic_write_text(Path(args.out) / "base-gpu.md", markdown(result, args) + "\n")


def markdown(r: dict, args) -> str:
    md = [f"# bench-gpu ({r['device']})", "",
          f"`python -m bench.gpu --manifest {args.manifest} --rows {args.rows} --accum {args.accum}` on {r['device']}, "
          f"torch {r['torch']}; synthetic full-length rows. bf16 matmul 8192^3 measured: "
          f"{r['matmul_bf16_flops_per_s'] / 1e12:.0f} TFLOP/s; datasheet dense bf16 peak: "
          f"{(r['bf16_peak_flops'] or 0) / 1e12:.0f} TFLOP/s.", "", "| figure | value | goal |", "|---|---|---|"]
    if "mfu" in r:
        m = r["mfu"]
        md += [f"| trainer MFU, eager (model FLOPs as executed / datasheet peak), {m['tokens_per_update']} tokens per update "
               f"| {m['mfu'] or float('nan'):.3f} ({m['achieved_flops_per_s'] / 1e12:.0f} TFLOP/s, {m['seconds_per_update']:.4f} s/update) | >= 0.40 |",
               f"| same over the measured matmul | {m['vs_matmul']:.3f} | |",
               f"| peak memory | {m['peak_memory_gib']:.1f} GiB | |",
               f"| attention backend of the update (profiler) | {', '.join(m.get('sdpa_kernels', [])) or '?'} | fused |"]
    if "mfu_compiled" in r:
        m = r["mfu_compiled"]
        md += [f"| the same update, model under torch.compile (`[train] compile = auto`: the trainer's path on a GPU) | {m['mfu'] or float('nan'):.3f} "
               f"({m['seconds_per_update']:.4f} s/update) | |"]
    if "mfu_compiled_inductor_embedding" in r:
        m = r["mfu_compiled_inductor_embedding"]
        md += [f"| the same, the table lookups' backward left to Inductor (before common/embedding.py) | "
               f"{m['mfu'] or float('nan'):.3f} ({m['seconds_per_update']:.4f} s/update) | |"]
    if "mps" in r:
        md += [f"| CUDA MPS (`--mps`) | " + ("started" if r["mps"]["started"] else f"not started: {r['mps']['error']}")
               + " | |"]
    for part, what in (("mfu_sdpa", "eager"), ("mfu_compiled_sdpa", "torch.compile")):
        if part in r:
            m = r[part]
            md += [f"| trainer MFU, {what}, attention through SDPA (`[train] attention = \"sdpa\"`) | {m['mfu'] or float('nan'):.3f} "
                   f"({m['seconds_per_update']:.4f} s/update; {', '.join(m.get('sdpa_kernels', []))}) | |"]
    if "fused_tiles" in r:
        t = r["fused_tiles"]
        md += [f"| fused attention tiles, {t['rows']} x {t['length']} tokens, fwd+bwd ms by (fwd BLOCK_M, BLOCK_N, warps, "
               f"stages / bwd ...) | " + "; ".join(f"{k}: {v:.3f}" for k, v in t["fwd_bwd_ms"].items()) + " | |"]
    if "efficiency" in r:
        e = r["efficiency"]
        md += [f"| fast-offline / electra, seconds per update | {e['offline_vs_electra_time']:.3f} "
               f"({e['fast-offline_s_per_update']:.4f} / {e['electra_s_per_update']:.4f}; {e.get('timed_blocks', 1)} "
               f"alternating blocks) | <= 0.62 |",
               f"| fast-offline / electra, peak memory | {e['offline_vs_electra_memory']:.3f} "
               f"({e['fast-offline_peak_memory_gib']:.1f} / {e['electra_peak_memory_gib']:.1f} GiB) | <= 0.80 |"]
    if "generation" in r:
        g = r["generation"]
        md += [f"| generation / aux pure bf16 forward (tokens/s, same batches) | {g['gen_vs_forward']:.3f} "
               f"({g['generation_tokens_per_s']:.0f} / {g['forward_tokens_per_s']:.0f}) | >= 0.85 |",
               *([f"| the same, steady (the pipeline's fill left out: first shard done to last) | "
                  f"{g['gen_vs_forward_steady']:.3f} | |"] if "gen_vs_forward_steady" in g else []),
               f"| generation, one shard at a time (tokens/s) | {g['one_shard_at_a_time_tokens_per_s']:.0f} | |",
               f"| aux forward alone, model FLOPs / datasheet peak | {g.get('forward_vs_peak') or float('nan'):.3f} "
               f"({g['forward_tokens_per_s'] / 1e6:.2f}M tokens/s, {g['forward_flops_per_s'] / 1e12:.0f} TFLOP/s) | >= 0.35 |",
               f"| generation peak memory / the aux forward's own | {g['peak_memory_gib']:.1f} GiB / "
               f"{g['forward_peak_memory_gib']:.1f} GiB ({g['peak_vs_forward_peak']:.2f}) | <= 1.5 |" if
               "forward_peak_memory_gib" in g else f"| generation peak memory | {g['peak_memory_gib']:.1f} GiB | |",
               f"| attention backend of the aux forward (profiler) | {', '.join(g.get('aux_sdpa_kernels', [])) or '?'} | fused |"]
        if "no_mask_logits_equal" in g:
            md += [f"| aux logits bit for bit as before session 25: without a mask / head weight cast once | "
                   f"{g['no_mask_logits_equal']} / {g['head_weight_logits_equal']} | True / True |"]
    if "generation" in r and "phase_seconds_per_shard" in r["generation"]:
        g = r["generation"]
        md += [f"| generation, seconds per shard ({g['generation_seconds_per_shard']:.3f} with 2 in flight), by phase "
               f"(ShardWriter's `phase_seconds`, mean of a shard) | "
               + ", ".join(f"{k} {v:.3f}" for k, v in g["phase_seconds_per_shard"].items()) + " | |"]
    if "generation" in r and len(r["generation"].get("gen_vs_forward_by_depth", {})) > 1:
        md += [f"| generation / aux forward, {d} shards in flight | {x:.3f} | |"
               for d, x in r["generation"]["gen_vs_forward_by_depth"].items()]
    for key, how, same_run in (("generation_processes", "", "generation"),
                               ("generation_processes_mps", ", under CUDA MPS", "generation_mps")):
        if key not in r:
            continue  # a merged file (base-gpu.json) keeps the MPS run's own forward beside its processes
        forward = r.get(same_run, r.get("generation", {})).get("forward_tokens_per_s")
        md += [f"| generation, {n} processes sharing the GPU (actors){how}, 2 shards in flight each: tokens/s"
               + (" (/ aux forward)" if forward else "") + f" | {x['tokens_per_s']:.0f}"
               + (f" ({x['tokens_per_s'] / forward:.3f})" if forward else "")
               + (f"; steady {x['steady_tokens_per_s']:.0f}" if x.get("steady_tokens_per_s") else "")
               + (f" ({x['steady_tokens_per_s'] / forward:.3f})" if forward and x.get("steady_tokens_per_s") else "")
               + " | >= 0.85 |" for n, x in r[key].items()]
    if "draws" in r:
        d = r["draws"]
        md += [f"| one chunk's draw, {d['positions']} x {d['vocab']}: step by step / compiled by blocks (ms) | "
               f"{d['step_by_step_ms']:.2f} / {d['blocked_compiled_ms']:.2f}; same id {d['same_id_fraction']:.4f}, "
               f"top-1 counts equal {d['top1_hits_equal']} | |"]
    if "attention" in r:
        a = r["attention"]
        md += [f"| attention, one layer, {a['rows']} x {a['length']} tokens: {way} fwd+bwd / fwd (ms) | "
               + (f"{a[way + '_fwd_bwd_ms']:.2f} / {a[way + '_fwd_ms']:.2f}"
                  + (f"; max rel. diff {a[way + '_max_rel_diff']:.1e}" if way + "_max_rel_diff" in a else "")
                  + (f"; {', '.join(a[way + '_kernels'])}" if way + "_kernels" in a else "")
                  if way + "_fwd_bwd_ms" in a else f"failed: {a.get(way + '_error', '?')[:120]}") + " | |"
               for way in ATTENTION_WAYS if way + "_fwd_bwd_ms" in a or way + "_error" in a]
        md += [f"| fastest way computing the model's function | {a.get('fastest_same_function', '?')} | |"]
    md += [f"| {part} failed | {err} | |" for part, err in r.get("errors", {}).items()]
    if r.get("parts_from"):  # a file merged from several calls (base-gpu.json): where each part was measured
        md += ["", "Parts from several calls: " + "; ".join(f"{k}: {v}" for k, v in r["parts_from"].items()) + "."]
    return "\n".join(md)


if __name__ == "__main__":
    sys.exit(main())
