"""`make bench-train`: does reading the shards cost the trainer anything?

    python -m bench.train --manifest manifests/tiny.toml [--data DIR] [--steps 24]

Measured in one run, interleaved, on this machine (docs/design.md: "Trainer on shards vs the
same model's forward+backward on in-memory tensors (the limit)"):
  step_vs_inmemory median seconds per update reading the shards exactly as `train/trainer.py`
                   does (reader thread one step ahead, row groups checked and decoded, padding)
                   / the same update on one batch held in memory, both through the trainer's
                   own update function (`train.trainer.update`)                       target <= 1.03
  data_path        seconds the update waits for its rows (reader thread): the data path's own
                   cost, free of the step-to-step noise of the ratio above (padding is inside
                   the update function, as in the trainer)
  loader_vs_consumption  tokens/s of the shard reader alone (fresh stream, whole epoch)
                   / tokens/s the trainer consumes                                   target >= 20
  optimizer_step_ratio  the trainer's fused AdamW step / torch's per-tensor loop over the
                   same parameter groups (the step before `fused=True`)
Both modes use the same model, optimizer and batch size; blocks of steps alternate so
drift in machine speed hits both. Writes bench/results/train.json and train.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench import machine
from common.config import load_manifest
from common.io import atomic_write_json, atomic_write_text
from common.model import ReplacedTokenDetector
from common.optim import build_optimizer, build_scheduler, per_tensor_loop
import train.trainer as trainer
from train.data import load_data_manifest, replaced_rate, to_tensors, training_stream

RESULTS = Path("bench/results")


def make_step(model, optimizer, scheduler, device, tc):
    """One update through the trainer's own function (`train.trainer.update`: 1 rank, one micro-batch):
    RTD loss, backward, clip, AdamW, schedule. `step(rows, batch=None)`: `batch`, if given, is the rows
    already padded (the in-memory limit); else they are padded inside the update, as in the trainer."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(rows: dict, batch: dict | None = None) -> None:
        to_batch = to_tensors if batch is None else (lambda _: batch)
        trainer.update(model, model, optimizer, scheduler, [rows], to_batch, device, autocast, 1, tc)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return step


def measure(config, data_dir: Path, steps: int, block: int) -> dict:
    tc = config.train
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    manifest, _ = load_data_manifest(data_dir, config)
    torch.manual_seed(tc.seed)
    model = ReplacedTokenDetector(config.model, manifest["vocab_size"]).to(device)
    model.head.start_at_base_rate(replaced_rate(manifest))
    optimizer = build_optimizer(model, tc.lr, tc.betas, tc.eps, tc.weight_decay, tc.rel_bias_lr_scale, tc.embed_lr_scale)
    scheduler = build_scheduler(optimizer, tc.warmup_steps, 10 * steps)
    step = make_step(model, optimizer, scheduler, device, tc)
    b = tc.batch_size

    stream = training_stream(data_dir, manifest)  # fresh: every row group is checked when first read
    reader = ThreadPoolExecutor(max_workers=1)
    memory_rows = stream.rows(0, b)
    in_memory = to_tensors(memory_rows)            # the limit: one batch, already padded
    tokens_per_step = int(in_memory["attention_mask"].sum())
    stream = training_stream(data_dir, manifest)
    for _ in range(2):                             # warm-up (allocator, kernels), not timed
        step(memory_rows, in_memory)

    times = {"shards": [], "memory": [], "data_path": []}
    position = 0
    pending = reader.submit(stream.rows, 0, b)
    while len(times["shards"]) < steps:
        for _ in range(block):                     # the trainer's data path
            t0 = time.perf_counter()
            rows = pending.result()
            position += b
            pending = reader.submit(stream.rows, position, position + b)
            times["data_path"].append(time.perf_counter() - t0)  # what the update waits for
            step(rows)
            times["shards"].append(time.perf_counter() - t0)
        for _ in range(block):                     # the same update, no data path
            t0 = time.perf_counter()
            step(memory_rows, in_memory)
            times["memory"].append(time.perf_counter() - t0)
    pending.result()
    reader.shutdown()

    loader = training_stream(data_dir, manifest)   # the reader alone, one epoch, fresh stream
    rows_epoch = min(manifest["rows_per_epoch"], loader.num_rows) // b * b
    t0, loader_tokens = time.perf_counter(), 0
    for start in range(0, rows_epoch, b):
        loader_tokens += int(to_tensors(loader.rows(start, start + b))["attention_mask"].sum())
    loader_s = time.perf_counter() - t0

    fused, loop = optimizer_step_seconds(model, optimizer, steps, block, device)
    shard_step, memory_step = statistics.median(times["shards"]), statistics.median(times["memory"])
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "steps_per_mode": len(times["shards"]), "block": block, "batch_rows": b, "tokens_per_step": tokens_per_step,
        "step_s_shards_median": shard_step, "step_s_memory_median": memory_step,
        "step_s_shards_mean": statistics.fmean(times["shards"]), "step_s_memory_mean": statistics.fmean(times["memory"]),
        "step_vs_inmemory": shard_step / memory_step,
        "data_path_s_mean": statistics.fmean(times["data_path"]), "data_path_s_max": max(times["data_path"]),
        "data_path_fraction": statistics.fmean(times["data_path"]) / statistics.fmean(times["shards"]),
        "trainer_tokens_per_s": tokens_per_step / shard_step,
        "loader_tokens_per_s": loader_tokens / loader_s, "loader_epoch_rows": rows_epoch, "loader_s": loader_s,
        "loader_vs_consumption": (loader_tokens / loader_s) / (tokens_per_step / shard_step),
        "torch_threads": torch.get_num_threads(),
        "optimizer_step_s_fused_median": fused, "optimizer_step_s_loop_median": loop,
        "optimizer_step_ratio": fused / loop, "optimizer_step_fraction": fused / shard_step,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def optimizer_step_seconds(model, optimizer, steps: int, block: int, device) -> tuple[float, float]:
    """Median seconds of one AdamW step: the trainer's (`build_optimizer`, fused) and the same groups
    with torch's per-tensor loop (fused=False, foreach=False), in alternating blocks on gradients of the
    model's own shapes. Each keeps its own moments; both move the same weights, which timing ignores."""
    loop = per_tensor_loop(optimizer)
    generator = torch.Generator(device=device).manual_seed(0)
    times = {"fused": [], "loop": []}
    for p in model.parameters():
        p.grad = 1e-3 * torch.randn(p.shape, device=device, generator=generator)
    for opt in (optimizer, loop):  # warm-up: moment buffers allocated
        opt.step()
    while len(times["fused"]) < steps:
        for name, opt in (("fused", optimizer), ("loop", loop)):
            for _ in range(block):
                t0 = time.perf_counter()
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[name].append(time.perf_counter() - t0)
    optimizer.zero_grad(set_to_none=True)
    return statistics.median(times["fused"]), statistics.median(times["loop"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.train")
    parser.add_argument("--manifest", default="manifests/tiny.toml")
    parser.add_argument("--data", default=None, help="generated shards (default: WORK_DIR/epochs)")
    parser.add_argument("--steps", type=int, default=64, help="timed updates per mode")
    parser.add_argument("--block", type=int, default=4, help="updates per block before switching mode")
    parser.add_argument("--out", default=str(RESULTS), help="results folder")
    args = parser.parse_args(argv)
    config = load_manifest(args.manifest)
    data_dir = Path(args.data) if args.data else config.epochs_dir
    result = {**measure(config, data_dir, args.steps, args.block), "manifest": args.manifest,
              "machine": machine(), "cpu_count": os.cpu_count(),
              "torch": torch.__version__}
    out = Path(args.out)
    stem = "train" if result["device"] == "cpu" else "train-gpu"
    atomic_write_json(out / f"{stem}.json", result)
    md = [f"# bench-train ({result['device']})", "",
          f"`python -m bench.train --manifest {args.manifest} --steps {args.steps}` on {result['machine']}, "
          f"{result['cpu_count']} cores, torch {result['torch']}, device {result['device']}; "
          f"{result['batch_rows']} rows x {result['tokens_per_step']} tokens per update, "
          f"{result['steps_per_mode']} updates per mode in blocks of {result['block']}.", "",
          "| figure | value | target |", "|---|---|---|",
          f"| update on shards / on an in-memory batch (median s) | {result['step_vs_inmemory']:.3f} "
          f"({result['step_s_shards_median']:.4f} / {result['step_s_memory_median']:.4f}) | <= 1.03 |",
          f"| data path on the update's critical path (wait for rows; padding is in the update), mean / max | "
          f"{result['data_path_s_mean'] * 1e3:.2f} / {result['data_path_s_max'] * 1e3:.2f} ms "
          f"({100 * result['data_path_fraction']:.2f}% of an update) | (the cause of any excess over 1) |",
          f"| shard reader tokens/s / trainer tokens/s | {result['loader_vs_consumption']:.0f} "
          f"({result['loader_tokens_per_s']:.0f} / {result['trainer_tokens_per_s']:.0f}) | >= 20 |",
          f"| AdamW step over the {result['parameters'] / 1e6:.1f}M parameters: fused (the trainer's) / "
          f"per-tensor loop (median s) | {result['optimizer_step_ratio']:.3f} "
          f"({result['optimizer_step_s_fused_median']:.4f} / {result['optimizer_step_s_loop_median']:.4f}; "
          f"{100 * result['optimizer_step_fraction']:.1f}% of an update) | |"]
    atomic_write_text(out / f"{stem}.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
