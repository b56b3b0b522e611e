"""`make generate-epochs`: write each epoch's corrupted rows and labels as Parquet shards.

Output folder:
    plan.json                              what this folder is for (generation key); written first
    valid/shard-00000.parquet              held-out rows corrupted at T = 1
    epoch-000/shard-00000.parquet ...      SHARD_SCHEMA rows in training-stream order
    progress.jsonl                         one record per finished shard (resume)
    manifest.json                          per shard: path, rows, tokens, bytes, sha256,
                                           temperature range; per epoch: statistics and
                                           the curriculum that made it. Written last.
Inputs are checked before Ray starts; a rerun redoes only shards that are missing
or whose bytes do not match their record.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

from common.checkpoint import IncompatibleInputs, check_aux_matches_tokenizer, check_sizes, local_aux, read_aux_meta
from common.config import RESOLVED_FILE, ConfigError, RunConfig, config_to_dict, save_resolved
from common.corpus import check_parts, load_corpus_meta, local_corpus, stored_term_counts
from common.io import (DamagedFile, FolderLock, atomic_write_json, file_stamp, read_json, remove_stale_tmp,
                       sha256_file)
from common.shards import FORMAT_VERSION, MANIFEST_FILE, PLAN_FILE, PROGRESS_FILE, SHARD_SCHEMA
from common.parallel import cluster_size
from common.sources import CorpusError
from common.plan import curriculum_record, generation_key, granularity_note, plan_tasks, stream_plan
from common.corrupt import needs_term_counts
from common.storage import is_remote, list_files, location, rmtree


class OutputConflict(ValueError):
    """The output folder holds a different generation."""


# what a folder of shards holds (the module's docstring; verified.json, the resolved manifest, a killed
# writer's temporaries): --force deletes a folder only if it holds nothing else
# (on object storage the progress log is a folder of one object per record: progress.jsonl.d/SPLIT/NAME.json)
TOP_LEVEL = re.compile(r"(plan\.json|manifest\.json|progress\.jsonl|progress\.jsonl\.d|verified\.json"
                       r"|resolved_manifest\.toml|valid|epoch-\d+|\..+\.tmp-.+)")
IN_SPLIT = re.compile(r"(shard-\d+\.parquet|\..+\.tmp-.+)")
IN_RECORDS = re.compile(r"(valid|epoch-\d+)/shard-\d+\.parquet\.json")


def foreign_entries(out_dir) -> list[str]:
    """The entries of `out_dir` (and of its split folders and record folder) that no generation writes."""
    foreign = []
    for entry in out_dir.iterdir():
        if not TOP_LEVEL.fullmatch(entry.name) or (entry.name in (PLAN_FILE, MANIFEST_FILE) and entry.is_dir()):
            foreign.append(entry.name)
        elif entry.name == f"{PROGRESS_FILE}.d":
            foreign += [f"{entry.name}/{split.name}/{e.name}" for split in entry.iterdir()
                        for e in (split.iterdir() if split.is_dir() else [split])
                        if not IN_RECORDS.fullmatch(f"{split.name}/{e.name}")]
        elif entry.is_dir():
            foreign += [f"{entry.name}/{e.name}" for e in entry.iterdir() if not IN_SPLIT.fullmatch(e.name)]
    return sorted(foreign)


def replace_shards(out_dir) -> None:
    """--force: delete a folder of shards, refusing one that holds anything else (a mistyped --out that
    happens to hold a plan.json or manifest.json of its own)."""
    foreign = foreign_entries(out_dir)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputConflict(f"{out_dir} holds {shown}, which no generation writes: not replaced, even with --force; "
                             f"use another --out")
    if not is_remote(out_dir):  # the files naming it a folder of shards go last: a kill leaves one still named so
        for entry in sorted(out_dir.iterdir(), key=lambda e: e.name in (PLAN_FILE, MANIFEST_FILE, PROGRESS_FILE)):
            rmtree(entry) if entry.is_dir() else entry.unlink()
    rmtree(out_dir)


def check_inputs(config: RunConfig, corpus_dir: Path, aux_path: Path, out_dir: Path, force: bool,
                 rows_at=None) -> dict:
    """Everything that can be wrong with the inputs, found before any work starts. `rows_at`: where the
    corpus's parts are, when `corpus_dir` is this machine's copy of the rest of a corpus on object storage."""
    corpus = load_corpus_meta(corpus_dir)
    if corpus["train"]["rows"] == 0 or corpus["valid"]["rows"] == 0:
        raise CorpusError(f"corpus {corpus_dir} is empty (train {corpus['train']['rows']} rows, "
                          f"valid {corpus['valid']['rows']} rows)")
    # what the trainer of this manifest would refuse in the shards (train.data.check_data), refused before they
    # are paid for
    check_sizes(f"corpus {corpus_dir} has", corpus["vocab_size"], corpus["max_seq_len"], config,
                "; the trainer would refuse these shards (build the corpus for this manifest, or use its setting)")
    check_parts(rows_at or corpus_dir)  # the rows the actors read: present, right size
    if needs_term_counts(config.generate.distribution, config.generate.augmentation):
        stored_term_counts(rows_at or corpus_dir)  # computed once and stored beside the corpus, before the actors read it
    aux = read_aux_meta(aux_path)
    check_aux_matches_tokenizer(aux, aux_path, corpus["vocab_size"], corpus["tokenizer_sha256"],
                                corpus_dir / "tokenizer.model")
    if sha256_file(aux_path) != aux["sha256"]:
        raise IncompatibleInputs(f"auxiliary model {aux_path} does not match the sha256 in its aux.json")
    plan = stream_plan(corpus["train"]["rows"], config)
    needed = config.train.max_steps * config.train.batch_size
    if plan.total_rows < needed and not config.train.allow_short_stream:  # train.trainer's own refusal, before
        clamped = (f" (rows_per_epoch {config.generate.rows_per_epoch:,} is more than the corpus's "  # the shards
                   f"{corpus['train']['rows']:,} training rows)" if plan.rows_per_epoch < config.generate.rows_per_epoch
                   else "")
        raise ConfigError(f"generate.epochs {plan.epochs} x {plan.rows_per_epoch:,} rows{clamped} is {plan.total_rows:,} "
                          f"training rows; this manifest's trainer (train.max_steps {config.train.max_steps} x "
                          f"batch_size {config.train.batch_size}) needs {needed:,} and would refuse them. Set "
                          f"generate.epochs = 0 (as many as the budget needs) or train.allow_short_stream = true")
    key = generation_key(config.seed, config.generate, corpus, aux["sha256"], plan.total_rows)
    plan_path = out_dir / PLAN_FILE
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputConflict(f"--out {out_dir} is a file, not a folder")
    if plan_path.is_file():
        try:
            existing = read_json(plan_path)
        except DamagedFile as e:
            if not force:
                raise OutputConflict(f"{e}: the generation of {out_dir} is unknown; use --force to generate it "
                                     f"anew, or another --out") from None
            existing = {}
        theirs = existing.get("generation_key") if isinstance(existing, dict) else None
        if theirs != key:
            if not force:
                raise OutputConflict(f"{out_dir} holds shards of a different generation (key "
                                     f"{str(theirs or '?')[:12]}, this run {key[:12]}); "
                                     f"use another --out or --force to replace them")
            replace_shards(out_dir)
    elif out_dir.exists() and any(out_dir.iterdir()):
        # --force replaces shard folders only: a mistyped --out (a corpus, a home folder) is never deleted. A
        # folder holding only what a generation writes is one too: what a replacement killed halfway left
        shards = any((out_dir / name).is_file() for name in (MANIFEST_FILE, PROGRESS_FILE)) or not foreign_entries(out_dir)
        if not shards:
            raise OutputConflict(f"{out_dir} is not empty and holds no {PLAN_FILE}: not a folder of shards; use "
                                 f"another --out (--force replaces only a folder of shards)")
        if not force:
            raise OutputConflict(f"{out_dir} holds shards of an unknown generation (no {PLAN_FILE}); use another "
                                 f"--out or --force to replace them")
        replace_shards(out_dir)
    return {"corpus": corpus, "aux": aux, "key": key, "plan": plan}


VERIFIED_FILE = "verified.json"


def shard_stamp(path, listed: dict | None = None, name: str = "") -> list[int]:
    """`common.io.file_stamp`, or from `listed`: an object storage folder's listing
    (`common.storage.list_files`), looked up by `name` instead of asking per object."""
    if listed is None:
        return file_stamp(path)
    return [listed[name].st_size, listed[name].st_mtime_ns]


def verified(record: dict | None, out_dir, stamps: dict | None = None, listed: dict | None = None,
             hashed: list | None = None) -> bool:
    """A finished shard is trusted only if its size and sha256 match its record. `stamps`: the size and
    modification time each shard had when its sha256 was last checked (verified.json), or when it was put in
    place (its record's `stamp`, so a killed run's shards are not read again either); a shard whose stamp is
    unchanged is trusted without reading it again, any other is hashed (and appended to `hashed`)."""
    if not record:
        return False
    path = out_dir / record["path"]
    if listed is not None:
        if record["path"] not in listed or listed[record["path"]].st_size != record["bytes"]:
            return False
    elif not path.is_file() or path.stat().st_size != record["bytes"]:
        return False
    if stamps is not None:
        now = shard_stamp(path, listed, record["path"])
        if stamps.get(record["path"]) == [record["sha256"], *now] or record.get("stamp") == now:
            return True
    if hashed is not None:
        hashed.append(record["path"])
    return sha256_file(path) == record["sha256"]


def read_stamps(out_dir: Path) -> dict:
    path = out_dir / VERIFIED_FILE
    try:
        stamps = json.loads(path.read_text()) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}  # a torn or damaged record: everything is hashed again
    return stamps if isinstance(stamps, dict) else {}


def summarize_epochs(records: list[dict], tasks, curriculum: dict | None = None) -> tuple[list[dict], dict]:
    """Per-epoch and validation statistics; each epoch records the curriculum that made it and the
    range of its rows' strength gamma (appendix C), validation rows the aux model at T = 1."""
    by_path = {r["path"]: r for r in records}
    epochs: dict[int, list[dict]] = {}
    valid = []
    for task in tasks:
        (valid if task.split == "valid" else epochs.setdefault(task.epoch, [])).append(by_path[task.path])

    def stats(shards):
        shard_fields = ("path", "rows", "tokens", "bytes", "sha256", "stream_start", "temperature_min", "temperature_max",
                        "masked", "replaced")  # the trainer's prior: the replaced share of its first batch's shards
        masked = sum(s["masked"] for s in shards)
        return {
            "rows": sum(s["rows"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
            "replaced_fraction": sum(s["replaced"] for s in shards) / max(masked, 1),
            "aux_top1": sum(s["aux_top1"] for s in shards) / max(masked, 1),
            "masked_positions": masked,
            "temperature_min": min(s["temperature_min"] for s in shards),
            "temperature_max": max(s["temperature_max"] for s in shards),
            "shards": [{k: s[k] for k in shard_fields} for s in shards],
        }

    def made_by(shards):
        gammas = [(s["gamma_min"], s["gamma_max"]) for s in shards if "gamma_min" in s]
        if curriculum is None or not gammas:
            return {}
        return {"curriculum": {**curriculum, "gamma_range": [min(g[0] for g in gammas), max(g[1] for g in gammas)]}}
    valid_record = {**stats(valid), "curriculum": {"name": "aux model, T = 1", "distribution": "aux"}}
    return [{"epoch": e, **stats(s), **made_by(s)} for e, s in sorted(epochs.items())], valid_record


def generate(config: RunConfig, out_dir: Path, corpus_dir: Path, aux_path: Path, workers: int,
             address: str | None = None, force: bool = False, log=print, verify: bool = False) -> dict:
    """Check inputs, run the missing shards on Ray, write manifest.json last. Returns the manifest.
    One writer per output folder (a lock beside it). A shard whose size and modification time are those
    recorded when it was last hashed (verified.json) is not read again unless `verify`."""
    out_dir = location(out_dir)
    with FolderLock(out_dir, "python -m generate"):
        return _generate(config, out_dir, location(corpus_dir), location(aux_path), workers, address, force, log,
                         verify)


def plan_record(checked: dict, tasks, config: RunConfig) -> dict:
    """plan.json: what the folder will hold, written before any shard, so a trainer can follow the generation
    (`train --follow`): the generation key, the data's vocabulary, length and tokenizer, and every shard's
    path and rows in stream order."""
    corpus, plan = checked["corpus"], checked["plan"]
    layout = {"valid": [], "epochs": [[] for _ in range(plan.epochs)]}
    for task in tasks:
        (layout["valid"] if task.split == "valid" else layout["epochs"][task.epoch]).append([task.path, task.count])
    return {"format_version": FORMAT_VERSION, "generation_key": checked["key"], "tasks": len(tasks),
            "schema": [{"name": f.name, "type": str(f.type)} for f in SHARD_SCHEMA],
            "vocab_size": corpus["vocab_size"], "max_seq_len": corpus["max_seq_len"],
            "tokenizer_sha256": corpus["tokenizer_sha256"], "rows_per_epoch": plan.rows_per_epoch,
            "num_epochs": plan.epochs, "total_rows": plan.total_rows, "seed": config.seed, "shards": layout}


def _generate(config: RunConfig, out_dir, corpus_dir, aux_path, workers: int,
              address: str | None, force: bool, log, verify: bool = False) -> dict:
    # inputs on object storage are read from a copy on this machine (each actor makes its own; this process
    # reads no row, so its copy of a corpus leaves the parts out)
    checked = check_inputs(config, local_corpus(corpus_dir, splits=()), local_aux(aux_path), out_dir, force,
                           rows_at=corpus_dir if is_remote(corpus_dir) else None)
    corpus, plan = checked["corpus"], checked["plan"]
    if plan.rows_per_epoch < config.generate.rows_per_epoch:
        log(f"generate: note: generate.rows_per_epoch {config.generate.rows_per_epoch:,} is more than the corpus's "
            f"{corpus['train']['rows']:,} training rows: an epoch is all of them")
    if note := granularity_note(config.generate, plan.epochs):
        log(f"generate: note: {note}")
    tasks = plan_tasks(corpus["train"]["rows"], corpus["valid"]["rows"], config.generate, config.seed, plan.total_rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not is_remote(out_dir):
        remove_stale_tmp(out_dir)
        for sub in out_dir.iterdir():
            if sub.is_dir():
                remove_stale_tmp(sub)
    atomic_write_json(out_dir / PLAN_FILE, plan_record(checked, tasks, config))
    if not (out_dir / RESOLVED_FILE).is_file():  # the manifest the folder was started with: a restart (same key)
        save_resolved(config, out_dir)           # with other settings the shards do not depend on keeps it

    from generate.job import actor_device, read_progress, run_tasks
    from generate.worker import mean_phases
    known = read_progress(out_dir)  # holds the same sizes and hashes as manifest.json
    manifest_path = out_dir / MANIFEST_FILE
    stamps = None if verify else read_stamps(out_dir)
    listed = list_files(out_dir) if is_remote(out_dir) else None  # object storage: one listing, not a request per shard
    hashed = []
    done = {t.path: known[t.path] for t in tasks if verified(known.get(t.path), out_dir, stamps, listed, hashed)}
    if hashed and stamps is not None:
        log(f"generate: hashed {len(hashed)} shard(s) again, their size or time changed since they were recorded")
    # what was hashed now (or written before) keeps its stamp: the next start reads none of it
    atomic_write_json(out_dir / VERIFIED_FILE, {p: [r["sha256"], *shard_stamp(out_dir / p, listed, p)]
                                                for p, r in done.items()})
    for path in sorted(set(known) & {t.path for t in tasks} - set(done)):
        log(f"generate: {out_dir / path} is missing or damaged (size or sha256 differ from its record); redoing it")
    todo = [t for t in tasks if t.path not in done]
    mixed = len({r["device"] for r in done.values() if "device" in r}) > 1  # a --force switch killed halfway
    if manifest_path.is_file() and not todo and not mixed:
        try:
            manifest = read_json(manifest_path, ("epochs", "valid"))
        except DamagedFile as e:  # the shards' records hold all it says
            log(f"generate: {e}; writing it again from the shards' records")
        else:
            how = "every shard hashed" if verify else "sizes and times as when last hashed; --verify hashes every shard"
            log(f"generate: {out_dir} is complete and verified ({len(tasks)} shards; {how})")
            return manifest
    if todo or mixed:
        # Shards of one folder come from one kind of device: the aux model runs in bf16 autocast on GPU and
        # fp32 on CPU, so finishing a GPU folder on CPU (or the reverse) would make rows depend on where each
        # shard ran (docs/design.md, determinism). Refused; --force redoes the other kind's shards here.
        device = actor_device(address, workers)
        workers = workers or cluster_size(address, "GPU" if device == "cuda" else "CPU")  # none asked: the cluster's
        other = sorted({r["device"] for r in done.values() if r.get("device", device) != device})
        if other and not force:
            raise OutputConflict(f"{out_dir} holds shards made on {' and '.join(other)} and this run's workers would "
                                 f"use {device}; the aux model's numerics differ between them (bf16 on GPU, fp32 on "
                                 f"CPU). Resume on {' or '.join(other)}, or use --force to redo those shards on {device}")
        done = {path: r for path, r in done.items() if r.get("device", device) == device}
        todo = [t for t in tasks if t.path not in done]
    manifest_path.unlink(missing_ok=True)  # only a complete, verified folder has a manifest
    log(f"generate: {len(tasks)} shards planned, {len(done)} already done, {len(todo)} to run "
        f"on {min(workers, len(todo)) if todo else workers} worker(s)")  # no worker starts without a shard
    t0 = time.time()
    # paths the actors resolve on their own machine (URIs stay URIs)
    actor_args = {"aux_path": str(aux_path.resolve()), "corpus_dir": str(corpus_dir.resolve()),
                  "out_dir": str(out_dir.resolve()), "seed": config.seed, "generate": config.generate}
    records = run_tasks(todo, workers, actor_args, out_dir, address, config.generate.tasks_in_flight,
                        config.generate.actors_per_gpu, corpus["max_seq_len"]) if todo else []
    seconds = time.time() - t0
    all_records = list(done.values()) + records
    # a shard written by this run was hashed as it was written (its record): stamp it now
    listed = list_files(out_dir) if is_remote(out_dir) else None
    atomic_write_json(out_dir / VERIFIED_FILE, {r["path"]: [r["sha256"], *shard_stamp(out_dir / r["path"], listed,
                                                                                      r["path"])] for r in all_records})
    epochs, valid = summarize_epochs(all_records, tasks, curriculum_record(config.generate))
    manifest = {
        "format_version": FORMAT_VERSION,
        "generation_key": checked["key"],
        "seed": config.seed,
        "config": config_to_dict(config),
        "schema": [{"name": f.name, "type": str(f.type)} for f in SHARD_SCHEMA],
        "vocab_size": corpus["vocab_size"],
        "max_seq_len": corpus["max_seq_len"],
        "tokenizer_sha256": corpus["tokenizer_sha256"],
        "aux": {"path": str(aux_path), "sha256": checked["aux"]["sha256"], "num_layers": checked["aux"]["num_layers"]},
        "rows_per_epoch": plan.rows_per_epoch,
        "num_epochs": plan.epochs,
        "total_rows": plan.total_rows,
        "epochs": epochs,
        "valid": valid,
        "devices": sorted({r.get("device", "?") for r in all_records}),
        "device_models": sorted({r["device_model"] for r in all_records if "device_model" in r}),
        "libraries": sorted({r["libraries"] for r in all_records if "libraries" in r}),
        "seconds": seconds,
    }
    atomic_write_json(manifest_path, manifest)
    if len(manifest["device_models"]) > 1:  # allowed (a cluster of mixed nodes), said
        log(f"generate: note: {out_dir}'s shards were made on {len(manifest['device_models'])} device models "
            f"({'; '.join(manifest['device_models'])}): their kernels may round differently, so a shard's rows "
            f"are those of its model's run, not of a one-model run (docs/design.md, determinism)")
    if len(manifest["libraries"]) > 1:  # a resume after an upgrade, or nodes of a cluster installed apart
        log(f"generate: note: {out_dir}'s shards were made with {len(manifest['libraries'])} sets of library "
            f"versions ({'; '.join(manifest['libraries'])}): a shard's bytes are those of its versions' run, not of "
            f"a run on one (docs/design.md, determinism)")
    tokens = sum(r["tokens"] for r in records)
    t_all = [e["temperature_min"] for e in epochs] + [e["temperature_max"] for e in epochs]
    top1 = f", aux top-1 {epochs[0]['aux_top1']:.3f}" if config.generate.distribution == "aux" else ""
    log(f"generate: {len(records)} shards, {tokens} tokens in {seconds:.1f}s "
        f"({tokens / max(seconds, 1e-9):.0f} tokens/s); {curriculum_record(config.generate)['name']}; "
        f"T {min(t_all):.3f}..{max(t_all):.3f}; "
        f"replaced {epochs[0]['replaced_fraction']:.3f} of masked (epoch 0){top1} -> {manifest_path}")
    phases = mean_phases(records)
    if phases:  # where an actor's time goes: its host side (Python) or the aux model (`phase_seconds`)
        log("generate: a shard's seconds (mean): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    return manifest
