"""Run configuration: small dataclasses, one per stage, loaded from a TOML manifest.

A manifest (``manifests/tiny.toml``) has top-level keys for the run and one table
per stage: ``[corpus] [tokenizer] [model] [aux] [generate] [train]``, plus
``[sweep.train]`` for `make sweep` and ``[reproduce]`` for `make reproduce`. The one loader here
serves every config of the project (fine-tuning's too, `finetune/config.py`):
``extends = "other.toml"`` starts from another file, ``--set KEY=VALUE`` overrides one key on
the command line, every key maps to a dataclass field and an unknown key is an error, never
ignored. The fully resolved config is written beside every output (``resolved_manifest.toml``).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from common.storage import location


class ConfigError(ValueError):
    """A user's mistake in a manifest or on the command line."""


@dataclass
class CorpusConfig:
    source: str = "shakespeare"
    """'shakespeare' (the embedded default), or a file or folder tree of .txt(.gz|.zst), .jsonl(.gz|.zst), .parquet."""
    text_column: str = "text"
    """Field holding the text in .jsonl / Parquet sources."""
    max_seq_len: int = 128
    """Tokens per packed sequence, [CLS] and [SEP] included."""
    min_seq_len: int = 16
    """A document's last chunk shorter than this is dropped."""
    valid_fraction: float = 0.05
    """Fraction of documents held out for validation, decided by each document's hash (at least one)."""
    on_bad_input: str = "stop"
    """A file that is not text, a malformed JSONL line, a null text: 'stop' with an error naming it, or
    'skip' it and report how many were skipped."""
    unit_mb: float = 8.0
    """Source megabytes per work unit: the unit of parallel work, of resume, and one part file per split."""

    def __post_init__(self):
        if self.max_seq_len < 8:
            raise ConfigError(f"corpus.max_seq_len must be >= 8, got {self.max_seq_len}")
        if not 2 <= self.min_seq_len <= self.max_seq_len:
            raise ConfigError(f"corpus.min_seq_len must be in [2, max_seq_len], got {self.min_seq_len}")
        if self.on_bad_input not in ("stop", "skip"):
            raise ConfigError(f"corpus.on_bad_input must be 'stop' or 'skip', got {self.on_bad_input!r}")
        if not self.unit_mb > 0:
            raise ConfigError(f"corpus.unit_mb must be > 0, got {self.unit_mb}")
        if not 0.0 < self.valid_fraction < 0.5:
            raise ConfigError(f"corpus.valid_fraction must be in (0, 0.5), got {self.valid_fraction}")


@dataclass
class TokenizerConfig:
    vocab_size: int = 8000
    """SentencePiece BPE vocabulary size, special tokens included (paper: 128K)."""
    max_sentences: int = 300_000
    """Lines sampled from the corpus to train the tokenizer."""
    max_sample_mb: float = 512.0
    """Millions of characters the tokenizer's sample may hold (the driver holds it at once): each work unit's
    share is bounded in characters as well as lines."""

    def __post_init__(self):
        if self.vocab_size < 300:
            raise ConfigError(f"tokenizer.vocab_size must be >= 300 (byte fallback needs 256), got {self.vocab_size}")
        if not self.max_sample_mb > 0 or self.max_sentences < 1:
            raise ConfigError("tokenizer.max_sample_mb must be > 0 and tokenizer.max_sentences >= 1")


@dataclass
class ModelConfig:
    hidden_size: int = 256
    """Width of every layer (the aux model has the same width)."""
    num_layers: int = 4
    """Depth of the main model."""
    num_heads: int = 4
    """Attention heads."""
    ffn_size: int = 1024
    """Feed-forward inner width."""
    rel_buckets: int = 32
    """T5 relative-position buckets (paper: 32 base, 128 large)."""
    rel_max_distance: int = 128
    """T5 relative-position max distance (paper: 128 base, 256 large)."""
    dropout: float = 0.1
    """Dropout on embeddings, attention probabilities and residual branches."""
    rel_bias_locality: float = 0.0
    """Initial relative-position bias -s_h ln(max(|d|, 1)), slopes s_h from this value (head 0) down to 0
    (last head); 0 = T5's near-zero initialisation (paper). See `RelativePositionBias.init_locality`."""

    def __post_init__(self):
        for key in ("hidden_size", "num_layers", "num_heads", "ffn_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.rel_buckets < 4 or self.rel_max_distance <= self.rel_buckets // 4:
            # T5's bucketing: half the buckets per direction, half of those exact, the rest logarithmic up to
            # rel_max_distance, which must lie past the exact ones
            raise ConfigError(f"model.rel_buckets must be >= 4 and rel_max_distance > rel_buckets / 4, got "
                              f"{self.rel_buckets} and {self.rel_max_distance}")
        if not 0 <= self.rel_bias_locality < math.inf:  # nan fails too
            raise ConfigError(f"model.rel_bias_locality must be a finite number >= 0, got {self.rel_bias_locality}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")


@dataclass
class AuxConfig:
    source: str = ""
    """Empty: `make aux` trains our own auxiliary MLM on the corpus. `hf:PATH`: an existing masked LM in a
    local Hugging Face directory (common/hf.py); its tokenizer then tokenizes the corpus, and the sizes
    below do not apply."""
    num_layers: int = 2
    """Depth of the auxiliary MLM (paper: 4 base, 6 large; same width as the main model)."""
    steps: int = 300
    """MLM training updates for `make aux`."""
    batch_size: int = 32
    """Sequences per update (all ranks, all micro-batches)."""
    micro_batch: int = 0
    """Rows per forward on each device; updates accumulate micro-batches up to `batch_size`
    (0 = a rank's whole share of the batch at once). The pre-flight check refuses one that does not fit."""
    lr: float = 5e-4
    """Peak learning rate (paper section 4.1: 5e-4)."""
    warmup_steps: int = 30
    """Linear warm-up, then linear decay to zero."""
    mask_prob: float = 0.15
    """Fraction of non-special tokens masked per sequence."""
    valid_rows: int = 256
    """Held-out rows scored (MLM loss and top-1) at step 0, every `eval_every` updates and at the end."""
    eval_every: int = 100
    """Validate every N updates."""
    log_every: int = 10
    """Append to the aux run's metrics.jsonl every N updates."""
    ckpt_every: int = 100
    """Checkpoint every N updates (a multiple of log_every); a killed `make aux` resumes from the newest."""

    def __post_init__(self):
        if self.micro_batch < 0 or self.valid_rows < 1 or min(self.eval_every, self.log_every, self.ckpt_every) < 1:
            raise ConfigError("aux.micro_batch must be >= 0, aux.valid_rows, eval_every, log_every and ckpt_every >= 1")
        if self.ckpt_every % self.log_every:
            raise ConfigError(f"aux.ckpt_every ({self.ckpt_every}) must be a multiple of aux.log_every ({self.log_every})")
        if self.source and not self.source.startswith("hf:"):
            raise ConfigError(f"aux.source must be empty (train our own) or hf:PATH, got {self.source!r}")
        if self.num_layers < 1 or self.steps < 1 or self.batch_size < 1:
            raise ConfigError("aux.num_layers, aux.steps and aux.batch_size must be >= 1")
        if not 0.0 < self.mask_prob < 1.0:
            raise ConfigError(f"aux.mask_prob must be in (0, 1), got {self.mask_prob}")
        if not (math.isfinite(self.lr) and self.lr > 0) or self.warmup_steps < 0:
            raise ConfigError(f"aux.lr must be a finite number > 0 and aux.warmup_steps >= 0, got {self.lr} and "
                              f"{self.warmup_steps}")


DISTRIBUTIONS = ("aux", "uniform", "term_frequency", "smoothed_one_hot", "uniform_to_soh", "tf_to_soh")
AUGMENTATIONS = ("temperature", "tf_interpolation", "dropout", "attention_dropout", "drop_token")
SCHEDULES = ("exponential", "constant", "polynomial", "stepwise")


@dataclass
class GenerateConfig:
    epochs: int = 0
    """Epochs of corrupted data to write; 0 = as many as train.max_steps x train.batch_size rows need
    (each epoch a permutation of the corpus rows, the last one partial)."""
    rows_per_epoch: int = 0
    """Rows per epoch: 0 = the whole training split; N = a seeded sample of N rows."""
    rows_per_shard: int = 512
    """Rows per Parquet shard (the unit of work and of resume)."""
    rows_per_row_group: int = 0
    """Rows per Parquet row group (0 = the whole shard): the unit a trainer rank reads, decompresses and
    checks. A divisor of a rank's share of the batch means each rank reads only its own rows."""
    batch_tokens: int = 8192
    """Token budget of one aux forward batch (rows are grouped by length)."""
    mask_prob: float = 0.15
    """Fraction of non-special tokens masked per sequence (paper appendix A: 15%)."""
    t0: float = 2.0
    """Initial temperature T0 (paper eq. 1); temperature scaling's g_max is t0 - 1."""
    tau: float = 0.1
    """Decay rate tau (paper eq. 1); the exponent of 'polynomial', the number of steps of 'stepwise'."""
    temperature_granularity: str = "row"
    """'row': u = global row index / total rows (default); 'epoch': u = epoch / epochs."""
    valid_rows: int = 512
    """Held-out rows corrupted at T = 1 for validation (0 = all)."""
    threads_per_worker: int = 1
    """torch threads per CPU actor; fixed so results never depend on worker count."""
    zstd_level: int = 19
    """zstd level of the shards. 19: ~1.51 bytes/token on tiny's short rows (15: 3.5% more); on 512-token rows
    15 is within 0.2% of 19 at 1.5x the host speed, which base and large use (make bench-generate's table)."""
    tasks_in_flight: int = 0
    """Shards in flight per actor: 0 = 2 on a GPU actor (the next shard's masking and aux forward run
    while the last one is written), 1 on a CPU actor (one core: nothing to overlap). Bytes never change."""
    actors_per_gpu: int = 1
    """GPU actors sharing each GPU, each a process with its own aux model and generation memory (a peak of 6.8 GiB
    measured at the base preset, `make bench-gpu`; the generator checks its estimate before any shard): one
    actor's host side bounds what it gives its GPU. On an H200 at base, 4 gave 1.2x the tokens/s of 1
    (docs/benchmarks.md). Bytes never change."""
    distribution: str = "aux"
    """Replaced-token distribution (paper section 5.1): 'aux' (the aux model, made easier by `augmentation`)
    or, with no aux model, 'uniform', 'term_frequency', 'smoothed_one_hot', 'uniform_to_soh', 'tf_to_soh'."""
    augmentation: str = "temperature"
    """How the aux output is made easier with strength g (appendix C): 'temperature' (T = 1 + g),
    'tf_interpolation' (p_TF^g p_aux^(1-g)), 'dropout', 'attention_dropout' (rate g), 'drop_token'."""
    schedule: str = "exponential"
    """Strength g over u (appendix C): 'exponential' g_max exp(-u/tau), 'constant' g_max,
    'polynomial' g_max (1-u)^tau, 'stepwise' g_max (1 - floor(u tau)/tau)."""
    gamma_max: float = 1.0
    """g at u = 0 for every curriculum but temperature scaling, whose g_max is t0 - 1."""
    soh_alpha: float = 0.35
    """Smoothed one-hot: mass spread evenly over the other tokens (paper section 5.1: 0.35)."""

    def __post_init__(self):
        if self.epochs < 0:
            raise ConfigError(f"generate.epochs must be >= 0, got {self.epochs}")
        for key, least in (("rows_per_epoch", 0), ("rows_per_shard", 1), ("batch_tokens", 1), ("rows_per_row_group", 0),
                           ("valid_rows", 0), ("threads_per_worker", 1)):
            if getattr(self, key) < least:
                raise ConfigError(f"generate.{key} must be >= {least}, got {getattr(self, key)}")
        if not 0.0 < self.mask_prob < 1.0:
            raise ConfigError(f"generate.mask_prob must be in (0, 1), got {self.mask_prob}")
        if not (1.0 <= self.t0 < math.inf and 0.0 < self.tau < math.inf):
            raise ConfigError(f"generate.t0 must be >= 1 and tau > 0, got t0={self.t0} tau={self.tau}")
        if self.tasks_in_flight < 0:
            raise ConfigError(f"generate.tasks_in_flight must be >= 0, got {self.tasks_in_flight}")
        if self.actors_per_gpu < 1:
            raise ConfigError(f"generate.actors_per_gpu must be >= 1, got {self.actors_per_gpu}")
        if not 1 <= self.zstd_level <= 22:
            raise ConfigError(f"generate.zstd_level must be in 1..22, got {self.zstd_level}")
        if self.temperature_granularity not in ("row", "epoch"):
            raise ConfigError(f"generate.temperature_granularity must be 'row' or 'epoch', got {self.temperature_granularity!r}")
        self._check_curriculum()

    def _check_curriculum(self):
        for key, value, known in (("distribution", self.distribution, DISTRIBUTIONS),
                                  ("augmentation", self.augmentation, AUGMENTATIONS),
                                  ("schedule", self.schedule, SCHEDULES)):
            if value not in known:
                raise ConfigError(f"generate.{key} must be one of {', '.join(map(repr, known))}, got {value!r}")
        if self.distribution != "aux" and self.augmentation != "temperature":
            raise ConfigError(f"generate.augmentation = {self.augmentation!r} needs distribution = 'aux' "
                              f"(it changes the aux model), got distribution = {self.distribution!r}")
        if not 0.0 < self.soh_alpha < 1.0:
            raise ConfigError(f"generate.soh_alpha must be in (0, 1), got {self.soh_alpha}")
        if not 0.0 <= self.gamma_max <= 1.0:
            raise ConfigError(f"generate.gamma_max must be in [0, 1], got {self.gamma_max}")
        if self.augmentation in ("dropout", "attention_dropout") and self.gamma_max == 1.0:
            raise ConfigError(f"generate.gamma_max is a {self.augmentation} rate here: it must be < 1")
        if self.schedule == "stepwise" and (self.tau != int(self.tau) or self.tau < 1):
            raise ConfigError(f"generate.tau is the number of steps of the stepwise schedule: a whole number >= 1, "
                              f"got {self.tau}")


OBJECTIVES = ("fast-offline", "fast-online", "electra", "mlm")


def accumulation(batch_size: int, world: int, micro_batch: int, what: str = "train") -> tuple[int, int]:
    """(rows per micro-batch, micro-batches per update) on each of `world` ranks: the batch splits evenly
    over the ranks, a rank's share into micro-batches of `micro_batch` rows (0 = the whole share)."""
    if batch_size % world:
        raise ConfigError(f"{what}.batch_size {batch_size} is not divisible by the {world} ranks")
    share = batch_size // world
    micro = micro_batch or share
    if share % micro:
        raise ConfigError(f"{what}.batch_size {batch_size} over {world} rank(s) is {share} rows per rank, not a "
                          f"multiple of {what}.micro_batch {micro}; choose a micro-batch dividing {share}")
    return micro, share // micro


@dataclass
class TrainConfig:
    batch_size: int = 32
    """Global batch in rows (all ranks, all accumulation micro-steps)."""
    micro_batch: int = 0
    """Rows per forward on each device (0 = a rank's whole share of the batch at once). Accumulation is
    derived: batch_size / (ranks x micro_batch) micro-batches per update, which must divide. The pre-flight
    check refuses, before any work, a micro-batch whose estimated peak memory exceeds the device's."""
    lr: float = 1e-3
    """Peak learning rate (paper appendix A: 1e-3 for Fast-ELECTRA)."""
    warmup_steps: int = 20
    """Linear warm-up steps, then linear decay to zero at the last step."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    """Adam (beta1, beta2)."""
    eps: float = 1e-6
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay on matrices (not on biases and LayerNorm)."""
    clip_norm: float = 2.0
    """Gradient clipping by global norm (inf: none)."""
    rel_bias_lr_scale: float = 1.0
    """Learning-rate multiplier of the relative-position bias table (1 = paper; reproduce.toml: 100)."""
    embed_lr_scale: float = 1.0
    """Learning-rate multiplier of the token embeddings (1 = paper; reproduce.toml: 30)."""
    max_steps: int = 0
    """Stop after this many updates (0 = all rows of all epochs)."""
    eval_every: int = 50
    """Validate every N updates (and at step 0 and at the end)."""
    log_every: int = 10
    """Append to metrics.jsonl every N updates."""
    ckpt_every: int = 100
    """Checkpoint every N updates (and at the end)."""
    keep_checkpoints: int = 3
    """Keep the newest K checkpoints."""
    verify_shards: bool = False
    """Also hash this rank's share of the shards against the manifest before the first update. Without it
    (the default) what a rank reads is checked as it is read: every Parquet page carries a CRC32, so a
    damaged row group stops the run naming its shard before the update that would use it."""
    allow_short_stream: bool = False
    """Train on a stream shorter than max_steps x batch_size rows (fewer steps) instead of refusing it."""
    max_nonfinite_steps: int = 5
    """Stop the run after this many non-finite losses in a row (each one skips its update)."""
    seed: int = 0
    """Seed for initialisation and dropout (data order is fixed by the shards)."""
    objective: str = "fast-offline"
    """'fast-offline': RTD on the shards (the product); 'fast-online': the frozen aux model corrupts
    each batch in the loop (same plan and code as generate/); 'electra': the original joint training;
    'mlm': the auxiliary masked LM itself (what `make aux` runs, with [train] composed from [aux])."""
    electra_lambda: float = 50.0
    """'electra' only: loss = MLM + lambda * RTD (paper section 2; appendix A, METRO-ReImp: 70 base, 50 large)."""
    tensorboard: bool = False
    """Also write metrics.jsonl's scalars as TensorBoard events in the run's `tensorboard/` (the `tensorboard`
    extra)."""
    compile: str = "auto"
    """The model's forward and backward under torch.compile: "on", "off", or "auto" = on where it measured
    faster (a GPU), off on CPU (docs/benchmarks.md, "torch.compile")."""
    attention: str = "auto"
    """The attention with the learned relative-position bias in training: "auto" = common/attention.py's fused
    kernel on a GPU where Triton is installed (measured faster there: docs/benchmarks.md), SDPA elsewhere;
    "sdpa" = torch's scaled_dot_product_attention everywhere."""

    def __post_init__(self):
        if self.compile not in ("auto", "on", "off"):
            raise ConfigError(f"train.compile must be 'auto', 'on' or 'off', got {self.compile!r}")
        if self.attention not in ("auto", "sdpa"):
            raise ConfigError(f"train.attention must be 'auto' or 'sdpa', got {self.attention!r}")
        for key in ("lr", "eps", "rel_bias_lr_scale", "embed_lr_scale"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) > 0):
                raise ConfigError(f"train.{key} must be a finite number > 0, got {getattr(self, key)}")
        for key in ("weight_decay", "electra_lambda"):  # electra_lambda 0: the generator's MLM alone
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) >= 0):
                raise ConfigError(f"train.{key} must be a finite number >= 0, got {getattr(self, key)}")
        if not self.clip_norm > 0:  # inf: no clipping; `not > 0` also refuses NaN
            raise ConfigError(f"train.clip_norm must be > 0 (inf: no clipping), got {self.clip_norm}")
        for key in ("warmup_steps", "max_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key} must be >= 0, got {getattr(self, key)}")
        if self.max_nonfinite_steps < 1:
            raise ConfigError(f"train.max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"train.objective must be one of {', '.join(map(repr, OBJECTIVES))}, got {self.objective!r}")
        if self.batch_size < 1 or self.micro_batch < 0:
            raise ConfigError("train.batch_size must be >= 1 and train.micro_batch >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"train.betas must be two numbers in [0, 1), got {self.betas}")
        if self.keep_checkpoints < 1:
            raise ConfigError("train.keep_checkpoints must be >= 1")
        if min(self.eval_every, self.log_every, self.ckpt_every) < 1:
            raise ConfigError("train.eval_every, log_every and ckpt_every must be >= 1")
        if self.ckpt_every % self.log_every:
            # a resumed run restarts its logging window at the checkpoint; windows must align
            raise ConfigError(f"train.ckpt_every ({self.ckpt_every}) must be a multiple of log_every ({self.log_every})")


@dataclass
class SweepConfig:
    """`make sweep`: a grid of trainer settings, each trained on the same shards."""
    train: dict[str, list] = field(default_factory=dict)
    """[sweep.train] key = [values, ...] for any [train] key, e.g. lr = [5e-4, 1e-3, 2e-3]."""

    def __post_init__(self):
        names = {f.name for f in dataclasses.fields(TrainConfig)}
        for key, values in self.train.items():
            if key not in names:
                raise ConfigError(f"sweep.train.{key} is not a [train] key; known: {', '.join(sorted(names))}")
            if not isinstance(values, list) or not values:
                raise ConfigError(f"sweep.train.{key} must be a non-empty list of values, got {values!r}")


REPRODUCE_METHODS = ("electra", "fast-offline", "fixed-aux", "term-frequency", "none")


@dataclass
class ReproduceConfig:
    """`make reproduce`: one wall-clock pre-training budget per method, then fine-tuning (experiments/reproduce.py)."""
    budget_s: float = 600.0
    """Wall-clock seconds per method, generation included (start of generation to last checkpoint)."""
    methods: list[str] = field(default_factory=lambda: list(REPRODUCE_METHODS))
    """Any of 'electra', 'fast-offline', 'fixed-aux' (aux at T = 1), 'term-frequency', 'none' (no pre-training)."""
    checkpoints: int = 3
    """Checkpoints fine-tuned per method, at equal fractions of its planned updates (the last at the end)."""
    plan_fraction: float = 0.9
    """Updates are planned for this fraction of the budget from measured speeds; the trainer stops at the budget."""
    trainer_startup_s: float = 10.0
    """Budget set aside for the trainer's start (torchrun, data, step-0 evaluation; ~10 s measured on 2 CPU cores)."""
    generation_startup_s: float = 15.0
    """Budget set aside for the generation job's start (Ray, actors; ~13 s measured on 2 CPU cores)."""
    finetune: dict = field(default_factory=dict)
    """[finetune] keys for every fine-tuning run (finetune/config.py), e.g. max_steps, seeds, grid.lr."""

    def __post_init__(self):
        if not self.budget_s > 0:
            raise ConfigError(f"reproduce.budget_s must be > 0, got {self.budget_s}")
        unknown = [m for m in self.methods if m not in REPRODUCE_METHODS]
        if unknown or not self.methods or len(set(self.methods)) != len(self.methods):
            raise ConfigError(f"reproduce.methods must be distinct names from {', '.join(REPRODUCE_METHODS)}, "
                              f"got {self.methods}")
        if self.checkpoints < 1:
            raise ConfigError(f"reproduce.checkpoints must be >= 1, got {self.checkpoints}")
        if not 0.0 < self.plan_fraction <= 1.0:
            raise ConfigError(f"reproduce.plan_fraction must be in (0, 1], got {self.plan_fraction}")
        if not (0 <= self.trainer_startup_s < math.inf and 0 <= self.generation_startup_s < math.inf):
            raise ConfigError("reproduce.trainer_startup_s and generation_startup_s must be finite numbers >= 0")


@dataclass
class RunConfig:
    name: str = "tiny"
    """Name of the preset; outputs go to work_dir."""
    work_dir: str = "work/tiny"
    """Default home of corpus/, aux/, epochs/ and runs/ (relative to the repository)."""
    seed: int = 1234
    """Seed for data splits, masking and sampling."""
    shared_dir: str = ""
    """Home of corpus/ and aux/ if not work_dir: the ablations share the tiny preset's, so they share one aux model."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    aux: AuxConfig = field(default_factory=AuxConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    reproduce: ReproduceConfig = field(default_factory=ReproduceConfig)

    # Default locations of each stage's output.
    def __post_init__(self):
        if self.seed < 0:  # numpy's seeding and the corpus's keyed hashes take unsigned integers
            raise ConfigError(f"seed must be >= 0, got {self.seed}")

    @property
    def corpus_dir(self) -> Path:
        return location(self.shared_dir or self.work_dir) / "corpus"  # a folder or an s3:// prefix

    @property
    def aux_dir(self) -> Path:
        return location(self.shared_dir or self.work_dir) / "aux"  # a folder or an s3:// prefix

    @property
    def epochs_dir(self) -> Path:
        return location(self.work_dir) / "epochs"

    @property
    def run_dir(self) -> Path:
        return location(self.work_dir) / "runs" / "default"  # the trainer refuses one on object storage


def build_config(cls, data: dict, where: str = ""):
    """Build dataclass `cls` from `data`, refusing unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where.rstrip('.') or 'manifest'} must be a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown manifest key(s) {', '.join(where + k for k in unknown)}; "
                          f"known in {where.rstrip('.') or 'top level'}: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build_config(hint, value, f"{where}{name}.")
            continue
        kwargs[name] = _coerce(value, hint, where + name)
    return cls(**kwargs)


def _coerce(value, hint, key):
    origin = typing.get_origin(hint) or hint
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {value!r}")
        return dict(value)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(v, item, key) for v in value]
    if not isinstance(value, origin) or (origin is int and isinstance(value, bool)):
        if origin is str:  # a TOML string is quoted: `--set train.compile=true` reads a boolean
            raise ConfigError(f"{key} must be a string (quoted in TOML), got {value!r}")
        raise ConfigError(f"{key} must be {origin.__name__}, got {value!r}")
    return value


def config_from_dict(data: dict) -> RunConfig:
    return build_config(RunConfig, data, "")


def merge_tables(base: dict, override: dict) -> dict:
    """`override` on top of `base`, key by key, into nested tables."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_tables(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_toml(path: str | Path, chain: tuple = ()) -> dict:
    """A config file's tables; `extends = "other.toml"` (relative to this file) starts from another
    file and overrides it key by key, table by table."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"manifest {path} is a folder, not a TOML file (e.g. {path / 'tiny.toml'})")
    if not path.is_file():
        raise ConfigError(f"manifest {path} does not exist" + (f" (extended by {chain[-1]})" if chain else
                          " (relative to the current folder: run from the repository, or give its path)"
                          if not path.is_absolute() else ""))
    if path.resolve() in chain:
        raise ConfigError(f"manifest {path} extends itself through {' -> '.join(map(str, chain))}")
    with path.open("rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"manifest {path} is not valid TOML: {e}") from e
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: extends must be a path, got {base!r}")
    return merge_tables(read_toml(path.parent / base, chain + (path.resolve(),)), data)


def parse_set(assignment: str) -> tuple[list[str], object]:
    """'train.lr=2e-3' -> (['train', 'lr'], 0.002); a value that is not TOML is a string."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE, got {assignment!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_sets(data: dict, sets=()) -> dict:
    """A copy of `data` with each `--set KEY=VALUE` applied (dotted keys reach into tables)."""
    data = copy.deepcopy(data)
    for assignment in sets:
        keys, value = parse_set(assignment)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {assignment!r}: {k} is not a table")
        if len(keys) == 1 and isinstance(value, dict) and isinstance(node.get(keys[0]), dict):
            node[keys[0]] = merge_tables(node[keys[0]], value)  # a section, key by key as `extends` does
        else:
            node[keys[-1]] = value
    return data


def add_manifest_argument(parser: argparse.ArgumentParser, default: str = "manifests/tiny.toml") -> None:
    parser.add_argument("--manifest", default=default, help="the run manifest, TOML (default: %(default)s)")


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                        help="override one manifest key, e.g. --set train.lr=2e-3 (repeatable)")


def load_manifest(path: str | Path, sets=()) -> RunConfig:
    data = apply_sets(read_toml(path), sets)
    try:
        return config_from_dict(data)
    except ConfigError as e:
        raise ConfigError(named_error(path, e, sets)) from e


_KEY_IN_MESSAGE = re.compile(r"^(?:unknown manifest key\(s\) )?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def named_error(path: str | Path, error: ConfigError, sets=(), prefix: str = "") -> str:
    """`error` (a value refused in the config read from `path`) naming the file, and where the key
    was set when that is elsewhere: a file `path` extends, or a `--set` (`prefix`: the table the
    checked keys live under, `finetune.` for a fine-tuning config)."""
    message = str(error)
    match = _KEY_IN_MESSAGE.match(message)
    origin = None
    if match and match.group(1).startswith(prefix):
        origin = _origin(Path(path), match.group(1).split("."), prefix, sets)
    return f"{path}: {message}" + (f" (set {origin})" if origin else "")


def _origin(path: Path, keys: list[str], prefix: str, sets) -> str | None:
    """Where `keys` (a dotted key, split) got its value, when not in `path` itself; a `--set` names
    its key without `prefix`."""
    relative = keys[len(prefix.split(".")) - 1:]
    for assignment in reversed(list(sets) if relative else []):  # `finetune: ...` names no one key
        set_keys = parse_set(assignment)[0]
        if relative[:len(set_keys)] == set_keys or set_keys[:len(relative)] == relative:
            return f"by --set {assignment}"
    chain, current = [], path
    while current is not None and current.is_file() and current not in chain:
        chain.append(current)
        try:
            with current.open("rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError):
            return None
        node = data
        for k in keys:
            if not isinstance(node, dict) or k not in node:
                break
            node = node[k]
        else:
            return None if current == path else f"in {current}, which {path} extends"
        base = data.get("extends")
        current = current.parent / base if isinstance(base, str) else None
    return None


def config_to_dict(config: RunConfig) -> dict:
    return dataclasses.asdict(config)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf") if not math.isnan(value) else "nan"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dump_toml(config: RunConfig) -> str:
    """The resolved config as TOML that `load_manifest` reads back to an equal config."""
    data = config_to_dict(config)
    top = [f"{k} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    tables = []
    for k, v in data.items():
        if isinstance(v, dict):
            tables.append(f"\n[{k}]\n" + "\n".join(f"{kk} = {toml_value(vv)}" for kk, vv in v.items()))
    return "\n".join(top) + "\n" + "\n".join(tables) + "\n"


RESOLVED_FILE = "resolved_manifest.toml"


def save_resolved(config: RunConfig, out_dir: str | Path) -> Path:
    from common.io import atomic_write_text
    from common.storage import location
    return atomic_write_text(location(out_dir) / RESOLVED_FILE, dump_toml(config))


# Settings that do not change what a training run computes: where outputs go, how often it logs,
# evaluates and checkpoints, and the tables of other commands (`make sweep`, `make reproduce`).
# Resume compares everything else.
NOT_TRAJECTORY = ("name", "work_dir", "shared_dir", "sweep", "reproduce")
NOT_TRAJECTORY_TRAIN = ("eval_every", "log_every", "ckpt_every", "keep_checkpoints", "max_nonfinite_steps",
                        "allow_short_stream", "verify_shards", "tensorboard")
NOT_TRAJECTORY_AUX = ("eval_every", "log_every", "ckpt_every")  # the aux run's own intervals
# [generate] settings that only schedule the work: outside the generation key (common.plan) and the resume check
SCHEDULING_ONLY = ("tasks_in_flight", "actors_per_gpu")


# the replaced-token distributions whose strength follows a schedule: the aux model's curricula and the two
# interpolations to the smoothed one-hot (appendix B); the others are fixed (`common.plan.has_schedule`)
SCHEDULED_DISTRIBUTIONS = ("aux", "uniform_to_soh", "tf_to_soh")


def generation_settings(generate: dict) -> dict:
    """[generate] (a dict, `config_to_dict`'s) as the shards' bytes depend on it: without the keys that only
    schedule the work, and the keys the chosen curriculum never reads at their defaults (`t0` of a uniform
    stream, `gamma_max` under temperature scaling, `soh_alpha` outside the smoothed one-hot ones), so editing
    one of those regenerates nothing and a config that never touched them keeps the key it had."""
    defaults = dataclasses.asdict(GenerateConfig())
    kept = {k: v for k, v in generate.items() if k not in SCHEDULING_ONLY}
    distribution = kept.get("distribution", defaults["distribution"])
    temperature = distribution == "aux" and kept.get("augmentation", defaults["augmentation"]) == "temperature"
    scheduled = distribution in SCHEDULED_DISTRIBUTIONS
    unused = ["augmentation"] if distribution != "aux" else []
    unused += [] if temperature else ["t0"]
    unused += ["gamma_max"] if temperature or not scheduled else []
    unused += [] if scheduled else ["schedule", "tau", "temperature_granularity"]
    unused += [] if "soh" in distribution else ["soh_alpha"]
    return {k: defaults[k] if k in unused else v for k, v in kept.items()}


def trajectory_config(data: dict) -> dict:
    """The part of a config dict (`config_to_dict`) that decides a run's updates, for resume. The `mlm`
    objective (the aux model's run) reads neither [generate] nor the RTD loss's weight: every ablation edits
    [generate] and shares one aux run; only `electra` reads the RTD loss's weight."""
    kept = {k: v for k, v in data.items() if k not in NOT_TRAJECTORY}
    kept["train"] = {k: v for k, v in kept["train"].items() if k not in NOT_TRAJECTORY_TRAIN}
    kept["aux"] = {k: v for k, v in kept["aux"].items() if k not in NOT_TRAJECTORY_AUX}
    kept["generate"] = generation_settings(kept["generate"])
    if kept["train"].get("objective") != "electra":
        kept["train"].pop("electra_lambda", None)
    if kept["train"].get("objective") == "mlm":
        del kept["generate"]
    return kept


# What a run may change when it resumes, its updates the same up to rounding: the micro-batch (the memory check
# asks it of a run resumed on smaller GPUs), torch.compile and the attention's kernel (turned off or changed after
# one failed); and where the raw text was read from (the rows are the corpus's, in the data's key).
RESUME_MAY_CHANGE = {"train": ("micro_batch", "compile", "attention"), "corpus": ("source",)}


def resume_trajectory(data: dict) -> dict:
    """`trajectory_config` less RESUME_MAY_CHANGE: what a resumed run must share with its checkpoint, and a
    finished run with a sweep's combination that it stands for."""
    kept = trajectory_config(data)
    for table, keys in RESUME_MAY_CHANGE.items():
        kept[table] = {k: v for k, v in kept[table].items() if k not in keys}
    return kept


def changed_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted names of the keys whose values differ between two config dicts."""
    keys = []
    for k in sorted(set(a) | set(b)):
        if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            keys += changed_keys(a[k], b[k], f"{prefix}{k}.")
        elif a.get(k) != b.get(k):
            keys.append(prefix + k)
    return keys
