"""What the generator must write: the (epoch, shard) tasks, their rows and curriculum.

A pure function of (corpus size, config, seed): the same plan on every machine,
for any worker count. Paper section 3 / docs/design.md: T(u) = 1 + (T0-1) exp(-u/tau)
with u = global row index in the training stream / total rows of all epochs.
Appendix C: any schedule gives each row a strength gamma(u); temperature scaling
uses T = 1 + gamma, the other curricula gamma itself (and T = 1).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np

from common.config import SCHEDULED_DISTRIBUTIONS, ConfigError, GenerateConfig, RunConfig, generation_settings
from common.curriculum import GENERATOR_STREAM, VALID_EPOCH, row_fraction, strength_at


@dataclass(frozen=True)
class StreamSpec:
    """What a task needs to derive its rows: the split's size, the plan and the [generate] settings."""
    num_rows: int
    """Rows of the corpus split the epochs permute (the training split; the held-out one for validation)."""
    rows_per_epoch: int
    total_rows: int
    epochs: int
    seed: int
    cfg: GenerateConfig


def validation_rows(positions: np.ndarray, num_rows: int, count: int) -> np.ndarray:
    """Row ids of validation positions `positions` of `count`: evenly spaced over the held-out split's
    `num_rows` (all of them when `count` is). The split is in source order (unit by unit, a document's rows
    together): its first rows were the first source files' documents alone, a corpus's first folder, say.
    The generator's validation shard, the aux model's validation and the online objectives' all read these,
    so every method is scored on the same rows."""
    return np.asarray(positions, dtype=np.int64) * num_rows // max(count, 1)


@dataclass(frozen=True)
class ShardTask:
    """One unit of work: `count` rows of the corpus split from position `first` of epoch `epoch`'s
    order, at stream positions `stream_start ...`, written to `path` (relative to the output folder).
    Nothing per row is stored: `row_ids`, `temperatures` and `gammas` are derived from the seeded
    permutation and the schedule when asked for (by the actor that writes the shard), so the driver's
    plan costs the same for a stream of 10^5 rows as for 10^9."""
    epoch: int
    shard_index: int
    split: str
    stream_start: int
    first: int
    count: int
    path: str
    spec: StreamSpec

    @property
    def row_ids(self) -> np.ndarray:
        positions = np.arange(self.first, self.first + self.count, dtype=np.int64)
        if self.split == "valid":
            return validation_rows(positions, self.spec.num_rows, self.spec.rows_per_epoch)
        return epoch_order(self.spec.num_rows, self.epoch, self.spec.seed)(positions)

    def curriculum(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(temperatures, gammas) of the task's rows (`epoch_curriculum`); validation: T = 1, no gammas."""
        if self.split == "valid":
            return np.ones(self.count), None
        stream = self.stream_start + np.arange(self.count, dtype=np.int64)
        return epoch_curriculum(self.spec.cfg, self.epoch, stream, self.spec.total_rows, self.spec.epochs)

    @property
    def temperatures(self) -> np.ndarray:
        return self.curriculum()[0]

    @property
    def gammas(self) -> np.ndarray | None:
        return self.curriculum()[1]


def rows_per_epoch(num_train_rows: int, cfg: GenerateConfig) -> int:
    return min(cfg.rows_per_epoch, num_train_rows) if cfg.rows_per_epoch else num_train_rows


@dataclass(frozen=True)
class StreamPlan:
    """The training stream: `epochs` permutations of the corpus rows, `total_rows` in all (the last
    epoch partial when the budget ends inside it)."""
    rows_per_epoch: int
    epochs: int
    total_rows: int


def stream_plan(num_train_rows: int, config: RunConfig) -> StreamPlan:
    """docs/design.md, the stream plan: `generate.epochs` if set, else as many epochs as the trainer's
    budget needs, train.max_steps x train.batch_size rows. Computed without generating anything."""
    per_epoch = rows_per_epoch(num_train_rows, config.generate)
    if per_epoch < 1:
        raise ConfigError("the corpus has no training rows")
    if config.generate.epochs:
        return StreamPlan(per_epoch, config.generate.epochs, per_epoch * config.generate.epochs)
    budget = config.train.max_steps * config.train.batch_size
    if not budget:
        raise ConfigError("generate.epochs = 0 takes the number of epochs from the trainer's budget, "
                          "train.max_steps x train.batch_size, but train.max_steps is 0; set one of them")
    return StreamPlan(per_epoch, math.ceil(budget / per_epoch), budget)


# How rows are drawn, beyond the settings: epoch orders by `IndexPermutation`, the aux model's dropout
# masks from a generator per row (`common.augment.row_generators`), and on a GPU each chunk's temperature draw
# compiled as an inverse CDF by blocks of ids (`common.distributions.chunk_draws`; until 2026-11-26 step by step,
# then compiled in one level, each rounding otherwise). Before the first two: a numpy permutation of the whole
# split and masks per batch, and generation keys without this entry. Part of the generation key: shards drawn
# one way are never taken for shards drawn the other. Validation rows spread over the held-out split
# (`validation_rows`) since 2026-11-27; before, its first rows.
DRAWS_VERSION = "feistel-order, per-row-dropout, blocked-gpu-draws, spread-validation"


def epoch_order(num_train_rows: int, epoch: int, seed: int, stream: int = GENERATOR_STREAM) -> "IndexPermutation":
    """The corpus rows of `epoch` in stream order, as a function of the position in the epoch: a seeded
    permutation evaluated index by index (position p of the epoch reads row `order(p)`; a sampled epoch,
    generate.rows_per_epoch = N, is its first N positions). `stream`: the aux model's MLM training
    (`AUX_MLM_STREAM`) reads the corpus in an order of its own."""
    return IndexPermutation(num_train_rows, [seed, epoch, stream, 0xE90C] if stream else [seed, epoch, 0xE90C])


class IndexPermutation:
    """A seeded permutation of [0, n) evaluated index by index in constant memory, for streams whose epochs
    are too long to hold as an array (a terabyte corpus has ~10^9 rows: 8 GB per epoch as int64).

    A four-round Feistel network over the smallest even number of bits that covers n is a bijection of
    [0, 4^h); walking each index along its cycle until it lands below n restricts it to a bijection of
    [0, n) (cycle walking). The domain is under 4n, so a walk takes under 4 passes on average."""

    ROUNDS = 4

    def __init__(self, n: int, key: list[int]):
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.default_rng(key).integers(0, 2**62, size=self.ROUNDS, dtype=np.uint64)

    def _mix(self, x: np.ndarray, key: np.uint64) -> np.ndarray:
        h = (x ^ key) * np.uint64(0x9E3779B97F4A7C15)  # splitmix64's finaliser: every input bit reaches every output bit
        h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (h ^ (h >> np.uint64(31))) & self.mask

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self.half), x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._mix(right, key)
        return (left << np.uint64(self.half)) | right

    def __call__(self, index: np.ndarray) -> np.ndarray:
        """The permuted position of each index in [0, n), as int64."""
        index = np.asarray(index, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= self.n):
            raise IndexError(f"indices must be in [0, {self.n})")
        out = self._encrypt(index.astype(np.uint64))
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


def scales_temperature(cfg: GenerateConfig) -> bool:
    """The paper's own curriculum: the aux model's output at a scheduled temperature."""
    return cfg.distribution == "aux" and cfg.augmentation == "temperature"


def has_schedule(cfg: GenerateConfig) -> bool:
    return cfg.distribution in SCHEDULED_DISTRIBUTIONS


def granularity_note(cfg: GenerateConfig, epochs: int, most: int = 4) -> str | None:
    """What `temperature_granularity = "epoch"` makes of a stream of few epochs (a large corpus, base's
    budget: one or two), where the curriculum of section 3 keeps the first epoch's value throughout (a
    single epoch: T0 for every row); None where it is not asked or there are more than `most` epochs."""
    if cfg.temperature_granularity != "epoch" or epochs > most or not has_schedule(cfg):
        return None
    which = 0 if scales_temperature(cfg) else 1  # the temperatures, or the strengths of another curriculum
    values = [float(epoch_curriculum(cfg, e, np.zeros(1), 0, epochs)[which][0]) for e in range(epochs)]
    return (f"temperature_granularity = \"epoch\" over {epochs} epoch(s): the curriculum takes {epochs} value(s), "
            f"{', '.join(f'{v:.3f}' for v in values)}, one an epoch (\"row\" follows it row by row at any length)")


def epoch_curriculum(cfg: GenerateConfig, epoch: int, stream_index: np.ndarray, total_rows: int, epochs: int = 0):
    """(temperatures, gammas) of each row (appendix C). u per row (default) or, the paper's coarser
    option, per epoch. Temperature scaling: T = 1 + gamma(u) with gamma_max = T0 - 1 (eq. exp-decay);
    other curricula: T = 1 and gamma(u) from gamma_max; no aux model and no interpolation: gamma = 0."""
    if cfg.temperature_granularity == "row":
        u = row_fraction(stream_index, total_rows)
    else:
        u = np.full(len(stream_index), epoch / (epochs or cfg.epochs), dtype=np.float64)
    if scales_temperature(cfg):
        gammas = strength_at(u, cfg.schedule, cfg.t0 - 1.0, cfg.tau)
        return 1.0 + gammas, gammas
    gammas = strength_at(u, cfg.schedule, cfg.gamma_max, cfg.tau) if has_schedule(cfg) else np.zeros(len(u))
    return np.ones(len(u)), gammas


def curriculum_record(cfg: GenerateConfig) -> dict:
    """What made an epoch's replacements, for manifest.json (paper section 5 / appendix C names)."""
    if cfg.distribution != "aux":
        name = {"uniform": "uniform", "term_frequency": "term frequency", "smoothed_one_hot": "smoothed one-hot",
                "uniform_to_soh": "UNF -> SOH", "tf_to_soh": "TF -> SOH"}[cfg.distribution]
    elif scales_temperature(cfg) and cfg.schedule == "constant" and cfg.t0 == 1.0:
        name = "fixed aux model (T = 1)"
    else:
        name = "aux model, " + {"temperature": "temperature scaling", "tf_interpolation": "log interpolation with TF",
                                "dropout": "dropout", "attention_dropout": "attention dropout",
                                "drop_token": "drop token"}[cfg.augmentation]
    record = {"name": name, "distribution": cfg.distribution}
    if cfg.distribution == "aux":
        record["augmentation"] = cfg.augmentation
    if has_schedule(cfg):
        gamma_max = cfg.t0 - 1.0 if scales_temperature(cfg) else cfg.gamma_max
        record.update(schedule=cfg.schedule, gamma_max=gamma_max, tau=cfg.tau,
                      granularity=cfg.temperature_granularity)
        if not record["name"].startswith("fixed"):
            record["name"] += f", {cfg.schedule} schedule"
    if "soh" in cfg.distribution:
        record["soh_alpha"] = cfg.soh_alpha
    return record


def plan_tasks(num_train_rows: int, num_valid_rows: int, cfg: GenerateConfig, seed: int,
               total_rows: int = 0) -> list[ShardTask]:
    """Validation shard first (the aux model at T = 1 whatever the curriculum, so every variant is
    scored on the same rows), then every epoch's shards in stream order. `total_rows`: the stream's
    length (`stream_plan`; 0 = generate.epochs whole epochs); a last partial epoch takes the first
    positions of its permutation. A task is a few integers (`ShardTask`): the plan's memory grows
    with the number of shards, not of rows."""
    per_epoch = rows_per_epoch(num_train_rows, cfg)
    total = total_rows or cfg.epochs * per_epoch
    epochs = math.ceil(total / per_epoch)
    valid_count = min(cfg.valid_rows, num_valid_rows) if cfg.valid_rows else num_valid_rows
    train_spec = StreamSpec(num_train_rows, per_epoch, total, epochs, seed, cfg)
    valid_spec = StreamSpec(num_valid_rows, valid_count, valid_count, 1, seed, cfg)
    tasks = []
    for shard, start in enumerate(range(0, valid_count, cfg.rows_per_shard)):
        count = min(cfg.rows_per_shard, valid_count - start)
        tasks.append(ShardTask(VALID_EPOCH, shard, "valid", start, start, count, f"valid/shard-{shard:05d}.parquet",
                               valid_spec))
    for epoch in range(epochs):
        rows = min(per_epoch, total - epoch * per_epoch)
        for shard, start in enumerate(range(0, rows, cfg.rows_per_shard)):
            count = min(cfg.rows_per_shard, rows - start)
            tasks.append(ShardTask(epoch, shard, "train", epoch * per_epoch + start, start, count,
                                   f"epoch-{epoch:03d}/shard-{shard:05d}.parquet", train_spec))
    return tasks


def generation_key(seed: int, cfg: GenerateConfig, corpus_meta: dict, aux_sha256: str, total_rows: int) -> str:
    """Everything a shard's bytes depend on (docs/design.md, determinism), hashed: the seed, the
    [generate] settings, the tokenizer, every corpus part, the aux model and the stream's length."""
    generate = generation_settings(dataclasses.asdict(cfg))  # threads_per_worker in: CPU kernels may round differently
    parts = {split: [p["sha256"] for p in corpus_meta[split]["parts"]] for split in ("train", "valid")}
    blob = {"seed": seed, "generate": generate, "tokenizer": corpus_meta["tokenizer_sha256"],
            "corpus_parts": parts, "aux": aux_sha256, "total_rows": total_rows,
            "draws": DRAWS_VERSION}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()
