"""Downstream tasks in GLUE's TSV layout, and their metrics (paper section 4.1: Spearman on
STS-B, Matthews correlation on CoLA, accuracy on the rest; F1 as GLUE reports it for MRPC/QQP).

A task is a folder with `train.tsv` and `dev.tsv`: one example a line, tab-separated, a
header line naming the columns (or, for headerless files like CoLA, the column names given
in the task config). A sentence-pair task names a second text column; a regression task
(STS-B) has a numeric label. Fields are split on tabs only, never unquoted (GLUE's files
hold bare quotes). The metrics are plain numpy, written out here so they can be checked
against hand-computed values (tests/test_finetune.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

METRICS = ("accuracy", "f1", "matthews", "spearman", "pearson")

# Layouts of the GLUE folders as downloaded (folder name -> task keys). Used as defaults when
# the task folder has one of these names; the user's [finetune.task] keys override them.
GLUE_LAYOUTS = {
    "cola": {"columns": ["source", "label", "original_label", "sentence"], "metric": "matthews"},
    "sst2": {},
    "mrpc": {"text_a": "#1 String", "text_b": "#2 String", "label": "Quality"},
    "stsb": {"text_a": "sentence1", "text_b": "sentence2", "label": "score", "regression": True,
             "metric": "spearman"},
    "qqp": {"text_a": "question1", "text_b": "question2", "label": "is_duplicate"},
    "mnli": {"text_a": "sentence1", "text_b": "sentence2", "label": "gold_label", "dev_file": "dev_matched.tsv"},
    "qnli": {"text_a": "question", "text_b": "sentence"},
    "rte": {"text_a": "sentence1", "text_b": "sentence2"},
    "wnli": {"text_a": "sentence1", "text_b": "sentence2"},
}


class TaskError(ValueError):
    """A task file is missing, empty or malformed (missing column, unknown label, bad row)."""


def glue_layout(folder: str | Path) -> dict:
    """The GLUE layout for a folder named like a GLUE task ('CoLA', 'STS-B', ...), else {}."""
    key = Path(folder).name.lower().replace("-", "").replace("_", "")
    return dict(GLUE_LAYOUTS.get(key, {}))


@dataclass
class Examples:
    """One split of a task: texts, and labels as class indices (int64) or scores (float32)."""
    text_a: list[str]
    text_b: list[str] | None
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.text_a)


def read_tsv(path: Path, columns: list[str]) -> tuple[list[str], list[list[str]], list[int]]:
    """(column names, rows, each row's line number in the file) of a TSV file; `columns` names the fields of a
    headerless file. Blank lines are skipped (and counted)."""
    if not path.is_file():
        raise TaskError(f"task file {path} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise TaskError(f"{path}:{line} is not UTF-8 text (byte {raw[e.start]:#04x}); save the file as UTF-8") from None
    lines = [(n, l[:-1] if l.endswith("\r") else l) for n, l in enumerate(text.split("\n"), 1) if l.strip()]
    header = list(columns) if columns else (lines.pop(0)[1].split("\t") if lines else [])
    if not lines:
        raise TaskError(f"task file {path} holds no examples")
    rows = []
    for number, line in lines:
        fields = line.split("\t")
        if len(fields) < len(header):
            raise TaskError(f"{path}:{number} has {len(fields)} tab-separated fields, the header has "
                            f"{len(header)} ({', '.join(header)})")
        rows.append(fields)
    return header, rows, [n for n, _ in lines]


def read_split(path: Path, columns: list[str], text_a: str, text_b: str, label: str, regression: bool,
               label_names: list[str] | None) -> tuple[Examples, list[str]]:
    """Read one split. Classification labels map to indices of `label_names` (None: the sorted
    labels of this file, numerically if they are all integers); returns the names used."""
    header, rows, numbers = read_tsv(path, columns)
    wanted = [c for c in (text_a, text_b, label) if c]
    missing = [c for c in wanted if c not in header]
    if missing:
        raise TaskError(f"{path} has no column(s) {', '.join(map(repr, missing))}; "
                        f"columns: {', '.join(map(repr, header))}")
    ia, il = header.index(text_a), header.index(label)
    ib = header.index(text_b) if text_b else None
    raw_labels = [r[il].strip() for r in rows]
    for number, value in zip(numbers, raw_labels):  # an empty label would be a class of its own
        if not value:
            raise TaskError(f"{path}:{number} has no label (its {label!r} field is empty)")
    if regression:
        try:
            labels = np.array([float(v) for v in raw_labels], dtype=np.float32)
        except ValueError as e:
            raise TaskError(f"{path}: a regression label is not a number ({e})") from e
        if not np.isfinite(labels).all():
            number = numbers[int(np.flatnonzero(~np.isfinite(labels))[0])]
            raise TaskError(f"{path}:{number} has a regression label that is not a finite number")
        names = []
    else:
        names = list(label_names) if label_names else sort_labels(set(raw_labels))
        index = {name: i for i, name in enumerate(names)}
        unknown = sorted(set(raw_labels) - set(index))
        if unknown:
            raise TaskError(f"{path} has label(s) {', '.join(map(repr, unknown[:5]))} not among the "
                            f"task's labels {names}")
        if len(names) < 2:
            raise TaskError(f"{path}: a classification task needs at least 2 labels, found {names}")
        labels = np.array([index[v] for v in raw_labels], dtype=np.int64)
    texts_b = [r[ib] for r in rows] if ib is not None else None
    return Examples([r[ia] for r in rows], texts_b, labels), names


def sort_labels(labels: set[str]) -> list[str]:
    try:
        return sorted(labels, key=int)
    except ValueError:
        return sorted(labels)


# --- metrics (numpy only) ---------------------------------------------------------

def accuracy(predicted: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean(predicted == truth))


def f1_score(predicted: np.ndarray, truth: np.ndarray, positive: int = 1) -> float:
    """F1 of the positive class: 2 TP / (2 TP + FP + FN); 0 when there is no positive at all."""
    tp = int(np.sum((predicted == positive) & (truth == positive)))
    fp = int(np.sum((predicted == positive) & (truth != positive)))
    fn = int(np.sum((predicted != positive) & (truth == positive)))
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def matthews_corrcoef(predicted: np.ndarray, truth: np.ndarray, num_classes: int | None = None) -> float:
    """Matthews correlation, K classes (Gorodkin 2004): with confusion matrix C, c = trace,
    s = total, t = true counts, p = predicted counts,
    MCC = (c s - t.p) / sqrt((s^2 - p.p)(s^2 - t.t)); 0 when a factor is 0 (one class only)."""
    k = num_classes or int(max(predicted.max(), truth.max())) + 1
    confusion = np.zeros((k, k), dtype=np.float64)
    np.add.at(confusion, (truth.astype(np.int64), predicted.astype(np.int64)), 1)
    t, p = confusion.sum(axis=1), confusion.sum(axis=0)
    c, s = np.trace(confusion), confusion.sum()
    denominator = math.sqrt((s * s - p @ p) * (s * s - t @ t))
    return float((c * s - t @ p) / denominator) if denominator else 0.0


def rank_average(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, tied values sharing the average of their ranks."""
    order = np.argsort(values, kind="stable")
    _, first, counts = np.unique(values[order], return_index=True, return_counts=True)
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)
    return ranks


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; nan when either side is constant."""
    dx, dy = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float(dx @ dx) * float(dy @ dy))
    return float(dx @ dy / denominator) if denominator else float("nan")


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman correlation: Pearson of the tie-averaged ranks."""
    return pearson(rank_average(np.asarray(x, dtype=np.float64)), rank_average(np.asarray(y, dtype=np.float64)))


def task_metrics(predictions: np.ndarray, truth: np.ndarray, num_labels: int) -> dict:
    """All metrics that apply: regression (num_labels == 1) -> Spearman, Pearson; classification ->
    accuracy, Matthews, and F1 of label 1 when the task is binary."""
    if num_labels == 1:
        return {"spearman": spearman(predictions, truth), "pearson": pearson(predictions.astype(np.float64),
                                                                             truth.astype(np.float64))}
    out = {"accuracy": accuracy(predictions, truth), "matthews": matthews_corrcoef(predictions, truth, num_labels)}
    if num_labels == 2:
        out["f1"] = f1_score(predictions, truth, positive=1)
    return out
