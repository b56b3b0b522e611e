"""`make bench-corpus`: how fast the corpus stage runs against the tokenizer's own speed, how it scales
with workers, and whether its memory stays flat as the corpus grows.

    python -m bench.corpus [--mb 200] [--out bench/results]

Builds a synthetic corpus of at least `--mb` MB from the embedded texts (documents of reshuffled
sentences, so none is a duplicate), then runs `python -m corpus` on it, measured in one run:
  mb_per_s                source MB/s of the two passes over the corpus (scan + pack) with 2 workers
  mb_per_s_1_worker       the same with 1 worker
  vs_tokenizer_limit      mb_per_s_1_worker / SentencePiece `encode` MB/s on one thread over the same
                          text, timed inside the same run (the seconds the 1-worker pack spent in
                          `encode`): the passes per worker against tokenizing alone; target >= 0.7.
                          A separate encode-only pass over 20 MB is kept as a cross-check.
  speedup_2_workers       mb_per_s / mb_per_s_1_worker (target >= 1.7 on 2 cores)
  peak_rss_4x_vs_1x       peak RSS of the whole job (driver, Ray, workers) on a 4x corpus / on 1x
                          (target <= 1.2)
  hours_16gb_2_cores, hours_16gb_64_cores   16 GB at the measured per-worker rate, plus fixed costs
  one_gzip_speedup_2_workers   (part `gzip`) the same documents as one .jsonl.gz: scan + pack seconds with 1
                          worker / with 2; `..._one_unit`: the same with the file one work unit, as every gzip
                          file was read before its ranges (unit_mb above the file's size); target >= 1.5
  one_zstd_speedup_2_workers   (part `zstd`) the same as one .jsonl.zst (zstd level 3, as the `zstd` tool
                          writes by default), likewise; target >= 1.5
  one_txt_gz_speedup_2_workers (part `txt_gz`) the same as one .txt.gz of the documents one after another (read
                          as documents of 8 MiB of its lines), likewise; target >= 1.5
Fixed costs that do not grow with the corpus (Ray's start, training the tokenizer on its bounded
sample, publishing) are reported apart. Writes bench/results/corpus.json and corpus.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench import machine
from common.config import dump_toml, load_manifest
from common.io import atomic_write_json, atomic_write_text, read_json
from common.sources import paragraphs, read_unit, shakespeare_folder, source_files, work_units
from common.tokenizer import Tokenizer

SENTENCE = re.compile(r"(?<=[.!?;:])\s+")


def embedded_sentences(cache_dir: Path) -> list[str]:
    """The embedded texts' sentences of more than 20 characters."""
    files = source_files(str(shakespeare_folder(cache_dir)), cache_dir)
    return [s for u in work_units(files, 1 << 22) for d in read_unit(u, "text")
            for p in paragraphs(d.text) for s in SENTENCE.split(p) if len(s) > 20]


def synthetic_corpus(out: Path, megabytes: float, cache_dir: Path, seed: int = 0, doc_kb: int = 100) -> int:
    """Folders of .txt documents of `doc_kb` KB, each made of sentences of the embedded texts drawn at
    random (paragraphs of 4-12 sentences); returns the bytes written."""
    sentences = embedded_sentences(cache_dir)
    rng = np.random.default_rng(seed)
    written, doc = 0, 0
    while written < megabytes * 1e6:
        chunks, size = [], 0
        while size < doc_kb * 1000:
            picked = rng.integers(0, len(sentences), size=rng.integers(4, 13))
            chunks.append(" ".join(sentences[i] for i in picked))
            size += len(chunks[-1]) + 2
        path = out / f"{doc // 1000:03d}" / f"doc-{doc:06d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "\n\n".join(chunks) + "\n"
        path.write_text(text)
        written += len(text.encode())
        doc += 1
    return written


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants (Ray's raylet, workers), from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss[int(entry)] = int(fields.get("VmRSS", "0 kB").split()[0])
        children.setdefault(int(fields.get("PPid", "0").strip()), []).append(int(entry))
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0)
        stack += children.get(p, [])
    return total / 1024


def run_job(manifest: Path, source: Path, out: Path, workers: int) -> dict:
    """`python -m corpus` in a process of its own; its pass timings and the peak RSS of its process tree."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "corpus", "--manifest", str(manifest), "--source", str(source), "--out", str(out),
           "--workers", str(workers)]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "RAY_ADDRESS": ""}, start_new_session=True)
    peak = [0.0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss_mb(proc.pid))
            time.sleep(0.25)
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    stdout = proc.communicate()[0]
    watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stdout[-3000:]}")
    line = next(l for l in stdout.splitlines() if l.startswith("corpus: seconds "))
    seconds = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+)", line[len("corpus: seconds "):])}
    # the driver's own VmHWM, exact: the sampled tree (every 0.25 s) can miss a short peak, which with one worker
    # (the build in the driver) is the whole job's
    driver = float(re.search(r"^corpus: peak RSS of this process (\d+) MB", stdout, re.M).group(1))
    return {"seconds": seconds, "wall_s": time.time() - t0, "peak_rss_mb": max(peak[0], driver),
            "sampled_peak_rss_mb": peak[0], "driver_peak_rss_mb": driver}


def encode_limit_mb_per_s(tokenizer: Path, source: Path, megabytes: float = 20.0) -> float:
    """SentencePiece `encode` alone, one thread, on the first `megabytes` of the same documents' paragraphs."""
    tok = Tokenizer(tokenizer)
    texts, size = [], 0
    for path in sorted(source.rglob("*.txt")):
        for p in paragraphs(path.read_text()):
            texts.append(p)
            size += len(p.encode())
        if size > megabytes * 1e6:
            break
    t0 = time.perf_counter()
    for start in range(0, len(texts), 256):
        tok.sp.encode(texts[start:start + 256], num_threads=1)
    return size / 1e6 / (time.perf_counter() - t0)


def one_compressed_file(source: Path, path: Path, level: int = 0) -> int:
    """The .txt documents of `source`, in name order, as the lines of one .jsonl.gz or .jsonl.zst (with its
    checksum) of JSON objects with a "text" field, or one after another in a .txt.gz or .txt.zst, at `level` (0:
    gzip's 9, zstd's 3); returns the bytes of text."""
    import gzip
    import io
    import json
    import zstandard
    tmp, written = path.with_name(path.name + ".tmp"), 0
    with (gzip.open(tmp, "wt", compresslevel=level or 9, encoding="utf-8") if path.name.endswith(".gz") else
          io.TextIOWrapper(zstandard.ZstdCompressor(level=level or 3, write_checksum=True).stream_writer(
              open(tmp, "wb")), encoding="utf-8")) as f:
        for doc in sorted(source.rglob("*.txt")):
            text = doc.read_text()
            written += len(text.encode())
            f.write(json.dumps({"text": text}) + "\n" if ".jsonl." in path.name else text + "\n")
    tmp.rename(path)
    return written


COMPRESSED_PARTS = {"gzip": "jsonl.gz", "zstd": "jsonl.zst", "txt_gz": "txt.gz"}  # part: the file it builds


def compressed_part(manifest: Path, work: Path, source: Path, kind: str) -> dict:
    """One .jsonl.gz (kind "gzip"), .jsonl.zst ("zstd") or .txt.gz ("txt_gz") of the 1x corpus's documents: 1
    worker against 2, cut into ranges, and as one unit."""
    path = work / "one-file" / f"docs.{COMPRESSED_PARTS[kind]}"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        one_compressed_file(source, path)
    runs, manifests = {}, {"ranges": manifest, "one_unit": work / f"bench-{kind}-one_unit.toml"}
    # unit_mb above the file's size: one unit, as every gzip and zstd file was read before its ranges
    manifests["one_unit"].write_text(dump_toml(load_manifest(manifest, [
        f"corpus.unit_mb={2 * path.stat().st_size / 2**20}"])))
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        for name in ("ranges", "one_unit"):
            for workers in (1, 2):
                runs[f"{name}_{workers}"] = run_job(manifests[name], path, Path(tmp) / f"{name}{workers}", workers)
                shutil.rmtree(Path(tmp) / f"{name}{workers}")
    passes = lambda r: r["seconds"]["scan"] + r["seconds"]["pack"]
    return {f"one_{kind}_mb": path.stat().st_size / 1e6,
            f"one_{kind}_speedup_2_workers": passes(runs["ranges_1"]) / passes(runs["ranges_2"]),
            f"one_{kind}_speedup_2_workers_one_unit": passes(runs["one_unit_1"]) / passes(runs["one_unit_2"]),
            f"one_{kind}_ranges_vs_one_unit_1_worker": passes(runs["ranges_1"]) / passes(runs["one_unit_1"]),
            f"one_{kind}_runs": runs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.corpus")
    parser.add_argument("--manifest", default="manifests/tiny.toml")
    parser.add_argument("--mb", type=float, default=200.0, help="size of the 1x synthetic corpus")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--work", default="work/bench-corpus")
    parser.add_argument("--parts", default="throughput,gzip,zstd,txt_gz",
                        help="throughput (workers, memory, the tokenizer's limit), gzip (one .jsonl.gz), zstd (one "
                             ".jsonl.zst), txt_gz (one .txt.gz); a part left out keeps its figures from the results "
                             "file")
    args = parser.parse_args(argv)
    parts, known = set(args.parts.split(",")), {"throughput", *COMPRESSED_PARTS}
    if not parts <= known:
        parser.error(f"--parts: unknown {', '.join(sorted(parts - known))} ({', '.join(sorted(known))})")
    config = load_manifest(args.manifest)
    config.corpus.unit_mb = 8.0
    config.tokenizer.max_sentences = 50_000  # a bounded sample: its cost does not grow with the corpus
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    manifest = work / "bench.toml"
    manifest.write_text(dump_toml(config))
    cache = Path(config.work_dir) / "downloads"
    sources = {}
    for scale in (1, 4) if "throughput" in parts else (1,):
        folder = work / f"source-{scale}x"
        if not (folder / ".complete").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            synthetic_corpus(folder, args.mb * scale, cache, seed=scale)
            (folder / ".complete").write_text("")
        sources[scale] = folder
    megabytes = {s: sum(p.stat().st_size for p in f.rglob("*.txt")) / 1e6 for s, f in sources.items()}
    out = Path(args.out)
    result = read_json(out / "corpus.json") if (out / "corpus.json").is_file() else {}
    if "parts" not in result:  # results written before the parts were: one date and machine for all
        result["date_throughput"], result["machine_throughput"] = result.get("date"), result.get("machine")
    now, here = time.strftime("%Y-%m-%d %H:%M"), f"{machine()}, Python {platform.python_version()}"
    for kind in COMPRESSED_PARTS:
        if kind in parts:
            result.update(compressed_part(manifest, work, sources[1], kind), **{f"date_{kind}": now,
                                                                                  f"machine_{kind}": here})
    if "throughput" in parts:
        result.update(throughput_part(manifest, args, megabytes, sources), date_throughput=now, machine_throughput=here)
    result.update({"machine": here, "date": now, "parts": sorted(parts)})
    atomic_write_json(out / "corpus.json", result)
    md = ["# bench-corpus", "",
          f"`python -m bench.corpus --mb {args.mb:g} --parts {args.parts}` on {result['machine']}, {result['date']}; "
          f"each part's figures from its last run (throughput {result.get('date_throughput')} on "
          f"{result.get('machine_throughput')}"
          + "".join(f", {kind} {result.get(f'date_{kind}')} on {result.get(f'machine_{kind}')}"
                    for kind in COMPRESSED_PARTS) + "): "
          f"a synthetic corpus of {megabytes[1]:.0f} MB of reshuffled sentences of the "
          f"embedded texts.", "", "| measure | value | target |", "|---|---|---|"]
    if "mb_per_s" in result:
        md += throughput_rows(result)
    for kind, name in COMPRESSED_PARTS.items():
        if f"one_{kind}_speedup_2_workers" in result:
            md += [f"| one .{name} ({result[f'one_{kind}_mb']:.0f} MB) in ranges: speedup_2_workers "
                   f"(`one_{kind}_speedup_2_workers`) | {result[f'one_{kind}_speedup_2_workers']:.3f} | >= 1.5 |",
                   f"| the same file as one unit (every such file before its ranges) | "
                   f"{result[f'one_{kind}_speedup_2_workers_one_unit']:.3f} | |",
                   f"| 1 worker, ranges / one unit (what skipping to a range costs) | "
                   f"{result[f'one_{kind}_ranges_vs_one_unit_1_worker']:.3f} | |"]
    atomic_write_text(out / "corpus.md", "\n".join(md + [""]))
    print("\n".join(md))
    return 0


def throughput_rows(result: dict) -> list[str]:
    mb1, mb2, fixed_s, limit = (result["mb_per_s_1_worker"], result["mb_per_s"], result["fixed_seconds"],
                                result["tokenizer_limit_mb_per_s_separate"])
    limit_in_run = result["tokenizer_limit_mb_per_s"]
    return [f"| the 4x corpus | {result['corpus_4x_mb']:.0f} MB | |",
           f"| mb_per_s (2 workers, scan + pack) | {mb2:.2f} | |",
           f"| mb_per_s_1_worker | {mb1:.2f} | |",
           f"| SentencePiece encode, 1 thread, same text, same run | {limit_in_run:.2f} MB/s | |",
           f"| vs_tokenizer_limit | {result['vs_tokenizer_limit']:.3f} | >= 0.7 |",
           f"| cross-check: encode-only pass over 20 MB, and the ratio against it | {limit:.2f} MB/s, "
           f"{result['vs_tokenizer_limit_separate']:.3f} | |",
           f"| speedup_2_workers | {result['speedup_2_workers']:.3f} | >= 1.7 |",
           f"| peak_rss_4x_vs_1x | {result['peak_rss_4x_vs_1x']:.3f} ({result['peak_rss_mb_4x']:.0f} / "
           f"{result['peak_rss_mb_1x']:.0f} MB) | <= 1.2 |",
           f"| fixed costs (Ray start, tokenizer on its sample, publish) | {fixed_s:.1f} s | |",
           f"| 16 GB on 2 cores / on 64 cores (extrapolated) | {result['hours_16gb_2_cores']:.2f} h / "
           f"{result['hours_16gb_64_cores']:.3f} h | |"]


def throughput_part(manifest: Path, args, megabytes: dict, sources: dict) -> dict:
    work = Path(args.work)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        runs = {"1x_1": run_job(manifest, sources[1], Path(tmp) / "c1", 1),
                "1x_2": run_job(manifest, sources[1], Path(tmp) / "c2", 2)}
        limit = encode_limit_mb_per_s(Path(tmp) / "c2" / "tokenizer.model", sources[1])
        shutil.rmtree(Path(tmp) / "c1")
        runs["4x_2"] = run_job(manifest, sources[4], Path(tmp) / "c4", 2)
    passes = lambda r: r["seconds"]["scan"] + r["seconds"]["pack"]
    mb1, mb2 = megabytes[1] / passes(runs["1x_1"]), megabytes[1] / passes(runs["1x_2"])
    limit_in_run = megabytes[1] / runs["1x_1"]["seconds"]["encode_in_pack"]
    fixed_s = max(r["wall_s"] - passes(r) for r in runs.values())
    return {
        "corpus_mb": megabytes[1], "corpus_4x_mb": megabytes[4],
        "mb_per_s": mb2, "mb_per_s_1_worker": mb1, "tokenizer_limit_mb_per_s": limit_in_run,
        "tokenizer_limit_mb_per_s_separate": limit, "vs_tokenizer_limit": mb1 / limit_in_run,
        "vs_tokenizer_limit_separate": mb1 / limit, "speedup_2_workers": mb2 / mb1,
        "peak_rss_mb_1x": runs["1x_2"]["peak_rss_mb"], "peak_rss_mb_4x": runs["4x_2"]["peak_rss_mb"],
        "peak_rss_4x_vs_1x": runs["4x_2"]["peak_rss_mb"] / runs["1x_2"]["peak_rss_mb"],
        "mb_per_s_4x": megabytes[4] / passes(runs["4x_2"]), "fixed_seconds": fixed_s,
        "hours_16gb_2_cores": (16e3 / mb2 + fixed_s) / 3600, "hours_16gb_64_cores": (16e3 / (mb1 * 64) + fixed_s) / 3600,
        "runs": runs,
    }


if __name__ == "__main__":
    sys.exit(main())
