"""What identifies our own auxiliary model's run and tells whether a published aux.pt is the one a manifest
makes: read by `python -m auxiliary` (which trains and publishes it) and `python -m generate` (which refuses
the manifest's own aux model made by other settings), so it lives below both stages."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from common.checkpoint import AUX_FILE, read_aux_meta
from common.config import (NOT_TRAJECTORY, NOT_TRAJECTORY_TRAIN, SCHEDULING_ONLY, AuxConfig, CorpusConfig, RunConfig,
                           TrainConfig, config_to_dict, trajectory_config)
from common.corpus import load_corpus_meta
from common.io import DamagedFile, sha256_file
from common.sources import CorpusError


def aux_run_config(config: RunConfig) -> RunConfig:
    """The trainer's config for the aux model: its depth, and [train] composed from [aux] (batch,
    micro-batch, steps, lr, warm-up, intervals) with the paper's optimizer settings (`TrainConfig`'s
    defaults: betas, eps, weight decay, clipping, no multiplier of the position bias's or the embeddings'
    lr), never the main run's: a search over the main model's [train] keeps the aux model and the shards it
    made. Of the main [train] only how the trainer runs (compile, attention, checkpoints kept, the
    non-finite stop, TensorBoard), which `run_key` leaves out. Initialised from the run's seed."""
    a, t = config.aux, config.train
    train = dataclasses.replace(TrainConfig(), objective="mlm", batch_size=a.batch_size, micro_batch=a.micro_batch,
                                lr=a.lr, warmup_steps=a.warmup_steps, max_steps=a.steps,
                                eval_every=a.eval_every, log_every=a.log_every, ckpt_every=a.ckpt_every,
                                seed=config.seed, compile=t.compile, attention=t.attention,
                                keep_checkpoints=t.keep_checkpoints, max_nonfinite_steps=t.max_nonfinite_steps,
                                tensorboard=t.tensorboard)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=a.num_layers), train=train)


# The main [train]'s execution choices that the aux run follows: left out of its key (their defaults put in their
# place), so that choosing another attention or compiling the main run does not make a new aux model.
RUN_ONLY = ("compile", "attention")


# The forms the key had, newest first: aux models published under each stay current and their unfinished runs
# are found ("2026-11-26": the micro-batches and corpus.source still in it; "legacy": before 2026-11-26, all of
# [generate], the intervals and the RTD loss's weight in it too)
KEY_FORMS = ("current", "2026-11-26", "legacy")


def run_key(config: RunConfig, corpus_dir: Path, form: str = "current") -> str:
    """What the aux run's updates depend on: the composed config's trajectory (`trajectory_config`: not
    [generate], the aux run's intervals or the RTD loss's weight) and the corpus; not what its resume may change
    (the micro-batch, where the raw text is: `common.config.RESUME_MAY_CHANGE`), which made a new key, a new aux
    model and, by its sha256, new shards for the same updates. `form`: one of KEY_FORMS."""
    meta = load_corpus_meta(corpus_dir)
    parts = [p["sha256"] for split in ("train", "valid") for p in meta[split]["parts"]]
    data = config_to_dict(aux_run_config(config))
    data["train"].update({k: getattr(TrainConfig(), k) for k in RUN_ONLY})
    if form == "current":
        data["train"]["micro_batch"], data["aux"]["micro_batch"] = TrainConfig().micro_batch, AuxConfig().micro_batch
        data["corpus"]["source"] = CorpusConfig().source
    if form == "legacy":
        trajectory = {k: v for k, v in data.items() if k not in NOT_TRAJECTORY}
        trajectory["train"] = {k: v for k, v in data["train"].items() if k not in NOT_TRAJECTORY_TRAIN}
        trajectory["generate"] = {k: v for k, v in data["generate"].items() if k not in SCHEDULING_ONLY}
    else:
        trajectory = trajectory_config(data)
    blob = {"config": trajectory, "corpus": parts, "tokenizer": meta["tokenizer_sha256"]}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:12]


def aux_is_current(config: RunConfig, corpus_dir: Path, out_dir: Path) -> bool:
    """True if aux.pt matches its aux.json, the current corpus's tokenizer and the manifest's sizes."""
    try:
        meta = read_aux_meta(out_dir / AUX_FILE)
        corpus = load_corpus_meta(corpus_dir)
    except (FileNotFoundError, CorpusError, DamagedFile):  # a damaged aux.json: published again from the run
        return False
    if config.aux.source or meta.get("kind") == "hf":
        from common import hf
        source = hf.hf_dir(config.aux.source)
        return (meta.get("kind") == "hf" and source is not None and meta["source"] == str(source)
                and meta["tokenizer_sha256"] == corpus["tokenizer_sha256"]
                and hf.model_unchanged(source, meta["model_sha256"])
                and sha256_file(out_dir / AUX_FILE) == meta["sha256"])
    return (meta["tokenizer_sha256"] == corpus["tokenizer_sha256"] and meta["num_layers"] == config.aux.num_layers
            and meta["hidden_size"] == config.model.hidden_size and meta.get("steps") == config.aux.steps
            and meta.get("metrics", {}).get("run_key") in {run_key(config, corpus_dir, f) for f in KEY_FORMS}
            and sha256_file(out_dir / AUX_FILE) == meta["sha256"])
