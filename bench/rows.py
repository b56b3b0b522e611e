"""What reading corpus rows costs when a split has more parts than may stay open (`common.corpus.SplitRows`).

    python -m bench.rows [--parts 16] [--rows 40000] [--repeats 2]

A synthetic split of `--parts` parts of 4,000 rows (200-512 tokens) in a temporary folder; `--rows` random rows
(the generator's reading order: a permutation of the corpus) read with every part open, half of them and two,
each `--repeats` times in turn (the first pass also warms the page cache). Prints rows/s and tokens/s and each
rate over the all-open one of the same pass.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common.corpus import CORPUS_FORMAT, SplitRows


def write_split(root: Path, parts: int, rows_per_part: int = 4000, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    (root / "train").mkdir(parents=True)
    records, start = [], 0
    for k in range(parts):
        offsets = np.concatenate([[0], np.cumsum(rng.integers(200, 513, rows_per_part))]).astype(np.int64)
        paths = {kind: f"train/part-{k:05d}.{kind}.npy" for kind in ("tokens", "offsets")}
        np.save(root / paths["tokens"], rng.integers(5, 32000, offsets[-1]).astype(np.int32))
        np.save(root / paths["offsets"], offsets)
        flat = {kind: {"path": path, "bytes": (root / path).stat().st_size} for kind, path in paths.items()}
        records.append({"row_start": start, "rows": rows_per_part, "flat": flat})
        start += rows_per_part
    meta = {"corpus_format": CORPUS_FORMAT, "max_seq_len": 512, "vocab_size": 32000,
            "train": {"parts": records, "rows": start}}
    (root / "corpus.json").write_text(json.dumps(meta))
    return start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rows", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=16)
    parser.add_argument("--rows", type=int, default=40000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        total = write_split(Path(tmp), args.parts)
        ids = np.random.default_rng(1).permutation(total)[:args.rows]
        for repeat in range(args.repeats):
            all_open = None
            for open_parts in (args.parts, max(1, args.parts // 2), 2):
                rows = SplitRows(tmp, "train", open_parts=open_parts)
                t, tokens = time.perf_counter(), 0
                for i in ids:
                    tokens += len(rows[int(i)])
                rate = len(ids) / (time.perf_counter() - t)
                rows.close()
                all_open = all_open or rate
                print(f"pass {repeat + 1}: {open_parts:>3} of {args.parts} parts open: {rate:>9,.0f} rows/s, "
                      f"{tokens * rate / len(ids) / 1e6:5.1f}M tokens/s, {rate / all_open:.2f}x all open", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
