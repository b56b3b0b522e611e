"""`make bench-generate`: how close generation runs to the aux model's own speed, and what it costs.

    python -m bench.generate --manifest manifests/tiny.toml

Measured in one run, on this machine, as ratios (docs/design.md, "Performance is measured as ratios"):
  gen_vs_forward          generation tokens/s (mask, aux forward, sample, label, write Parquet)
                          / the same aux model's pure forward tokens/s on the same batches, same device
  speedup_2_workers       Ray generation tokens/s with 2 actors / with 1 actor
  bytes_per_token         shard bytes per token per epoch (labels included), tiny epochs
  entropy_bytes_per_token unigram entropy of the training corpus, in bytes per token
  peak_rss_4x_vs_1x       peak RSS of a generation process on a 4x corpus / on the 1x corpus
Writes bench/results/generate.json and generate.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common.checkpoint import AUX_FILE
from common.config import load_manifest
from common.corpus import SplitRows, load_corpus_meta, load_split
from common.io import atomic_write_json, atomic_write_text
from common.plan import plan_tasks
from common.corrupt import Corruptor
from generate.worker import ShardWriter

RESULTS = Path("bench/results")


def forward_vs_generation(config, corpus_dir: Path, aux_path: Path, num_rows: int, repeats: int = 3) -> dict:
    """Best-of-`repeats` seconds for the full shard path and for the aux forward alone, same batches."""
    torch.set_num_threads(config.generate.threads_per_worker)
    g = config.generate
    corruptor = Corruptor(aux_path, config.seed, g.mask_prob, g.batch_tokens)
    rows = {"train": load_split(corpus_dir, "train")[:num_rows], "valid": []}
    task = plan_tasks(num_rows, 0, g.__class__(epochs=1, rows_per_shard=num_rows, valid_rows=0), config.seed)[-1]
    tokens = int(sum(len(r) for r in rows["train"]))
    with tempfile.TemporaryDirectory() as tmp:
        writer = ShardWriter(rows, corruptor, tmp, g.zstd_level)
        gen = min(_timed(lambda: writer(task)) for _ in range(repeats))
    _, _, batches = corruptor.masked_batches(rows["train"], task.row_ids, 0)

    @torch.no_grad()
    def forward_only():
        for _, ids, attn, flags in batches:
            corruptor.aux_logits(ids, attn, flags)
    fwd = min(_timed(forward_only) for _ in range(repeats))
    return {"tokens": tokens, "generation_s": gen, "forward_s": fwd,
            "generation_tokens_per_s": tokens / gen, "forward_tokens_per_s": tokens / fwd}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker_scaling(config, corpus_dir: Path, aux_path: Path, rows_per_epoch: int) -> dict:
    """Tokens/s of the Ray job with 1 and 2 actors on the same plan (Ray started once, before timing)."""
    from generate.job import run_tasks, start_ray
    import ray
    meta = load_corpus_meta(corpus_dir)
    g = config.generate.__class__(**{**config.generate.__dict__, "epochs": 1, "rows_per_epoch": rows_per_epoch,
                                     "valid_rows": 0})
    tasks = plan_tasks(meta["train"]["rows"], 0, g, config.seed)
    out = {}
    start_ray(None, 2)
    args = {"aux_path": str(aux_path.resolve()), "corpus_dir": str(corpus_dir.resolve()), "seed": config.seed,
            "mask_prob": g.mask_prob, "batch_tokens": g.batch_tokens, "threads": g.threads_per_worker,
            "zstd_level": g.zstd_level}
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            records = run_tasks(tasks, workers, {**args, "out_dir": tmp}, Path(tmp))
            seconds = time.perf_counter() - t0
        tokens = sum(r["tokens"] for r in records)
        out[f"workers_{workers}_tokens_per_s"] = tokens / seconds
        out[f"workers_{workers}_seconds"] = seconds
    ray.shutdown()
    out["tokens"] = tokens
    return out


def unigram_entropy_bytes(corpus_dir: Path, vocab_size: int) -> float:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for row in load_split(corpus_dir, "train"):
        counts += np.bincount(row, minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum() / 8)


def replicate_corpus(corpus_dir: Path, out_dir: Path, times: int) -> Path:
    """A corpus folder whose training split is `times` copies of the original (same tokenizer): every
    training part's memory-mapped token and offset files copied `times` times under new names."""
    shutil.copytree(corpus_dir, out_dir)
    meta = json.loads((out_dir / "corpus.json").read_text())
    parts, rows = [], meta["train"]["rows"]
    for k in range(times):
        for part in meta["train"]["parts"]:
            flat = {}
            for kind, record in part["flat"].items():
                path = Path(record["path"])
                copy = path.with_name(f"copy{k}-{path.name}")
                shutil.copyfile(corpus_dir / path, out_dir / copy)
                flat[kind] = {**record, "path": str(copy)}
            parts.append({**part, "flat": flat, "row_start": part["row_start"] + k * rows})
    meta["train"] = {**meta["train"], "parts": parts, "rows": rows * times, "tokens": meta["train"]["tokens"] * times}
    (out_dir / "corpus.json").write_text(json.dumps(meta))
    return out_dir


def memory_probe(manifest: str, corpus_dir: str, aux_path: str, shards: int) -> None:
    """Run in a fresh process: what one actor does (map corpus, load aux, write `shards` shards); print peak RSS."""
    config = load_manifest(manifest)
    torch.set_num_threads(config.generate.threads_per_worker)
    rows = {split: SplitRows(corpus_dir, split) for split in ("train", "valid")}
    corruptor = Corruptor(aux_path, config.seed, config.generate.mask_prob, config.generate.batch_tokens)
    meta = load_corpus_meta(corpus_dir)
    tasks = [t for t in plan_tasks(meta["train"]["rows"], meta["valid"]["rows"], config.generate, config.seed)
             if t.split == "train"][:shards]
    with tempfile.TemporaryDirectory() as tmp:
        writer = ShardWriter(rows, corruptor, tmp, config.generate.zstd_level)
        for task in tasks:
            writer(task)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def peak_rss(manifest: str, corpus_dir: Path, aux_path: Path, shards: int) -> float:
    cmd = [sys.executable, "-m", "bench.generate", "--manifest", manifest, "--memory-probe", str(corpus_dir),
           "--aux", str(aux_path), "--shards", str(shards)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rss_mb"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.generate")
    parser.add_argument("--manifest", default="manifests/tiny.toml")
    parser.add_argument("--data", default=None, help="generated epochs to measure bytes/token on")
    parser.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--aux", default=None)
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args(argv)
    config = load_manifest(args.manifest)
    aux_path = Path(args.aux) if args.aux else config.aux_dir / AUX_FILE
    if args.memory_probe:
        memory_probe(args.manifest, args.memory_probe, str(aux_path), args.shards)
        return 0
    corpus_dir = config.corpus_dir
    data_dir = Path(args.data) if args.data else config.epochs_dir
    manifest = json.loads((data_dir / "manifest.json").read_text())

    speed = forward_vs_generation(config, corpus_dir, aux_path, num_rows=1024)
    scaling = worker_scaling(config, corpus_dir, aux_path, rows_per_epoch=4096)
    with tempfile.TemporaryDirectory() as tmp:
        big = replicate_corpus(corpus_dir, Path(tmp) / "corpus4x", 4)
        rss_1x = peak_rss(args.manifest, corpus_dir, aux_path, args.shards)
        rss_4x = peak_rss(args.manifest, big, aux_path, args.shards)
    epochs = manifest["epochs"]
    result = {
        "gen_vs_forward": speed["generation_tokens_per_s"] / speed["forward_tokens_per_s"],
        "speedup_2_workers": scaling["workers_2_tokens_per_s"] / scaling["workers_1_tokens_per_s"],
        "bytes_per_token": sum(e["bytes"] for e in epochs) / sum(e["tokens"] for e in epochs),
        "entropy_bytes_per_token": unigram_entropy_bytes(corpus_dir, manifest["vocab_size"]),
        "peak_rss_4x_vs_1x": rss_4x / rss_1x,
        "peak_rss_1x_mb": rss_1x, "peak_rss_4x_mb": rss_4x,
        **{f"single_worker_{k}": v for k, v in speed.items()},
        **{f"ray_{k}": v for k, v in scaling.items()},
        "device": "cpu", "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "manifest": args.manifest,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_json(RESULTS / "generate.json", result)
    md = ["# bench-generate", "", f"`python -m bench.generate --manifest {args.manifest}` on {result['machine']}, "
          f"{result['cpu_count']} cores, torch {result['torch']}, device cpu (no GPU run).", "",
          "| figure | value | target |", "|---|---|---|",
          f"| generation / aux pure forward (tokens/s, 1 worker, same batches) | {result['gen_vs_forward']:.3f} "
          f"({speed['generation_tokens_per_s']:.0f} / {speed['forward_tokens_per_s']:.0f}) | >= 0.85 |",
          f"| 2 workers / 1 worker (Ray, tokens/s) | {result['speedup_2_workers']:.2f} "
          f"({scaling['workers_2_tokens_per_s']:.0f} / {scaling['workers_1_tokens_per_s']:.0f}) | >= 1.6 |",
          f"| shard bytes per token per epoch | {result['bytes_per_token']:.3f} | <= 1.5 |",
          f"| corpus unigram entropy, bytes per token | {result['entropy_bytes_per_token']:.3f} | (reference) |",
          f"| peak RSS 4x corpus / 1x | {result['peak_rss_4x_vs_1x']:.3f} ({rss_4x:.0f} / {rss_1x:.0f} MB) | <= 1.2 |"]
    atomic_write_text(RESULTS / "generate.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
