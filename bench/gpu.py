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
                    model runs it): SDPA with an additive bias (common/model.py) vs FlexAttention (bias as a
                    score modification, padding as a block mask, compiled); outputs compared
Writes bench/results/base-gpu.json and .md (the device's name inside). Needs CUDA (the measures take a
device: tests/test_bench.py runs them on the CPU at a tiny shape).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
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

from bench.flops import Encoder, encoder_forward_flops, output_layer_flops
from common.checkpoint import save_aux
from common.config import GenerateConfig, load_manifest
from common.corrupt import Corruptor
from common.curriculum import masked_count
from common.io import atomic_write_json, atomic_write_text
from common.model import MaskedLM, ReplacedTokenDetector, relative_position_bucket
from common.optim import build_optimizer, build_scheduler
from common.plan import plan_tasks
from common.tokenizer import SPECIAL_IDS
from generate.worker import ShardWriter

RESULTS = Path("bench/results")
# Dense bf16 tensor-core peak, FLOP/s, from NVIDIA's datasheets (SXM parts; no sparsity).
BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L40S": 362e12}


def bf16_peak(name: str) -> float | None:
    return next((v for k, v in BF16_PEAK.items() if k in name), None)


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
    """The peak from here on, what an earlier measure left (reference cycles included) freed first."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


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
    forward_model = compiled_model or model

    def update():
        trainer.update(forward_model, model, optimizer, scheduler, [rows] * accum, to_batch, device, autocast, 1, tc,
                       count_masked)

    def forward_backward():
        trainer.accumulate(forward_model, [rows], to_batch, device, autocast, 1, tc.objective, tc.electra_lambda,
                           count_masked)
    return update, forward_backward


def sdpa_kernels(fn) -> list[str]:
    """The fused-attention backends `fn` runs, as the profiler names them (aten::_scaled_dot_product_*: flash,
    efficient, cudnn, math, flash_attention_for_cpu), sorted. The CPU's op events carry the names on any device."""
    from torch.profiler import ProfilerActivity
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")})


def synthetic_batch(rows: int, length: int, vocab: int, seed: int = 0) -> dict:
    """Full-length rows as the trainer reads them from shards (RTD labels at the mask rate) and as electra
    reads them from the corpus (row ids, epoch)."""
    rng = np.random.default_rng(seed + 1)
    return {"input_ids": synthetic_rows(rows, length, vocab, seed),
            "labels": [(rng.random(length) < 0.15).astype(np.int8) for _ in range(rows)],
            "row_id": np.arange(rows), "epoch": 0}


def measure_mfu(config, rows: int, accum: int, steps: int, profile: bool = False, compiled: bool = False,
                device: torch.device = torch.device("cuda")) -> dict:
    """`compiled`: the same update with the model under torch.compile (`[train] compile`, as the trainer does)."""
    tc, V, L = config.train, config.tokenizer.vocab_size, config.corpus.max_seq_len
    torch.manual_seed(0)
    model = ReplacedTokenDetector(config.model, V).to(device)
    optimizer = build_optimizer(model, tc.lr, tc.betas, tc.eps, tc.weight_decay, tc.rel_bias_lr_scale, tc.embed_lr_scale)
    scheduler = build_scheduler(optimizer, 10, 10_000)
    update, forward_backward = trainer_update(model, optimizer, scheduler, synthetic_batch(rows, L, V), accum, config,
                                              device, compiled_model=torch.compile(model) if compiled else None)

    device_seconds(update, 2, device)
    reset_peak_memory(device)
    seconds = statistics.median(device_seconds(update, steps, device))
    micro = statistics.median(device_seconds(forward_backward, steps, device))
    if profile:  # where an update's GPU time goes, by kernel
        from torch.profiler import ProfilerActivity
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            device_seconds(update, 2, device)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60), flush=True)
    flops = update_flops(config, rows * accum)
    kernels = sdpa_kernels(forward_backward)  # the attention of the trainer's own forward and backward
    optimizer.zero_grad(set_to_none=True)
    return {"sdpa_kernels": kernels, "rows_per_micro_batch": rows, "micro_batches": accum, "tokens_per_update": rows * accum * L,
            "seconds_per_update": seconds, "seconds_per_micro_batch_fwd_bwd": micro,
            "model_flops_per_update": flops, "achieved_flops_per_s": flops / seconds,
            "fwd_bwd_flops_per_s": update_flops(config, rows) / micro,
            "peak_memory_gib": peak_memory_gib(device),
            "parameters": sum(p.numel() for p in model.parameters())}


def measure_efficiency(config, rows: int, accum: int, steps: int, device: torch.device = torch.device("cuda")) -> dict:
    """fast-offline vs electra at the manifest's shape: seconds per update and peak memory (paper section 4.3),
    both through the trainer's update on the same rows."""
    from train.objectives import ElectraPair
    tc, V, L = config.train, config.tokenizer.vocab_size, config.corpus.max_seq_len
    batch = synthetic_batch(rows, L, V, seed=2)

    def measure(name: str) -> tuple[float, float]:
        # a function of its own: its model, optimizer and closures are gone when the next one's peak is reset
        # (kept alive by the scheduler and the closures, fast-offline's weights and moments counted in electra's)
        reset_peak_memory(device)
        torch.manual_seed(0)
        model = (ElectraPair(config.model, V) if name == "electra" else ReplacedTokenDetector(config.model, V)).to(device)
        optimizer = build_optimizer(model, tc.lr, tc.betas, tc.eps, tc.weight_decay, tc.rel_bias_lr_scale,
                                    tc.embed_lr_scale)
        update, _ = trainer_update(model, optimizer, build_scheduler(optimizer, 10, 10_000), batch, accum, config,
                                   device, name)
        device_seconds(update, 2, device)
        return statistics.median(device_seconds(update, steps, device)), peak_memory_gib(device)

    out = {}
    for name in ("fast-offline", "electra"):
        out[f"{name}_s_per_update"], out[f"{name}_peak_memory_gib"] = measure(name)
    out["offline_vs_electra_time"] = out["fast-offline_s_per_update"] / out["electra_s_per_update"]
    out["offline_vs_electra_memory"] = out["fast-offline_peak_memory_gib"] / out["electra_peak_memory_gib"]
    out["rows_per_micro_batch"], out["micro_batches"] = rows, accum
    return out


def measure_generation(config, rows_per_shard: int, shards: int, device: torch.device = torch.device("cuda")) -> dict:
    """Tokens/s of ShardWriter with two shards in flight (generate/job.py's GPU actor) over the aux
    model's pure forward on the same masked batches."""
    g, V, L = config.generate, config.tokenizer.vocab_size, config.corpus.max_seq_len
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        torch.manual_seed(config.seed)
        aux = MaskedLM(config.model, V, config.aux.num_layers)
        aux_path = save_aux(aux, config.model, config.aux.num_layers, V, "synthetic", tmp, {"steps": 0})
        corruptor = Corruptor(aux_path, config.seed, g.mask_prob, g.batch_tokens, device=str(device))
        rows = synthetic_rows(rows_per_shard * (shards + 1), L, V, seed=1)
        plan = GenerateConfig(epochs=1, rows_per_shard=rows_per_shard, valid_rows=0)
        tasks = plan_tasks(len(rows), 0, plan, config.seed)  # one epoch of the synthetic rows, T from 2 down
        writer = ShardWriter({"train": rows}, corruptor, tmp, g.zstd_level)
        reset_peak_memory(device)
        writer(tasks[-1])  # warm-up (kernels, allocator), not timed
        lock = threading.Lock()
        with ThreadPoolExecutor(max_workers=2) as pool:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            records = list(pool.map(lambda t: writer(t, lock), tasks[:-1]))
            generation_s = time.perf_counter() - t0
        peak = peak_memory_gib(device)
        tokens, masked = sum(r["tokens"] for r in records), sum(r["masked"] for r in records)
        prepared = [corruptor.prepare([rows[i] for i in t.row_ids], t.row_ids, 0)[2] for t in tasks[:-1]]

        @torch.no_grad()
        def forward_only():
            for batches in prepared:
                for _, ids, attn, flags in batches:
                    corruptor.aux_logits(ids, attn, flags)
        forward_s = min(device_seconds(forward_only, 3, device))
        kernels = sdpa_kernels(torch.no_grad()(lambda: corruptor.aux_logits(*prepared[0][0][1:])))
        single_s = min(device_seconds(lambda: writer(tasks[0]), 2, device))
    return {"rows_per_shard": rows_per_shard, "shards": shards, "tokens": tokens, "batch_tokens": g.batch_tokens,
            "generation_tokens_per_s": tokens / generation_s, "forward_tokens_per_s": tokens / forward_s,
            "one_shard_at_a_time_tokens_per_s": rows_per_shard * L / single_s,
            "gen_vs_forward": forward_s / generation_s, "peak_memory_gib": peak, "aux_sdpa_kernels": kernels,
            "forward_flops_per_s": aux_forward_flops(config, tokens // L, masked) / forward_s}


def measure_attention(config, rows: int, repeats: int = 20) -> dict:
    """One layer's attention at the base shape: SDPA + additive bias vs compiled FlexAttention."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    m, L = config.model, config.corpus.max_seq_len
    h, d = m.num_heads, m.hidden_size // m.num_heads
    torch.manual_seed(0)
    q, k, v = (torch.randn(rows, h, L, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    table = (0.5 * torch.randn(m.rel_buckets, h, device="cuda")).requires_grad_()
    pos = torch.arange(L, device="cuda")
    buckets = relative_position_bucket(pos[None, :] - pos[:, None], m.rel_buckets, m.rel_max_distance)
    lengths = torch.randint(L // 2, L + 1, (rows,), device="cuda")
    lengths[0] = L

    def sdpa():
        pad = torch.zeros(rows, L, device="cuda").masked_fill(pos[None, :] >= lengths[:, None], float("-inf"))
        bias = (table[buckets].permute(2, 0, 1)[None] + pad[:, None, None, :]).to(torch.bfloat16)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def score_mod(score, b, head, q_idx, kv_idx):
        return score + table[buckets[q_idx, kv_idx], head]

    def keep(b, head, q_idx, kv_idx):
        return kv_idx < lengths[b]

    compiled = torch.compile(flex_attention, dynamic=False)

    def flex():
        block_mask = create_block_mask(keep, rows, None, L, L, device="cuda")
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)

    out = {}
    valid = pos[None, :] < lengths[:, None]  # padded query rows are never read
    a, b = sdpa(), flex()
    out["max_abs_diff_valid_rows"] = float((a.float() - b.float()).abs()[valid[:, None, :, None].expand_as(a)].max())
    grads = []
    for fn in (sdpa, flex):
        for t in (q, k, v, table):
            t.grad = None
        (fn().float()[valid[:, None, :, None].expand(-1, h, -1, d)] ** 2).sum().backward()
        grads.append([t.grad.float().clone() for t in (q, k, v, table)])
    out["max_rel_grad_diff"] = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(*grads))
    g = torch.randn(rows, h, L, d, device="cuda", dtype=torch.bfloat16)
    for name, fn in (("sdpa", sdpa), ("flex", flex)):
        def fwd_bwd():
            fn().backward(g)
        device_seconds(fwd_bwd, 3)
        out[f"{name}_fwd_bwd_s"] = statistics.median(device_seconds(fwd_bwd, repeats))
        with torch.no_grad():
            out[f"{name}_fwd_s"] = statistics.median(device_seconds(fn, repeats))
    out["flex_vs_sdpa_fwd_bwd"] = out["flex_fwd_bwd_s"] / out["sdpa_fwd_bwd_s"]
    out["flex_vs_sdpa_fwd"] = out["flex_fwd_s"] / out["sdpa_fwd_s"]
    out["rows"] = rows
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu")
    parser.add_argument("--manifest", default="manifests/base.toml")
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per update")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--gen-rows", type=int, default=2048, help="rows per generated shard")
    parser.add_argument("--gen-shards", type=int, default=6)
    parser.add_argument("--only", default="mfu,efficiency,generation,attention")
    parser.add_argument("--profile", action="store_true", help="print the update's GPU time by kernel")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    config = load_manifest(args.manifest)
    name = torch.cuda.get_device_name()
    result = {"device": name, "torch": torch.__version__, "manifest": args.manifest, "cpu_count": os.cpu_count(),
              "machine": platform.machine(), "bf16_peak_flops": bf16_peak(name), "matmul_bf16_flops_per_s": matmul_flops_per_s()}
    measures = {"mfu": lambda: measure_mfu(config, args.rows, args.accum, args.steps, args.profile),
                "mfu_compiled": lambda: measure_mfu(config, args.rows, args.accum, args.steps, compiled=True),
                "efficiency": lambda: measure_efficiency(config, args.rows, args.accum, args.steps),
                "generation": lambda: measure_generation(config, args.gen_rows, args.gen_shards),
                "attention": lambda: measure_attention(config, args.rows)}
    errors = {}
    for part in args.only.split(","):
        try:  # one part failing (out of memory, a kernel missing) still leaves the others' figures
            result[part] = measures[part]()
        except Exception as e:  # noqa: BLE001 -- reported in the results, and the exit code says so
            errors[part] = f"{type(e).__name__}: {e}"[:2000]
            # the whole traceback where it can be read: a GPU is lent rarely, a rerun to see it costs its time
            print(f"bench.gpu: {part} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
            continue
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
    if "efficiency" in r:
        e = r["efficiency"]
        md += [f"| fast-offline / electra, seconds per update | {e['offline_vs_electra_time']:.3f} "
               f"({e['fast-offline_s_per_update']:.4f} / {e['electra_s_per_update']:.4f}) | <= 0.65 |",
               f"| fast-offline / electra, peak memory | {e['offline_vs_electra_memory']:.3f} "
               f"({e['fast-offline_peak_memory_gib']:.1f} / {e['electra_peak_memory_gib']:.1f} GiB) | <= 0.80 |"]
    if "generation" in r:
        g = r["generation"]
        md += [f"| generation / aux pure bf16 forward (tokens/s, same batches) | {g['gen_vs_forward']:.3f} "
               f"({g['generation_tokens_per_s']:.0f} / {g['forward_tokens_per_s']:.0f}) | >= 0.85 |",
               f"| generation, one shard at a time (tokens/s) | {g['one_shard_at_a_time_tokens_per_s']:.0f} | |",
               f"| aux forward alone, model FLOPs / datasheet peak | {g.get('forward_vs_peak') or float('nan'):.3f} "
               f"({g['forward_tokens_per_s'] / 1e6:.2f}M tokens/s, {g['forward_flops_per_s'] / 1e12:.0f} TFLOP/s) | >= 0.35 |",
               f"| generation peak memory | {g['peak_memory_gib']:.1f} GiB | |",
               f"| attention backend of the aux forward (profiler) | {', '.join(g.get('aux_sdpa_kernels', [])) or '?'} | fused |"]
    if "attention" in r:
        a = r["attention"]
        md += [f"| FlexAttention / SDPA + additive bias, fwd+bwd (s) | {a['flex_vs_sdpa_fwd_bwd']:.3f} "
               f"({a['flex_fwd_bwd_s'] * 1e3:.2f} / {a['sdpa_fwd_bwd_s'] * 1e3:.2f} ms) | < 1: keep flex |",
               f"| FlexAttention / SDPA, forward only | {a['flex_vs_sdpa_fwd']:.3f} "
               f"({a['flex_fwd_s'] * 1e3:.2f} / {a['sdpa_fwd_s'] * 1e3:.2f} ms) | |",
               f"| max abs difference of outputs (valid rows) / max relative gradient difference | "
               f"{a['max_abs_diff_valid_rows']:.2e} / {a['max_rel_grad_diff']:.2e} | bf16 tolerance |"]
    md += [f"| {part} failed | {err} | |" for part, err in r.get("errors", {}).items()]
    return "\n".join(md)


if __name__ == "__main__":
    sys.exit(main())
