"""`make bench-generate`: how close generation runs to the aux model's own speed, and what it costs.

    python -m bench.generate --manifest manifests/tiny.toml

Measured in one run, on this machine, as ratios (docs/design.md, "Performance is measured as ratios"):
  gen_vs_forward          generation tokens/s (mask, aux forward, sample, label, write Parquet)
                          / the same aux model's pure forward tokens/s on the same batches, same device
  speedup_2_workers       Ray generation tokens/s with 2 actors / with 1 actor
  bytes_per_token         shard bytes per token per epoch (labels included), tiny epochs
  entropy_bytes_per_token unigram entropy of the training corpus, in bytes per token
  peak_rss_16x_vs_1x      a generation process's peak RSS over its RSS with the aux model loaded (the corpus not
                          yet open), on the corpus 16 times over / once; beside it the same with every row read
                          into memory first (the control, which must fail the target)
  sampling_peak_4x_vs_1x  peak RSS of the aux forward and sampling over a batch with 4x the masked positions
                          / 1x (16 rows of 512 tokens masked at 60% / 15%), at a 128,000-entry vocabulary
                          (the base aux width, 1 layer, random weights), each in a fresh process
  host_tokens_per_s       the actor's host side on 512-token rows (reading rows, masking, inputs, labels,
                          Parquet encoding and writing): shard tokens / (shard seconds - aux forward and sampling)
  zstd table              shard bytes per token and host tokens/s at each zstd level, in generate.md
Writes bench/results/generate.json and generate.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench import machine
from common.checkpoint import AUX_FILE
from common.config import load_manifest
from common.corpus import SplitRows, load_corpus_meta, load_split
from common.io import atomic_write_json, atomic_write_text
from common.plan import plan_tasks
from common.corrupt import Corruptor
from common.shards import PLAN_FILE
from generate.worker import ShardWriter, mean_phases

RESULTS = Path("bench/results")


def forward_vs_generation(config, corpus_dir: Path, aux_path: Path, num_rows: int, repeats: int = 5) -> dict:
    """Best-of-`repeats` seconds for the full shard path and for the aux forward alone, same batches, taken in
    turns: on CPU either one's speed depends on the state the other left glibc's heap in (which blocks it kept,
    where its mmap threshold stands), so one after the other each would be timed in a state of its own."""
    torch.set_num_threads(config.generate.threads_per_worker)
    g = config.generate
    corruptor = Corruptor(aux_path, config.seed, g.mask_prob, g.batch_tokens)
    rows = {"train": load_split(corpus_dir, "train")[:num_rows], "valid": []}
    task = plan_tasks(num_rows, 0, g.__class__(epochs=1, rows_per_shard=num_rows, valid_rows=0), config.seed)[-1]
    tokens = int(sum(len(r) for r in rows["train"]))
    _, _, batches = corruptor.masked_batches(rows["train"], task.row_ids, 0)

    @torch.no_grad()
    def forward_only():
        for _, ids, attn, flags in batches:
            corruptor.aux_logits(ids, attn, flags)
    gen, fwd = [], []
    with tempfile.TemporaryDirectory() as tmp:
        writer = ShardWriter(rows, corruptor, tmp, g.zstd_level)
        for _ in range(repeats):
            gen.append(_timed(lambda: writer(task)))
            fwd.append(_timed(forward_only))
    return {"tokens": tokens, "generation_s": min(gen), "forward_s": min(fwd),
            "generation_tokens_per_s": tokens / min(gen), "forward_tokens_per_s": tokens / min(fwd)}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker_scaling(config, corpus_dir: Path, aux_path: Path, rows_per_epoch: int) -> dict:
    """Tokens/s of the Ray job with 1 and 2 actors on the same plan (Ray started once, before timing), from the
    first shard started to the last done; the wall time with the actors' start-up beside it."""
    from generate.job import run_tasks, start_ray
    import ray
    meta = load_corpus_meta(corpus_dir)
    g = config.generate.__class__(**{**config.generate.__dict__, "epochs": 1, "rows_per_epoch": rows_per_epoch,
                                     "valid_rows": 0})
    tasks = plan_tasks(meta["train"]["rows"], 0, g, config.seed)
    out = {}
    start_ray(None, 2)
    args = {"aux_path": str(aux_path.resolve()), "corpus_dir": str(corpus_dir.resolve()), "seed": config.seed,
            "generate": g}
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / PLAN_FILE).write_text("{}\n")  # what each actor looks for to know it sees the folder
            t0 = time.perf_counter()
            records = run_tasks(tasks, workers, {**args, "out_dir": tmp}, Path(tmp), seq_len=meta["max_seq_len"])
            wall = time.perf_counter() - t0
        # from the first shard started to the last done: the actors' start-up (a process each, torch, the aux
        # model, the memory check: ~2 s) left out of both sides, as a long job amortises it
        seconds = max(r["finished_at"] for r in records) - min(r["started_at"] for r in records)
        tokens = sum(r["tokens"] for r in records)
        out[f"workers_{workers}_tokens_per_s"] = tokens / seconds
        out[f"workers_{workers}_seconds"] = seconds
        out[f"workers_{workers}_wall_seconds"] = wall
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
    training part's token and offset files copied `times` times under new names."""
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


def memory_probe(manifest: str, corpus_dir: str, aux_path: str, shards: int, whole: bool = False) -> None:
    """Run in a fresh process: what one actor does (load aux, open the corpus, write `shards` shards); print the
    peak RSS and its rise over the actor with its aux model loaded, before the corpus is opened (the peak is
    reset there, Linux VmHWM): the whole-process peak sits on ~520 MB of torch and the model, beside which the
    tiny corpus four times over (25 MB) would hardly show. `whole`: every row read into memory first, as
    before `SplitRows` (the control, which must fail the target)."""
    config = load_manifest(manifest)
    torch.set_num_threads(config.generate.threads_per_worker)
    corruptor = Corruptor(aux_path, config.seed, config.generate.mask_prob, config.generate.batch_tokens)
    loaded = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    rows = {split: (load_split if whole else SplitRows)(corpus_dir, split) for split in ("train", "valid")}
    meta = load_corpus_meta(corpus_dir)
    tasks = [t for t in plan_tasks(meta["train"]["rows"], meta["valid"]["rows"], config.generate, config.seed)
             if t.split == "train"][:shards]
    with tempfile.TemporaryDirectory() as tmp:
        writer = ShardWriter(rows, corruptor, tmp, config.generate.zstd_level)
        for task in tasks:
            writer(task)
    peak = _status_kb("VmHWM")
    print(json.dumps({"peak_rss_mb": peak / 1024, "loaded_rss_mb": loaded / 1024, "rise_mb": (peak - loaded) / 1024}))


def peak_rss(manifest: str, corpus_dir: Path, aux_path: Path, shards: int, whole: bool = False) -> dict:
    cmd = [sys.executable, "-m", "bench.generate", "--manifest", manifest, "--memory-probe", str(corpus_dir),
           "--aux", str(aux_path), "--shards", str(shards), *(["--whole"] if whole else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


SAMPLING_VOCAB, SAMPLING_ROWS, ROW_TOKENS, SAMPLING_MASK = 128_000, 16, 512, 0.15


def sampling_probe(aux_path: str, rows: int, mask_prob: float, chunk_entries: int) -> None:
    """Run in a fresh process: prepare one batch of `rows` rows of 512 random ids masked at `mask_prob`, reset
    the peak RSS, run the aux forward and the sampler (`Corruptor.sample`) over it; print the peak RSS of that
    step (Linux VmHWM)."""
    torch.set_num_threads(2)
    corruptor = Corruptor(aux_path, 1, mask_prob, rows * ROW_TOKENS)
    corruptor.chunk_entries = chunk_entries
    rng = np.random.default_rng(0)
    batch = [np.concatenate([[2], rng.integers(5, SAMPLING_VOCAB, ROW_TOKENS - 2), [3]]).astype(np.int32)
             for _ in range(rows)]
    ids, temps = np.arange(rows), np.full(rows, 1.5)
    prepared = corruptor.prepare(batch, ids, 0)
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    corruptor.sample(prepared, batch, ids, 0, temps)
    print(json.dumps({"peak_mb": _status_kb("VmHWM") / 1024, "before_mb": before / 1024,
                      "masked": int(sum(len(p) for p in prepared[0]))}))


def _status_kb(field: str) -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1])


def sampling_peaks(tmp: Path, manifest: str) -> dict:
    """Peak RSS of sampling at 1x and 4x the masked positions of one batch (the same rows masked at 15% and
    60%, so the aux forward is the same), chunked (the generator's setting) and with the whole batch's
    logits at once (the code before chunking), each in a fresh process."""
    from common.checkpoint import save_aux
    from common.config import ModelConfig
    from common.model import MaskedLM
    torch.manual_seed(0)
    shape = ModelConfig(hidden_size=768, num_layers=1, num_heads=12, ffn_size=3072)
    aux = save_aux(MaskedLM(shape, SAMPLING_VOCAB, 1), shape, 1, SAMPLING_VOCAB, "none", tmp / "aux", {"steps": 0})
    out = {}
    for name, entries in (("chunked", 0), ("whole", 1 << 62)):  # 0: the generator's LOGIT_CHUNK_ENTRIES
        for times in (1, 4):
            cmd = [sys.executable, "-m", "bench.generate", "--manifest", manifest, "--sampling-probe", str(aux),
                   "--rows", str(SAMPLING_ROWS), "--mask-prob", str(SAMPLING_MASK * times),
                   "--chunk-entries", str(entries)]
            result = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            out[f"{name}_{times}x"] = result
    return out


def long_rows(corpus_dir: Path, out_dir: Path, row_tokens: int = ROW_TOKENS) -> Path:
    """A corpus folder whose training split is the original's token stream cut into rows of `row_tokens`
    ([CLS] ... [SEP], the paper's row length), in one part as the actors read it."""
    shutil.copytree(corpus_dir, out_dir)
    meta = json.loads((out_dir / "corpus.json").read_text())
    inner = np.concatenate([r[1:-1] for r in load_split(corpus_dir, "train")])
    per_row = row_tokens - 2
    n = len(inner) // per_row
    body = inner[:n * per_row].reshape(n, per_row)
    tokens = np.concatenate([np.full((n, 1), 2), body, np.full((n, 1), 3)], axis=1).astype(np.int32).ravel()
    offsets = np.arange(n + 1, dtype=np.int64) * row_tokens
    flat = {}
    for kind, array in (("tokens", tokens), ("offsets", offsets)):
        path = out_dir / f"long-{kind}.npy"
        np.save(path, array)
        flat[kind] = {"path": path.name, "bytes": path.stat().st_size}
    meta["train"] = {**meta["train"], "rows": n, "tokens": int(len(tokens)),
                     "parts": [{**meta["train"]["parts"][0], "flat": flat, "rows": n, "row_start": 0}]}
    meta["max_seq_len"] = max(meta["max_seq_len"], row_tokens)  # SplitRows checks every row against it
    (out_dir / "corpus.json").write_text(json.dumps(meta))
    return out_dir


def host_rate(config, corpus_dir: Path, tmp: Path, levels=(1, 3, 6, 9, 12, 15, 19), shards: int = 4,
              rows_per_shard: int = 512) -> list[dict]:
    """Per zstd level: the real ShardWriter on 512-token rows (2 threads), best of two passes over `shards`
    shards; host seconds = shard seconds - the Corruptor's own time in the aux forward and sampling. The aux
    model is a 1 x 32 one with the corpus's vocabulary and random weights, so the run is mostly host work
    (the host side does the same whatever the model: the same masks, inputs, label rule and encoding)."""
    from common.checkpoint import save_aux
    from common.config import ModelConfig
    from common.model import MaskedLM
    torch.set_num_threads(2)
    torch.manual_seed(0)
    meta = load_corpus_meta(corpus_dir)
    shape = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, ffn_size=64)
    aux = save_aux(MaskedLM(shape, meta["vocab_size"], 1), shape, 1, meta["vocab_size"], meta["tokenizer_sha256"],
                   tmp / "host-aux", {"steps": 0})
    rows = {"train": SplitRows(corpus_dir, "train"), "valid": []}
    g = config.generate.__class__(epochs=1, rows_per_shard=rows_per_shard, valid_rows=0,
                                  rows_per_epoch=shards * rows_per_shard)
    tasks = plan_tasks(len(rows["train"]), 0, g, config.seed)[:shards]
    corruptor = Corruptor(aux, config.seed, config.generate.mask_prob, config.generate.batch_tokens)
    table = []
    for level in levels:
        best = None
        for _ in range(2):
            with tempfile.TemporaryDirectory() as out:
                writer = ShardWriter(rows, corruptor, out, level, config.generate.rows_per_row_group or 64)
                device0, t0 = corruptor.device_seconds, time.perf_counter()
                records = [writer(task) for task in tasks]
                wall = time.perf_counter() - t0
                host = wall - (corruptor.device_seconds - device0)
            tokens = sum(r["tokens"] for r in records)
            if best is None or host < best["host_s"]:
                best = {"zstd_level": level, "host_s": host, "wall_s": wall, "tokens": tokens,
                        "host_tokens_per_s": tokens / host,
                        "bytes_per_token": sum(r["bytes"] for r in records) / tokens,
                        "phase_seconds_per_shard": mean_phases(records)}
        table.append(best)
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.generate")
    parser.add_argument("--manifest", default="manifests/tiny.toml")
    parser.add_argument("--data", default=None, help="generated epochs to measure bytes/token on")
    parser.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--aux", default=None)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sampling-probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=SAMPLING_ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--chunk-entries", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--mask-prob", type=float, default=SAMPLING_MASK, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sampling_probe:
        from common.memory import LOGIT_CHUNK_ENTRIES
        sampling_probe(args.sampling_probe, args.rows, args.mask_prob, args.chunk_entries or LOGIT_CHUNK_ENTRIES)
        return 0
    config = load_manifest(args.manifest)
    aux_path = Path(args.aux) if args.aux else config.aux_dir / AUX_FILE
    if args.memory_probe:
        memory_probe(args.manifest, args.memory_probe, str(aux_path), args.shards, args.whole)
        return 0
    corpus_dir = config.corpus_dir
    data_dir = Path(args.data) if args.data else config.epochs_dir
    manifest = json.loads((data_dir / "manifest.json").read_text())

    speed = forward_vs_generation(config, corpus_dir, aux_path, num_rows=1024)
    scaling = worker_scaling(config, corpus_dir, aux_path, rows_per_epoch=4096)
    with tempfile.TemporaryDirectory() as tmp:
        # 16 copies: the tiny corpus is 6 MB of tokens, and 4 of them read whole moved an actor's rise by 1.11x only
        big = replicate_corpus(corpus_dir, Path(tmp) / "corpus16x", 16)
        rss = {(times, whole): peak_rss(args.manifest, folder, aux_path, args.shards, whole)
               for times, folder in ((1, corpus_dir), (16, big)) for whole in (False, True)}
        sampling = sampling_peaks(Path(tmp), args.manifest)
        zstd = host_rate(config, long_rows(corpus_dir, Path(tmp) / "long"), Path(tmp))
    base_level = load_manifest("manifests/base.toml").generate.zstd_level  # the level of the 512-token presets
    level = next(r for r in zstd if r["zstd_level"] == base_level)
    epochs = manifest["epochs"]
    result = {
        "gen_vs_forward": speed["generation_tokens_per_s"] / speed["forward_tokens_per_s"],
        "speedup_2_workers": scaling["workers_2_tokens_per_s"] / scaling["workers_1_tokens_per_s"],
        "bytes_per_token": sum(e["bytes"] for e in epochs) / sum(e["tokens"] for e in epochs),
        "entropy_bytes_per_token": unigram_entropy_bytes(corpus_dir, manifest["vocab_size"]),
        "peak_rss_16x_vs_1x": rss[16, False]["rise_mb"] / rss[1, False]["rise_mb"],
        "peak_rss_1x_mb": rss[1, False]["peak_rss_mb"], "peak_rss_16x_mb": rss[16, False]["peak_rss_mb"],
        "rss_rise_1x_mb": rss[1, False]["rise_mb"], "rss_rise_16x_mb": rss[16, False]["rise_mb"],
        "peak_rss_16x_vs_1x_whole_corpus": rss[16, True]["rise_mb"] / rss[1, True]["rise_mb"],
        "sampling_peak_4x_vs_1x": sampling["chunked_4x"]["peak_mb"] / sampling["chunked_1x"]["peak_mb"],
        "sampling_peak_4x_vs_1x_whole_batch": sampling["whole_4x"]["peak_mb"] / sampling["whole_1x"]["peak_mb"],
        "sampling": sampling,
        "host_tokens_per_s": level["host_tokens_per_s"], "zstd_level": base_level, "zstd_table": zstd,
        **{f"single_worker_{k}": v for k, v in speed.items()},
        **{f"ray_{k}": v for k, v in scaling.items()},
        "device": "cpu", "machine": machine(),
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
          f"| an actor's peak RSS over its loaded aux model, 16x corpus / 1x | {result['peak_rss_16x_vs_1x']:.3f} "
          f"(+{result['rss_rise_16x_mb']:.0f} / +{result['rss_rise_1x_mb']:.0f} MB over "
          f"{rss[1, False]['loaded_rss_mb']:.0f}; every row read first, as before SplitRows: "
          f"{result['peak_rss_16x_vs_1x_whole_corpus']:.3f}) | <= 1.2 |",
          f"| sampling peak RSS, 4x masked positions / 1x ({SAMPLING_VOCAB:,} entries; "
          f"{sampling['chunked_4x']['masked']} / {sampling['chunked_1x']['masked']} positions) | "
          f"{result['sampling_peak_4x_vs_1x']:.3f} ({sampling['chunked_4x']['peak_mb']:.0f} / "
          f"{sampling['chunked_1x']['peak_mb']:.0f} MB; the whole batch's logits at once: "
          f"{result['sampling_peak_4x_vs_1x_whole_batch']:.3f}) | <= 1.2 |",
          f"| host side, 512-token rows, zstd {base_level} (base and large; tokens/s, 2 threads) | "
          f"{result['host_tokens_per_s']:,.0f} | >= 2,000,000 |",
          f"| the same, seconds per shard of 512 rows by phase (`phase_seconds`; device: the 1 x 32 aux model) | "
          + ", ".join(f"{k} {v:.4f}" for k, v in level["phase_seconds_per_shard"].items()) + " | |",
          "", "Shard zstd level: bytes against the host side's time (512-token rows of the corpus, 4 shards of 512 "
          "rows, best of 2):", "", "| zstd level | bytes per token | host tokens/s |", "|---|---|---|",
          *(f"| {r['zstd_level']} | {r['bytes_per_token']:.4f} | {r['host_tokens_per_s']:,.0f} |" for r in zstd)]
    atomic_write_text(RESULTS / "generate.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
