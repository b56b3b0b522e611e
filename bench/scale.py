"""`make bench-scale`: what grows with the stream, the batch or the shard folder, measured on this machine.

    python -m bench.scale [--out bench/results]

In one run:
  driver_rss_full_vs_small  RSS of a process holding the generator's plan for base's 125,000 x 2,048 rows
                            (a 16 GB corpus's 7.8M rows a epoch), over one holding a plan 100x smaller
                            (target <= 1.2): tasks are (epoch, first row, count), no per-row arrays
  preflight_max_error       the pre-flight memory estimate against the measured peak of 2 updates of the
                            trainer's own update function, CPU, main models of three shapes (one at base
                            width, 12 x 768), the aux model at base shape, and fast-online at 12 x 768 (its
                            aux model corrupting each batch beside it): the largest relative error
                            (target <= 0.25)
  rank_read_fraction        a shard folder in row groups of a rank's share; 2 ranks each read their slices
                            of every step: bytes read (read syscalls, /proc/self/io rchar, and the column
                            chunks' sizes) and bytes decompressed per rank over the stream's, the largest
                            (target <= 0.55)
  start_4x_vs_1x            seconds from `python -m generate` (a complete folder: nothing to do) through the
                            trainer's first update, on a folder with 4x the shards over 1x (target <= 1.3);
                            beside it the same with every shard hashed (`--verify`, train.verify_shards)
  open_seconds_base_plan    the same start-up in-process (the generator's check, the trainer's open_data), where
                            process start does not hide it: seconds a shard (4x over 1x) carried to the base
                            plan's 3,918 shards (target <= 5 s); `open_4x_vs_1x` beside it
  corpus_rss_4x_vs_1x       peak RSS of `python -m corpus` (one worker, its whole process tree) on a single
                            .jsonl.gz holding 4x the text over one holding 1x (100 MB of text), the
                            tokenizer's sample bounded (max_sentences 50,000, reached by both) (target <= 1.2)
  corpus_documents_rss_4x_vs_1x  the same on one .jsonl.gz of 4M short documents (~160 characters) over one of
                            1M: what the stage keeps per document (hashes, keep and split masks) of its one
                            work unit, a gzip file, is read and written by chunks (target <= 1.2)
  decide_rss_8x_vs_1x       peak RSS of the corpus driver's decision (exact duplicates, the held-out split) over
                            32M documents' hashes against 4M, a tenth of them copies (target <= 1.2); beside
                            it the same for every hash at once, the way before 2026-11-25
  listing_rss_4x_vs_1x      peak RSS of the corpus driver listing, keying and cutting into work units a source
                            of 400,000 small .txt files against 100,000 (one unit of base's 64 MB), then a
                            worker reading that unit's pieces (target <= 1.2): the listing sorted in runs on
                            disk, the units written to a file a piece at a time; beside it the rise over the
                            RSS before the listing
  zstd_read_rss_4x_vs_1x    peak RSS of a process reading every document of one .jsonl.zst, range after range
                            as the corpus workers do, 4x the text (cut into 16 ranges) over 1x (4 ranges; 282 MB
                            of text: 256K documents of ~600 characters, every 4,096th instead 2 MB that compress a
                            thousandfold): a zstd file is decoded a block at a time (target <= 1.2)
  generation_preflight_max_error  a CPU generation actor's estimated peak (`common.memory.generation_need`)
                            against the rise of its RSS over one shard, five shapes (two at base width and
                            vocabulary; rows whose batches are padded, one with rows of mixed lengths): the
                            largest relative error (target <= 0.25); beside it a shape of full rows
Writes bench/results/scale.json and scale.md.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import machine
from common.memory import _proc_bytes, peak_rss_bytes
from common.config import config_from_dict, config_to_dict, dump_toml, load_manifest
from common.io import atomic_write_json, atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "manifests" / "base.toml"


def plan_probe(steps: int, corpus_rows: int) -> dict:
    """In this (fresh) process: plan base's generation for `steps` updates over a corpus of `corpus_rows`."""
    from common.plan import plan_tasks, stream_plan
    config = load_manifest(BASE, [f"train.max_steps={steps}"])
    before = peak_rss_bytes()
    plan = stream_plan(corpus_rows, config)
    tasks = plan_tasks(corpus_rows, 10_000, config.generate, config.seed, plan.total_rows)
    rows = sum(t.count for t in tasks)
    sample = tasks[len(tasks) // 2].row_ids  # what an actor derives for one task
    return {"rss_bytes": peak_rss_bytes(), "before_bytes": before, "tasks": len(tasks), "rows": rows,
            "sample_rows": len(sample)}


def run_probe(kind: str, *args) -> dict:
    cmd = [sys.executable, "-m", "bench.scale", "--probe", json.dumps([kind, *args])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def driver_memory() -> dict:
    corpus_rows = 16 * 10**9 // 4 // 510  # 16 GB of text at ~0.25 tokens per byte, rows of 510 + 2
    full = run_probe("plan", 125_000, corpus_rows)
    small = run_probe("plan", 1_250, corpus_rows)
    return {"driver_rss_full_vs_small": full["rss_bytes"] / small["rss_bytes"], "plan_full": full, "plan_small": small}


def preflight_error() -> dict:
    from bench.aux import measure
    manifest = str(BASE)
    shapes = [measure(manifest, 128, 8, 8, layers=12, hidden=768, vocab=32000, objective="fast-offline"),
              measure(manifest, 128, 32, 32, layers=4, hidden=256, vocab=8000, objective="fast-offline"),
              measure(manifest, 512, 8, 8, layers=2, hidden=512, vocab=8000, objective="fast-offline"),
              measure(manifest, 64, 8, 4, objective="mlm"),
              # its aux model beside it, corrupting each batch (common.memory.online_aux_need)
              measure(manifest, 128, 8, 8, layers=12, hidden=768, vocab=32000, objective="fast-online")]
    for r in shapes:
        r["estimate_over_measured"] = r["estimate_bytes"] / r["peak_rss_bytes"]
    return {"preflight_max_error": max(abs(r["estimate_over_measured"] - 1) for r in shapes), "preflight_shapes": shapes}


# (layers, width, heads, vocabulary, row length, batch tokens, rows per shard, rows): a CPU generation actor's
# shapes, two at the base preset's width and vocabulary. Rows "padded": full but half a batch of them, one token
# short, so one batch is padded to the full length (the case the estimate is for: a corpus's short rows give a
# shard such a batch); "mixed": lengths from half the row to all of it; "full": no batch padded (what the
# estimate's padded batch's term overstates; reported apart, not in the largest error)
GENERATION_SHAPES = [(4, 768, 12, 128000, 512, 32768, 128, "padded"), (4, 768, 12, 128000, 512, 32768, 128, "mixed"),
                     (2, 256, 4, 8000, 512, 65536, 512, "padded"), (2, 128, 4, 32000, 128, 32768, 2048, "padded"),
                     (2, 128, 4, 8000, 128, 65536, 2048, "padded")]
GENERATION_FULL_ROWS = (4, 768, 12, 128000, 512, 32768, 128, "full")


def generation_probe(layers: int, width: int, heads: int, vocab: int, seq_len: int, batch_tokens: int,
                     rows_per_shard: int, lengths: str) -> dict:
    """One CPU generation actor's shards (generate/worker.py's ShardWriter over a random aux model and random
    rows, the same shard twice): how far its RSS rose above what it held once loaded, against
    `common.memory.generation_need`."""
    from bench.gpu import synthetic_rows
    from common.checkpoint import save_aux
    from common.config import GenerateConfig, ModelConfig
    from common.corrupt import Corruptor
    from common.memory import aux_shape, generation_need, peak_rss_bytes
    from common.model import MaskedLM
    from common.plan import plan_tasks
    from generate.worker import ShardWriter
    import torch
    torch.set_num_threads(1)  # the actor's threads_per_worker
    cfg = ModelConfig(hidden_size=width, num_layers=layers, num_heads=heads, ffn_size=4 * width)
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        torch.manual_seed(0)
        path = save_aux(MaskedLM(cfg, vocab, layers), cfg, layers, vocab, "synthetic", tmp, {"steps": 0})
        corruptor = Corruptor(path, 1, 0.15, batch_tokens)
        rows = synthetic_rows(rows_per_shard, seq_len, vocab, seed=1)
        if lengths == "padded":  # half a batch of rows one token short: sorted by length, they share a batch with
            short = max(1, batch_tokens // seq_len // 2)  # full rows, padded to the full length
            rows = [r[:seq_len - (i < short)] for i, r in enumerate(rows)]
        elif lengths == "mixed":
            rows = [r[:n] for r, n in zip(rows, np.random.default_rng(2).integers(seq_len // 2, seq_len + 1, len(rows)))]
        task = plan_tasks(len(rows), 0, GenerateConfig(epochs=1, rows_per_shard=rows_per_shard, valid_rows=0), 1)[0]
        writer = ShardWriter({"train": rows}, corruptor, tmp, 15)
        loaded = _proc_bytes("/proc/self/status", "VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from here on
        for _ in range(2):  # a second shard: its padded batch comes while the sampler's arrays are kept
            writer(task)
        peak = peak_rss_bytes()
    need, _ = generation_need(aux_shape(corruptor.model, vocab), batch_tokens, seq_len, rows_per_shard * seq_len, 1,
                              0.15)
    return {"layers": layers, "width": width, "vocab": vocab, "seq_len": seq_len, "batch_tokens": batch_tokens,
            "rows_per_shard": rows_per_shard, "rows": lengths, "loaded_bytes": loaded,
            "measured_bytes": peak - loaded, "estimate_bytes": need, "estimate_over_measured": need / (peak - loaded)}


def generation_preflight_error() -> dict:
    shapes = [run_probe("generation", *shape) for shape in GENERATION_SHAPES]
    return {"generation_preflight_max_error": max(abs(r["estimate_over_measured"] - 1) for r in shapes),
            "generation_preflight_shapes": shapes, "generation_preflight_full_rows": run_probe("generation",
                                                                                             *GENERATION_FULL_ROWS)}


def write_shard_folder(out: Path, shards: int, rows_per_shard: int, row_group: int, seq_len: int = 512,
                       vocab: int = 8000, zstd_level: int = 3) -> None:
    """Shards of random rows in the generator's schema and encoding, with the manifest records the trainer
    reads (the reading benchmark needs the layout, not a trained aux model)."""
    from common.shards import SHARD_ENCODING, SHARD_SCHEMA, int_lists, write_parquet
    import pyarrow as pa
    rng = np.random.default_rng(0)
    records = []
    for k in range(shards):
        ids = [rng.integers(5, vocab, size=seq_len).astype(np.int32) for _ in range(rows_per_shard)]
        start = k * rows_per_shard
        columns = {"stream_index": pa.array(np.arange(start, start + rows_per_shard, dtype=np.int64)),
                   "row_id": pa.array(rng.permutation(rows_per_shard).astype(np.int64)),
                   "temperature": pa.array(np.full(rows_per_shard, 1.5, np.float32)),
                   "input_ids": int_lists(ids, pa.int32()),
                   "labels": int_lists([rng.random(seq_len) < 0.15 for _ in ids], pa.bool_())}
        path = f"epoch-000/shard-{k:05d}.parquet"
        info = write_parquet(out / path, columns, SHARD_SCHEMA, SHARD_ENCODING, zstd_level, row_group, start)
        records.append({"path": path, "rows": rows_per_shard, **info})
    atomic_write_json(out / "records.json", records)


def read_probe(folder: str, rank: int, world: int, batch: int) -> dict:
    """In this (fresh) process: rank `rank` of `world` reads its slice of every step of the folder."""
    from train.data import ShardStream, rank_slice
    records = json.loads((Path(folder) / "records.json").read_text())
    stream = ShardStream(folder, records)
    rchar = lambda: int(next(l for l in Path("/proc/self/io").read_text().splitlines()  # noqa: E731
                             if l.startswith("rchar")).split()[1])
    before = rchar()
    for step in range(stream.num_rows // batch):
        rows = stream.rows(*rank_slice(step, batch, rank, world))
        assert len(rows["input_ids"]) == batch // world
    return {"rchar": rchar() - before, "bytes_read": stream.bytes_read, "bytes_decompressed": stream.bytes_decompressed}


def rank_reading(tmp: Path) -> dict:
    import pyarrow.parquet as pq
    batch, world = 64, 2
    folder = tmp / "shards"
    write_shard_folder(folder, shards=2, rows_per_shard=8192, row_group=batch // world)
    files = sorted(folder.glob("epoch-000/*.parquet"))
    stream_bytes = sum(f.stat().st_size for f in files)
    stream_decompressed = sum(pq.ParquetFile(f).metadata.row_group(g).total_byte_size
                              for f in files for g in range(pq.ParquetFile(f).metadata.num_row_groups))
    ranks = [run_probe("read", str(folder), r, world, batch) for r in range(world)]
    whole = run_probe("read", str(folder), 0, 1, batch)
    fraction = max(max(r["rchar"], r["bytes_read"]) / stream_bytes for r in ranks)
    fraction = max(fraction, max(r["bytes_decompressed"] / stream_decompressed for r in ranks))
    return {"rank_read_fraction": fraction, "read_ranks": ranks, "read_one_rank": whole,
            "stream_bytes": stream_bytes, "stream_decompressed_bytes": stream_decompressed,
            "read_layout": f"2 shards x 8,192 rows of 512 random ids (zstd 3), row groups of {batch // world}, "
                           f"batch {batch}, {world} ranks"}


def chain(tmp: Path) -> Path:
    """A corpus and an aux model for the start-time benchmark: the embedded text, a 2 x 64 model."""
    work = tmp / "work"
    values = config_to_dict(load_manifest(ROOT / "manifests" / "tiny.toml"))
    values.update(work_dir=str(work), shared_dir="")
    values["model"].update(hidden_size=64, num_layers=2, num_heads=2, ffn_size=128)
    values["aux"].update(steps=20, eval_every=20, ckpt_every=20, log_every=10)
    values["generate"].update(rows_per_epoch=2048, rows_per_shard=32)  # 128 shards at 1x, 512 at 4x: a start-up
    # cost a shard would show in the in-process figure (`open_seconds`)
    values["train"].update(max_steps=1, allow_short_stream=True, eval_every=1000, log_every=1, ckpt_every=1000)
    manifest = tmp / "scale.toml"
    manifest.write_text(dump_toml(config_from_dict(values)))
    for module in ("corpus", "auxiliary"):
        subprocess.run([sys.executable, "-m", module, "--manifest", str(manifest)], check=True, cwd=ROOT,
                       capture_output=True)
    return manifest


def seconds_to_first_step(manifest: Path, data: Path, run: Path, verify: bool) -> float:
    """`make train`'s two commands on a complete folder: the generator's check, then the trainer to its
    first update (metrics.jsonl's first line), which is then stopped."""
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "generate", "--manifest", str(manifest), "--out", str(data),
                    *(["--verify"] if verify else [])], check=True, cwd=ROOT, capture_output=True)
    proc = subprocess.Popen([sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(data),
                             "--out", str(run), *(["--set", "train.verify_shards=true"] if verify else [])],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        if proc.poll() is not None and not (metrics.is_file() and metrics.read_text().strip()):
            raise RuntimeError(f"the trainer on {data} stopped (exit code {proc.returncode}) before its first step")
        time.sleep(0.01)
    seconds = time.perf_counter() - t0
    proc.wait()
    return seconds


def start_time(tmp: Path, repeats: int = 2) -> dict:
    manifest = chain(tmp)
    folders = {}
    for times, epochs in ((1, 2), (4, 8)):
        folders[times] = tmp / f"epochs-{times}x"
        sized = tmp / f"scale-{times}x.toml"
        sized.write_text(dump_toml(load_manifest(manifest, [f"generate.epochs={epochs}"])))
        subprocess.run([sys.executable, "-m", "generate", "--manifest", str(sized), "--out", str(folders[times])],
                       check=True, cwd=ROOT, capture_output=True)
    timings = {f"{times}x{'_verify' if verify else ''}": [] for times in (1, 4) for verify in (False, True)}
    for _ in range(repeats):  # interleaved: drift on this shared machine falls on both sizes alike
        for verify in (False, True):
            for times in (1, 4):
                seconds = seconds_to_first_step(tmp / f"scale-{times}x.toml", folders[times], tmp / "run", verify)
                timings[f"{times}x{'_verify' if verify else ''}"].append(seconds)
    best = {k: min(v) for k, v in timings.items()}
    shards = {times: len(list(folders[times].glob("epoch-*/*.parquet"))) for times in (1, 4)}
    opened = open_seconds(tmp, folders, shards)
    return {"start_4x_vs_1x": best["4x"] / best["1x"], "start_4x_vs_1x_verify": best["4x_verify"] / best["1x_verify"],
            "start_seconds": timings, "start_shards": shards, **opened}


BASE_PLAN_SHARDS = 3918  # the base preset's stream (125,000 x 2,048 rows) in shards: `driver_rss_full_vs_small`'s plan


def open_seconds(tmp: Path, folders: dict, shards: dict, repeats: int = 5) -> dict:
    """The start-up a shard folder costs, in this process (no interpreter, imports or Ray start around it, which
    hide it in `start_4x_vs_1x`): the generator's check of a complete folder (`generate`: nothing to write) and
    the trainer's opening of it (`train.data.open_data`), the best of `repeats`, 4x the shards over 1x; beside
    it the same with every shard hashed (`verify`), which grows with them too. What a shard adds (seconds, the
    4x folder's over the 1x's per extra shard) is carried to the base plan's shards: `open_seconds_base_plan`."""
    from common.checkpoint import AUX_FILE
    from generate.generator import generate
    from train.data import open_data
    timings = {f"{times}x{'_verify' if verify else ''}": [] for times in (1, 4) for verify in (False, True)}
    configs = {times: load_manifest(tmp / f"scale-{times}x.toml") for times in (1, 4)}
    for _ in range(repeats):
        for verify in (False, True):
            for times, config in configs.items():
                t0 = time.perf_counter()
                generate(config, folders[times], config.corpus_dir, config.aux_dir / AUX_FILE, workers=1,
                         log=lambda *_: None, verify=verify)
                open_data(folders[times], config, log=lambda *_: None)
                timings[f"{times}x{'_verify' if verify else ''}"].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in timings.items()}
    per_shard = (best["4x"] - best["1x"]) / (shards[4] - shards[1])
    return {"open_4x_vs_1x": best["4x"] / best["1x"], "open_4x_vs_1x_verify": best["4x_verify"] / best["1x_verify"],
            "open_seconds_per_shard": per_shard,
            "open_seconds_base_plan": best["1x"] + per_shard * (BASE_PLAN_SHARDS - shards[1]), "open_seconds": timings}


def jsonl_gz(path: Path, megabytes: float, seed: int, cache: Path) -> int:
    """One .jsonl.gz of documents of the embedded text's sentences (`bench.corpus.synthetic_corpus`, all
    distinct); returns the bytes of text."""
    from bench.corpus import one_compressed_file, synthetic_corpus
    folder = cache / f"txt-{seed}"
    synthetic_corpus(folder, megabytes, cache, seed=seed)
    written = one_compressed_file(folder, path, level=1)
    shutil.rmtree(folder)
    return written


def corpus_memory(tmp: Path) -> dict:
    from bench.corpus import run_job
    manifest = tmp / "corpus.toml"
    # unit_mb above the file's size: the file stays one unit (a .jsonl.gz larger than a unit is read in ranges,
    # units of their own), so the figure stays one of a unit's size, not of the ranges'
    manifest.write_text(dump_toml(load_manifest(ROOT / "manifests" / "tiny.toml", ["tokenizer.max_sentences=50000",
                                                                                  "corpus.unit_mb=4096"])))
    runs = {}
    for times in (1, 4):
        source = tmp / f"corpus-{times}x.jsonl.gz"
        text_bytes = jsonl_gz(source, 100 * times, seed=times, cache=tmp)
        runs[times] = {**run_job(manifest, source, tmp / f"corpus-{times}x", 1), "text_mb": text_bytes / 1e6,
                       "gz_mb": source.stat().st_size / 1e6}
        source.unlink()
        shutil.rmtree(tmp / f"corpus-{times}x", ignore_errors=True)
    return {"corpus_rss_4x_vs_1x": runs[4]["peak_rss_mb"] / runs[1]["peak_rss_mb"], "corpus_runs": runs}


def short_documents_gz(path: Path, documents: int, seed: int, cache: Path) -> int:
    """One .jsonl.gz of `documents` short documents, two of the embedded text's sentences each and a serial
    number (all distinct: about 160 characters a document, as in a corpus of posts or reviews); returns the
    bytes of text."""
    import gzip
    from bench.corpus import embedded_sentences
    sentences = embedded_sentences(cache)
    picks = np.random.default_rng(seed).integers(0, len(sentences), size=(documents, 2))
    written = 0
    with gzip.open(path, "wt", compresslevel=1, encoding="utf-8") as f:
        for i, (a, b) in enumerate(picks):
            line = json.dumps({"text": f"{sentences[a]} {sentences[b]} ({i})"}) + "\n"
            written += len(line)
            f.write(line)
    return written


def corpus_documents_memory(tmp: Path) -> dict:
    """`python -m corpus` (one worker) on one .jsonl.gz of 1M short documents and of 4M: one gzip file is one
    work unit, so what the stage keeps per document (hashes, masks) must be read and written by chunks."""
    from bench.corpus import run_job
    manifest = tmp / "corpus.toml"
    manifest.write_text(dump_toml(load_manifest(ROOT / "manifests" / "tiny.toml", ["tokenizer.max_sentences=20000",
                                                                                  "corpus.unit_mb=4096"])))  # one unit
    runs = {}
    for times in (1, 4):
        source = tmp / f"documents-{times}x.jsonl.gz"
        text_bytes = short_documents_gz(source, times << 20, seed=times, cache=tmp)
        runs[times] = {**run_job(manifest, source, tmp / f"documents-{times}x", 1), "documents": times << 20,
                       "text_mb": text_bytes / 1e6, "gz_mb": source.stat().st_size / 1e6}
        source.unlink()
        shutil.rmtree(tmp / f"documents-{times}x", ignore_errors=True)
    return {"corpus_documents_rss_4x_vs_1x": runs[4]["peak_rss_mb"] / runs[1]["peak_rss_mb"],
            "corpus_documents_runs": runs}


def documents_zst(path: Path, documents: int, seed: int, cache: Path) -> int:
    """One .jsonl.zst (zstd level 3, with its checksum) of `documents` documents of eight of the embedded text's
    sentences and a serial number (about 600 characters), every 4,096th instead one sentence repeated to 2 MB (a
    stretch that compresses a thousandfold); returns the bytes of text."""
    import io
    import zstandard
    from bench.corpus import embedded_sentences
    sentences = embedded_sentences(cache)
    picks = np.random.default_rng(seed).integers(0, len(sentences), size=(documents, 8))
    written = 0
    with io.TextIOWrapper(zstandard.ZstdCompressor(level=3, write_checksum=True).stream_writer(open(path, "wb")),
                          encoding="utf-8") as f:
        for i, pick in enumerate(picks):
            text = (sentences[pick[0]] + " ") * (2_000_000 // (len(sentences[pick[0]]) + 1)) if i % 4096 == 4095 \
                else " ".join(sentences[k] for k in pick) + f" ({i})"
            line = json.dumps({"text": text}) + "\n"
            written += len(line)
            f.write(line)
    return written


def zstd_read_probe(source: str, cache: str, unit_bytes: int) -> dict:
    """In this (fresh) process: every document of a .jsonl.zst read as the corpus workers read it, each range
    a unit (`work_units`, `read_unit`), one after another; the peak of its RSS (VmHWM, reset once the imports
    are done) and the RSS before."""
    from common.sources import read_unit, source_files, work_units
    files = source_files(source, cache)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    before, t0 = _proc_bytes("/proc/self/status", "VmRSS"), time.time()
    units = documents = chars = 0
    for unit in work_units(files, unit_bytes):
        units += 1
        for doc in read_unit(unit, "text"):
            documents, chars = documents + 1, chars + len(doc.text)
    return {"units": units, "documents": documents, "characters": chars, "before_bytes": before,
            "peak_bytes": _proc_bytes("/proc/self/status", "VmHWM"), "seconds": time.time() - t0}


def zstd_read_memory(tmp: Path) -> dict:
    """Reading one .jsonl.zst of 4x the documents (1M, 16 ranges) against 1x (256K, 4 ranges of the same size)."""
    runs, unit = {}, None
    for times in (1, 4):
        source = tmp / f"zstd-{times}x.jsonl.zst"
        text_bytes = documents_zst(source, times << 18, seed=times, cache=tmp)
        unit = unit or -(-source.stat().st_size // 4)
        runs[f"{times}x"] = {**run_probe("zstd", str(source), str(tmp), unit), "text_mb": text_bytes / 1e6,
                             "zst_mb": source.stat().st_size / 1e6}
        source.unlink()
    return {"zstd_read_rss_4x_vs_1x": runs["4x"]["peak_bytes"] / runs["1x"]["peak_bytes"], "zstd_read_runs": runs}


def write_scan(folder: Path, units: int, docs_per_unit: int, seed: int) -> list:
    """A corpus stage's scan output as `_decide` reads it: per unit, its documents' 64-bit hashes, a tenth of
    them copies of earlier documents'."""
    from types import SimpleNamespace
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    total = units * docs_per_unit
    hashes = rng.integers(0, 2**64, total, dtype=np.uint64)
    copies = np.flatnonzero(rng.random(total) < 0.1)
    copies = copies[copies > 0]
    hashes[copies] = hashes[(rng.random(len(copies)) * copies).astype(np.int64)]
    for u in range(units):
        np.save(folder / f"unit-{u:05d}.npy", hashes[u * docs_per_unit:(u + 1) * docs_per_unit])
    return [SimpleNamespace(index=u) for u in range(units)]


def decide_probe(folder: str, units: int, whole: bool) -> dict:
    """In this (fresh) process: the driver's decision over a scan folder, `_decide` (a bucket of hashes at a
    time) or, `whole`, every hash at once as the driver did until 2026-11-25."""
    from types import SimpleNamespace
    from corpus.build import _decide, valid_mask
    before = peak_rss_bytes()
    unit_list = [SimpleNamespace(index=u) for u in range(units)]
    t0 = time.time()
    if whole:
        hashes = np.concatenate([np.load(Path(folder) / f"unit-{u:05d}.npy") for u in range(units)])
        keep = np.zeros(len(hashes), dtype=bool)
        keep[np.unique(hashes, return_index=True)[1]] = True
        valid = valid_mask(hashes, 0.01)
        duplicates = int(len(hashes) - keep.sum())
        del valid
    else:
        duplicates = _decide(unit_list, Path(folder), 0.01).duplicates
    return {"rss_bytes": peak_rss_bytes(), "before_bytes": before, "seconds": time.time() - t0,
            "duplicates": duplicates}


def decide_memory(tmp: Path) -> dict:
    runs = {}
    for times in (1, 8):
        folder = tmp / f"scan-{times}x"
        units = write_scan(folder, 64 * times, 1 << 16, seed=times)  # 4M documents a time: a bucket's worth
        runs[f"{times}x"] = {"documents": len(units) << 16,
                             "buckets": run_probe("decide", str(folder), len(units), False),
                             "whole": run_probe("decide", str(folder), len(units), True)}
        shutil.rmtree(folder)
    ratio = lambda way: runs["8x"][way]["rss_bytes"] / runs["1x"][way]["rss_bytes"]
    return {"decide_rss_8x_vs_1x": ratio("buckets"), "decide_rss_8x_vs_1x_whole": ratio("whole"), "decide_runs": runs}


def listing_probe(source: str, cache: str, units_path: str) -> dict:
    """In this (fresh) process: what the corpus driver does with a source's files before any worker starts
    (`corpus.build._build`): list them (`source_files`), key them (`build_key`), write the work units
    (`write_units`); then what a worker does with its unit before reading documents (its pieces, read from
    the units file); the peak of its RSS (VmHWM, reset once the imports are done) and the RSS before."""
    from common.sources import source_files, write_units
    from corpus.build import build_key, unit_bytes
    config = load_manifest(BASE)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    before, t0 = _proc_bytes("/proc/self/status", "VmRSS"), time.time()
    files = source_files(source, cache)
    build_key(config, files)
    units = write_units(files, unit_bytes(config), units_path)
    pieces = sum(1 for _ in units[0].load().pieces)
    return {"files": len(files), "units": len(units), "first_unit_pieces": pieces, "before_bytes": before,
            "peak_bytes": _proc_bytes("/proc/self/status", "VmHWM"), "seconds": time.time() - t0}


def listing_memory(tmp: Path) -> dict:
    """The corpus driver's listing of 400,000 one-line .txt files (1,000 a folder) against 100,000."""
    runs = {}
    for times in (1, 4):
        folder = tmp / f"listing-{times}x"
        for i in range(100_000 * times):
            if i % 1000 == 0:
                (folder / f"d{i // 1000:04d}").mkdir(parents=True)
            (folder / f"d{i // 1000:04d}" / f"doc-{i:07d}.txt").write_text(f"document {i}\n")
        runs[f"{times}x"] = run_probe("listing", str(folder), str(tmp), str(tmp / "units.jsonl"))
        shutil.rmtree(folder)
    rise = lambda run: run["peak_bytes"] - run["before_bytes"]
    return {"listing_rss_4x_vs_1x": runs["4x"]["peak_bytes"] / runs["1x"]["peak_bytes"],
            "listing_rise_4x_vs_1x": rise(runs["4x"]) / rise(runs["1x"]), "listing_runs": runs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--parts",
                        default="driver,read,start,corpus,documents,decide,listing,zstd,preflight,generation",
                        help="which figures to measure (the others are kept from the last scale.json)")
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        kind, *rest = json.loads(args.probe)
        print(json.dumps({"plan": plan_probe, "read": read_probe, "decide": decide_probe, "listing": listing_probe,
                          "zstd": zstd_read_probe, "generation": generation_probe}[kind](*rest)))
        return 0
    out = Path(args.out)
    parts = set(args.parts.split(","))
    every = {"driver", "read", "start", "corpus", "documents", "decide", "listing", "zstd", "preflight", "generation"}
    result = json.loads((out / "scale.json").read_text()) if parts != every else {}
    result.update({"date": time.strftime("%Y-%m-%d"), "machine": f"{machine()}, Python {platform.python_version()}, torch {importlib.metadata.version('torch')}"})
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for name, measure in (("driver", driver_memory), ("read", rank_reading), ("start", start_time),
                              ("corpus", corpus_memory), ("documents", corpus_documents_memory),
                              ("decide", decide_memory), ("listing", listing_memory), ("zstd", zstd_read_memory),
                              ("preflight", preflight_error), ("generation", generation_preflight_error)):
            if name in parts:
                result.update(measure(Path(tmp)) if name in ("read", "start", "corpus", "documents", "decide",
                                                             "listing", "zstd") else measure())
    atomic_write_json(out / "scale.json", result)
    result = json.loads(json.dumps(result))  # keys as the file has them, whether measured now or kept
    md = ["# make bench-scale", "", f"{result['date']}, {result['machine']}.", "",
          "| figure | value | target |", "|---|---|---|",
          f"| driver RSS, base plan (125,000 x 2,048 rows) / 100x smaller (`driver_rss_full_vs_small`) | "
          f"{result['driver_rss_full_vs_small']:.3f} ({result['plan_full']['rss_bytes'] / 2**20:.0f} / "
          f"{result['plan_small']['rss_bytes'] / 2**20:.0f} MB, {result['plan_full']['tasks']} / "
          f"{result['plan_small']['tasks']} tasks) | <= 1.2 |",
          f"| pre-flight estimate vs measured peak, largest error (`preflight_max_error`) | "
          f"{result['preflight_max_error']:.3f} | <= 0.25 |",
          f"| generation actor's pre-flight estimate vs its measured peak, CPU, largest error "
          f"(`generation_preflight_max_error`) | {result['generation_preflight_max_error']:.3f} | <= 0.25 |",
          f"| bytes read / decompressed per rank over the stream's, 2 ranks (`rank_read_fraction`) | "
          f"{result['rank_read_fraction']:.3f} | <= 0.55 |",
          f"| seconds to the first step, 4x shards / 1x (`start_4x_vs_1x`) | {result['start_4x_vs_1x']:.3f} "
          f"(every shard hashed: {result['start_4x_vs_1x_verify']:.3f}) | <= 1.3 |",
          *([f"| the same in-process (the generator's check and the trainer's opening of the folder), 4x / 1x "
             f"(`open_4x_vs_1x`); carried to the base plan's {BASE_PLAN_SHARDS:,} shards (`open_seconds_base_plan`) | "
             f"{result['open_4x_vs_1x']:.3f} (every shard hashed: {result['open_4x_vs_1x_verify']:.3f}); "
             f"{result['open_seconds_per_shard'] * 1e6:.0f} us a shard: {result['open_seconds_base_plan']:.2f} s | "
             f"<= 5 s |"] if "open_seconds_base_plan" in result else []),  # a scale.json before it
          f"| corpus stage peak RSS, one .jsonl.gz of 4x the text / 1x (`corpus_rss_4x_vs_1x`) | "
          f"{result['corpus_rss_4x_vs_1x']:.3f} ({result['corpus_runs']['4']['peak_rss_mb']:.0f} / "
          f"{result['corpus_runs']['1']['peak_rss_mb']:.0f} MB; {result['corpus_runs']['4']['text_mb']:.0f} / "
          f"{result['corpus_runs']['1']['text_mb']:.0f} MB of text) | <= 1.2 |",
          *([f"| corpus stage peak RSS, one .jsonl.gz of 4M short documents / 1M (`corpus_documents_rss_4x_vs_1x`) | "
             f"{result['corpus_documents_rss_4x_vs_1x']:.3f} ({result['corpus_documents_runs']['4']['peak_rss_mb']:.0f} / "
             f"{result['corpus_documents_runs']['1']['peak_rss_mb']:.0f} MB; "
             f"{result['corpus_documents_runs']['4']['text_mb']:.0f} / {result['corpus_documents_runs']['1']['text_mb']:.0f} "
             f"MB of text) | <= 1.2 |"] if "corpus_documents_rss_4x_vs_1x" in result else []),  # a scale.json before it
          f"| corpus driver's decision (duplicates, split), peak RSS, 8x the documents / 1x "
          f"(`decide_rss_8x_vs_1x`) | {result['decide_rss_8x_vs_1x']:.3f} "
          f"({result['decide_runs']['8x']['buckets']['rss_bytes'] / 2**20:.0f} / "
          f"{result['decide_runs']['1x']['buckets']['rss_bytes'] / 2**20:.0f} MB, "
          f"{result['decide_runs']['8x']['documents']:,} / {result['decide_runs']['1x']['documents']:,} documents; "
          f"every hash at once as before: {result['decide_rss_8x_vs_1x_whole']:.3f}, "
          f"{result['decide_runs']['8x']['whole']['rss_bytes'] / 2**20:.0f} / "
          f"{result['decide_runs']['1x']['whole']['rss_bytes'] / 2**20:.0f} MB) | <= 1.2 |",
          *([f"| corpus driver's listing, key and work units, peak RSS, 400,000 source files / 100,000 "
             f"(`listing_rss_4x_vs_1x`) | {result['listing_rss_4x_vs_1x']:.3f} "
             f"({result['listing_runs']['4x']['peak_bytes'] / 2**20:.0f} / "
             f"{result['listing_runs']['1x']['peak_bytes'] / 2**20:.0f} MB, "
             f"{result['listing_runs']['4x']['before_bytes'] / 2**20:.0f} MB before; the rise over it "
             f"{result['listing_rise_4x_vs_1x']:.2f}x) | <= 1.2 |"]
            if "listing_rss_4x_vs_1x" in result else []),
          *([f"| reading one .jsonl.zst range after range, peak RSS, 4x the text / 1x (`zstd_read_rss_4x_vs_1x`) | "
             f"{result['zstd_read_rss_4x_vs_1x']:.3f} ({result['zstd_read_runs']['4x']['peak_bytes'] / 2**20:.0f} / "
             f"{result['zstd_read_runs']['1x']['peak_bytes'] / 2**20:.0f} MB; "
             f"{result['zstd_read_runs']['4x']['text_mb']:.0f} / {result['zstd_read_runs']['1x']['text_mb']:.0f} MB of "
             f"text in {result['zstd_read_runs']['4x']['units']} / {result['zstd_read_runs']['1x']['units']} ranges) | "
             f"<= 1.2 |"] if "zstd_read_rss_4x_vs_1x" in result else []),
          "", "Pre-flight shapes (objective, layers x width, vocabulary, tokens, rows / micro-batch: estimate / measured):", ""]
    md += [f"- {r['objective']}, {r['layers']} x {r['hidden']}, {r['vocab']}, {r['seq_len']}, {r['batch']} / {r['micro']}: "
           f"{r['estimate_bytes'] / 2**20:.0f} / {r['peak_rss_bytes'] / 2**20:.0f} MB ({r['estimate_over_measured']:.3f})"
           for r in result["preflight_shapes"]]
    md += ["", "Generation actor shapes (layers x width, vocabulary, row length, batch tokens, rows per shard: "
           "estimate / measured rise over the loaded actor; the last one, full rows, is not in the largest error):",
           ""]
    md += [f"- {r['layers']} x {r['width']}, {r['vocab']}, {r['seq_len']} ({r['rows']} rows), {r['batch_tokens']}, "
           f"{r['rows_per_shard']}: {r['estimate_bytes'] / 2**20:.0f} / {r['measured_bytes'] / 2**20:.0f} MB "
           f"({r['estimate_over_measured']:.3f})"
           for r in [*result["generation_preflight_shapes"], result["generation_preflight_full_rows"]]]
    md += ["", f"Reading: {result['read_layout']}; per rank "
           + "; ".join(f"rchar {r['rchar'] / 2**20:.2f} MB, chunks {r['bytes_read'] / 2**20:.2f} MB, decompressed "
                       f"{r['bytes_decompressed'] / 2**20:.2f} MB" for r in result["read_ranks"])
           + f"; stream {result['stream_bytes'] / 2**20:.2f} MB on disk, {result['stream_decompressed_bytes'] / 2**20:.2f} MB decompressed.",
           "", f"Start: {result['start_shards']} shards; seconds per run {result['start_seconds']}."]
    atomic_write_text(out / "scale.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
