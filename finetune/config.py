"""Configuration of `python -m finetune` (paper appendix A, table "Hyperparameter search
space in fine-tuning"): one dataclass per part, built from a TOML `[finetune]` table and
`--set key=value` overrides, unknown keys refused.

The paper's search space (base and large alike):
    lr {5e-5, 1e-4, 3e-4}, epochs {2, 3, 5, 10}, batch size {16, 32, 64},
    weight decay {0, 0.01}, warm-up {6%, 10%}; AdaMax (0.9, 0.98), eps 1e-6, linear decay,
    gradient clipping 1.0, dropout 0.1, sequence length 256.
All 144 points times several seeds is far beyond a CPU budget, so the default grid sweeps the
learning rate only, at one value of each other axis taken from that space; every axis is a list
and can be widened (`--set grid.epochs=[2,3,5,10]`).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ConfigError, apply_sets, build_config, named_error, read_toml, toml_value
from finetune.glue import METRICS, glue_layout

BUILTIN_TASKS = ("rotten_tomatoes",)


@dataclass
class TaskConfig:
    path: str = "rotten_tomatoes"
    """Task folder with the TSV files, or 'rotten_tomatoes' (built in, prepared under --tasks-dir)."""
    train_file: str = "train.tsv"
    """Training split, inside `path`."""
    dev_file: str = "dev.tsv"
    """Evaluation split, inside `path` (GLUE dev sets; test sets have no labels)."""
    columns: list[str] = field(default_factory=list)
    """Column names of headerless files (GLUE's CoLA); empty = the first line is the header."""
    text_a: str = "sentence"
    """Column of the first (or only) sentence."""
    text_b: str = ""
    """Column of the second sentence of a pair task; empty = single-sentence task."""
    label: str = "label"
    """Column of the label (a class name, or a number for regression)."""
    regression: bool = False
    """True: the label is a score (STS-B), one output, MSE loss."""
    labels: list[str] = field(default_factory=list)
    """Class names in order (empty: the training file's, sorted); the second is F1's positive class."""
    metric: str = ""
    """Metric that picks the best grid point; empty: 'spearman' for regression, else 'accuracy'."""
    train_examples: int = 0
    """Train on a seeded sample of this many training examples (0 = all): few-label fine-tuning."""

    def __post_init__(self):
        if self.metric and self.metric not in METRICS:
            raise ConfigError(f"finetune.task.metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if self.regression and self.metric not in ("", "spearman", "pearson"):
            raise ConfigError(f"finetune.task.metric {self.metric!r} does not apply to a regression task")
        if not self.regression and self.metric in ("spearman", "pearson"):
            raise ConfigError(f"finetune.task.metric {self.metric!r} needs task.regression = true")
        if self.train_examples < 0:
            raise ConfigError(f"finetune.task.train_examples must be >= 0, got {self.train_examples}")
        if self.labels and len(set(self.labels)) != len(self.labels) or len(self.labels) == 1:
            raise ConfigError(f"finetune.task.labels must be at least 2 distinct names, got {self.labels}")
        if self.metric == "f1" and len(self.labels) > 2:
            raise ConfigError(f"finetune.task.metric = 'f1' needs a task of two labels, got {self.labels}")

    @property
    def selection_metric(self) -> str:
        return self.metric or ("spearman" if self.regression else "accuracy")


@dataclass
class GridConfig:
    lr: list[float] = field(default_factory=lambda: [5e-5, 1e-4, 3e-4])
    """Peak learning rates (paper: {5e-5, 1e-4, 3e-4})."""
    epochs: list[int] = field(default_factory=lambda: [3])
    """Training epochs (paper: {2, 3, 5, 10})."""
    batch_size: list[int] = field(default_factory=lambda: [32])
    """Examples per update (paper: {16, 32, 64})."""
    weight_decay: list[float] = field(default_factory=lambda: [0.01])
    """Decoupled weight decay on matrices (paper: {0, 0.01})."""
    warmup_fraction: list[float] = field(default_factory=lambda: [0.06])
    """Linear warm-up as a fraction of the updates (paper: {6%, 10%})."""

    def __post_init__(self):
        for name in ("lr", "epochs", "batch_size", "weight_decay", "warmup_fraction"):
            values = getattr(self, name)
            if not values:
                raise ConfigError(f"finetune.grid.{name} must hold at least one value")
            if len(set(values)) != len(values):
                raise ConfigError(f"finetune.grid.{name} repeats a value: {values}")
        if (not all(0 < v < math.inf for v in self.lr) or min(self.epochs) < 1 or min(self.batch_size) < 1
                or not all(0 <= v < math.inf for v in self.weight_decay)):  # nan fails the comparisons
            raise ConfigError("finetune.grid: lr > 0, epochs >= 1, batch_size >= 1, weight_decay >= 0 (finite)")
        if not all(0.0 <= w < 1.0 for w in self.warmup_fraction):
            raise ConfigError(f"finetune.grid.warmup_fraction must be in [0, 1), got {self.warmup_fraction}")

    def points(self) -> list[dict]:
        """Every combination, in a fixed order (lr fastest)."""
        keys = ("batch_size", "epochs", "weight_decay", "warmup_fraction", "lr")
        return [dict(zip(keys, values)) for values in itertools.product(*(getattr(self, k) for k in keys))]


@dataclass
class FinetuneConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    grid: GridConfig = field(default_factory=GridConfig)
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    """One run per seed and grid point (head initialisation, data order, dropout; and the encoder
    itself under --init none); results are the median and spread over them."""
    max_seq_len: int = 256
    """Tokens per example, [CLS] and [SEP]s included; pairs are truncated longest-first."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    """AdaMax (beta1, beta2)."""
    eps: float = 1e-6
    """AdaMax epsilon."""
    clip_norm: float = 1.0
    """Gradient clipping by global norm."""
    dropout: float = -1.0
    """Dropout of the encoder and the classification head; < 0: the pre-trained model's own (its manifest's
    `model.dropout`: 0.1 for base and large, as the paper's fine-tuning, 0 for the tiny preset). A model
    pre-trained without dropout fits a few labels more slowly under dropout it never saw (docs/experiments.md)."""
    max_steps: int = 0
    """Cap on updates per run, the schedule shortened to match (0 = all epochs; for smoke tests)."""
    eval_batch_size: int = 64
    """Examples per forward pass at evaluation."""
    length_pool: int = 50
    """Batches per length pool: each epoch's seeded shuffle is cut into pools of this many batches,
    a pool is sorted by length and cut into batches, and the batches are shuffled, so a batch pads
    to rows of similar length (Rotten Tomatoes: 1.9x fewer tokens). 1 = plain random batches."""
    embedding_row_rms: float = 0.02
    """Every run first sets each token-embedding row to this RMS (the initialisation's scale), which
    does not change the model's function (the rows pass through a LayerNorm) but lets AdaMax turn
    rows that pre-training grew as fast as fresh ones (`finetune.rescale_embedding_rows`). 0 = keep."""

    def __post_init__(self):
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ConfigError(f"finetune.seeds must be distinct numbers >= 0, at least one, got {self.seeds}")
        if self.max_seq_len < 4:
            raise ConfigError(f"finetune.max_seq_len must be >= 4, got {self.max_seq_len}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"finetune.betas must be two numbers in [0, 1), got {self.betas}")
        if not 0 < self.eps < math.inf:
            raise ConfigError(f"finetune.eps must be a finite number > 0, got {self.eps}")
        if not 0 < self.clip_norm <= math.inf:
            raise ConfigError(f"finetune.clip_norm must be > 0 (inf: no clipping), got {self.clip_norm}")
        if not self.dropout < 1.0:
            raise ConfigError(f"finetune.dropout must be < 1 (negative: the pre-trained model's), got {self.dropout}")
        if not 0 <= self.embedding_row_rms < math.inf:
            raise ConfigError(f"finetune.embedding_row_rms must be a finite number >= 0, got {self.embedding_row_rms}")
        for key, least in (("max_steps", 0), ("eval_batch_size", 1), ("length_pool", 1)):
            if getattr(self, key) < least:
                raise ConfigError(f"finetune.{key} must be >= {least}, got {getattr(self, key)}")


def resolve_config(toml_path: str | Path | None = None, sets: list[str] = (),
                   task: str | None = None, table: dict | None = None) -> FinetuneConfig:
    """Defaults < the GLUE layout of the task folder's name < the TOML's [finetune] (or `table`, the
    same keys as a dict) < --set < --task."""
    data: dict = copy.deepcopy(table) if table else {}
    if toml_path:
        whole = read_toml(toml_path)  # the project's one loader: `extends` works here too
        if not isinstance(whole.get("finetune"), dict):
            raise ConfigError(f"fine-tuning config {toml_path} has no [finetune] table")
        data = whole["finetune"]
    data = apply_sets(data, sets)
    task_table = data.setdefault("task", {})
    if not isinstance(task_table, dict):
        raise ConfigError("finetune.task must be a table")
    if task:
        task_table["path"] = task
    data["task"] = {**glue_layout(task_table.get("path", TaskConfig.path)), **task_table}
    try:
        return build_config(FinetuneConfig, data, "finetune.")
    except ConfigError as e:
        if not toml_path:
            raise
        raise ConfigError(named_error(toml_path, e, sets, prefix="finetune.")) from e


def dump_toml(config: FinetuneConfig) -> str:
    """The resolved config as a `--config` file that resolves to an equal config."""
    data = dataclasses.asdict(config)
    out = ["[finetune]"] + [f"{k} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for name in ("task", "grid"):
        out += ["", f"[finetune.{name}]"] + [f"{k} = {toml_value(v)}" for k, v in data[name].items()]
    return "\n".join(out) + "\n"
