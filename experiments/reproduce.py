"""`make reproduce`: the paper's claim at small scale -- downstream quality against pre-training
wall-clock for each method under one budget (the shape of the paper's Figure 1; section 4.2 for
Fast-ELECTRA vs ELECTRA, section 5 for the fixed aux model and the term-frequency curriculum).

    python -m experiments.reproduce [--manifest manifests/reproduce.toml] [--out DIR] [--budget SECONDS]

Methods ([reproduce] methods), each pre-trained from scratch by the ordinary trainer:
    electra         original joint training (generator + discriminator, train.objective = "electra")
    fast-offline    Fast-ELECTRA: shards from the frozen aux model with the decaying temperature
    fixed-aux       the aux model's own output, T = 1 throughout (generate.schedule = "constant")
    term-frequency  no aux model: replacements drawn from the corpus unigram (generate.distribution)
    none            no pre-training: the random-init floor, fine-tuned the same way

Budget: each method gets `budget_s` of wall-clock from its first piece of work (generation for the
three offline methods: it is counted, once, and reported on its own) to its last checkpoint. The
number of updates is planned from speeds measured here first (one update of each objective, the
generator's corruption of a batch of rows; `plan_fraction` of the budget), the shards are generated
for exactly that plan, and `torchrun -m train --deadline` stops the trainer at the budget whatever
the plan said. The aux model stands for "an existing model" (paper section 3): its training time is
reported but charged to no method. Checkpoints at `checkpoints` equal fractions of the plan are
each fine-tuned on Rotten Tomatoes (finetune/ with [reproduce.finetune]).

Output folder (default WORK_DIR):
    pretrain.jsonl, corpus/, aux/           pre-training text, tokenizer and rows, the aux model
    <method>/manifest.toml, epochs/, run/   the method's resolved manifest, shards, trainer run
    <method>/timing.json                    its planned updates and measured seconds
    <method>/finetune/ft-HASH/step-XXXXXXXX/  fine-tuning of each checkpoint, per fine-tuning config
                                            (floor: none/finetune/ft-HASH)
    reproduce.json, reproduce.md, reproduce.png   the table and the figure
Rerunning skips finished pieces: a method whose training did not finish is trained again from the
start (its clock restarts; reused shards keep their measured generation time).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from common.checkpoint import AUX_FILE, IncompatibleInputs, list_checkpoints
from common.config import (ConfigError, RunConfig, add_manifest_argument, config_from_dict, config_to_dict, dump_toml,
                           load_manifest)
from common.io import DamagedFile, DiskFull, atomic_write_json, atomic_write_text
from common.sources import CorpusError
from finetune.finetuner import finetune, load_backbone
from finetune.config import dump_toml as dump_finetune_toml, resolve_config
from finetune.glue import TaskError
from finetune.rotten_tomatoes import write_pretraining_corpus
from common.process import Interrupted, run_child

# What each pre-trained method changes in the manifest (the paper's curricula are [generate] settings).
METHOD_SETTINGS = {
    "electra": {"train": {"objective": "electra"}},
    "fast-offline": {},
    "fixed-aux": {"generate": {"schedule": "constant", "t0": 1.0}},
    "term-frequency": {"generate": {"distribution": "term_frequency"}},
}
OFFLINE = ("fast-offline", "fixed-aux", "term-frequency")
LABELS = {"electra": "ELECTRA (joint generator)", "fast-offline": "Fast-ELECTRA (offline shards)",
          "fixed-aux": "fixed aux model (T = 1)", "term-frequency": "term-frequency replacements",
          "none": "no pre-training"}


def method_config(base: RunConfig, method: str, out: Path, updates: int | None = None) -> RunConfig:
    """The method's manifest: the base one, its settings, corpus and aux shared from `out`, and (with
    `updates`) the plan: rows for exactly that many updates, `checkpoints` evenly spaced."""
    data = config_to_dict(base)
    for table, values in METHOD_SETTINGS[method].items():
        data[table].update(values)
    data.update(name=f"reproduce-{method}", work_dir=str(out / method), shared_dir=str(out))
    if updates is not None:
        t, r = data["train"], base.reproduce
        per_epoch = base_train_rows(out)
        rows = updates * t["batch_size"]
        epochs = -(-rows // per_epoch)  # ceil: the plan spans as many (partial) epochs as it needs
        data["generate"].update(epochs=epochs, rows_per_epoch=-(-rows // epochs))
        every = updates // r.checkpoints  # plan_updates makes `updates` a multiple of `checkpoints`
        t.update(max_steps=updates, log_every=1, eval_every=every, ckpt_every=every,
                 keep_checkpoints=r.checkpoints + 2, warmup_steps=min(t["warmup_steps"], max(1, updates // 10)))
    return config_from_dict(data)


def base_train_rows(out: Path) -> int:
    from common.corpus import load_corpus_meta
    return load_corpus_meta(out / "corpus")["train"]["rows"]


# --- measured speeds for the plan --------------------------------------------------------

def measure_update_seconds(config: RunConfig, objective_name: str, corpus_dir: Path, repeats: int = 3) -> float:
    """Median seconds of one trainer update of `objective_name`: the trainer's own update function
    (`train.trainer.update`) on its model and optimizer, on a batch of real corpus rows (RTD labels drawn at
    the mask rate: the cost does not depend on them)."""
    from functools import partial
    from common.curriculum import masked_count
    from common.model import ReplacedTokenDetector
    from common.optim import build_optimizer, build_scheduler
    from train import trainer
    from train.data import to_tensors
    from train.objectives import ElectraPair, electra_tensors
    from train.online import OnlineStream
    tc, g = dataclasses.replace(config.train, objective=objective_name), config.generate
    stream = OnlineStream(config, corpus_dir, None)
    torch.manual_seed(0)
    vocab = config.tokenizer.vocab_size
    electra = objective_name == "electra"
    model = ElectraPair(config.model, vocab, config.aux.num_layers) if electra else ReplacedTokenDetector(config.model, vocab)
    optimizer = build_optimizer(model, tc.lr, tc.betas, tc.eps, tc.weight_decay, tc.rel_bias_lr_scale, tc.embed_lr_scale)
    scheduler = build_scheduler(optimizer, tc.warmup_steps, repeats + 1)
    to_batch = partial(electra_tensors, seed=config.seed, mask_prob=g.mask_prob) if electra else to_tensors
    count_masked = partial(masked_count, mask_prob=g.mask_prob)
    autocast = contextlib.nullcontext()
    rng, times = np.random.default_rng(0), []
    for i in range(repeats + 1):  # the first update warms up, untimed
        rows = stream.rows(i * tc.batch_size, (i + 1) * tc.batch_size)
        if not electra:
            rows["labels"] = [rng.random(len(r)) < g.mask_prob for r in rows["input_ids"]]
        t0 = time.perf_counter()
        trainer.update(model, model, optimizer, scheduler, [rows], to_batch, torch.device("cpu"), autocast, 1, tc,
                       count_masked)
        if i:
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_generation_seconds_per_row(config: RunConfig, corpus_dir: Path, aux_path: Path, rows: int = 64) -> float:
    """Seconds the generator's Corruptor (this method's curriculum) spends per training row."""
    from common.corrupt import Corruptor
    from train.online import OnlineStream
    corruptor = Corruptor.from_config(aux_path, config.seed, config.generate, corpus_dir)
    stream = OnlineStream(config, corpus_dir, corruptor)
    stream.rows(0, 8)  # warm-up
    t0 = time.perf_counter()
    stream.rows(8, 8 + rows)
    return (time.perf_counter() - t0) / rows


def plan_updates(budget_s: float, fraction: float, update_s: float, generation_s_per_update: float,
                 checkpoints: int, startup_s: float = 0.0) -> int:
    """Updates that fit `fraction` of the budget left after `startup_s` when each costs its update plus its
    rows' generation, rounded down to a multiple of `checkpoints` (so they fall evenly, the last at the end)."""
    fits = int(fraction * max(0.0, budget_s - startup_s) / (update_s + generation_s_per_update))
    return max(checkpoints, fits // checkpoints * checkpoints)


# --- one method ---------------------------------------------------------------------------

def run(cmd: list[str], what: str) -> None:
    print(f"reproduce: {what}: {' '.join(cmd)}", flush=True)
    code = run_child(cmd)
    if code:
        raise RuntimeError(f"{what} failed (exit {code}): {' '.join(cmd)}")


def manifest_key(config: RunConfig) -> dict:
    """A method's manifest (model, aux model, curriculum, budget, planned updates) without the
    fine-tuning settings, which neither its plan nor its pre-training depend on."""
    key = config_to_dict(config)
    del key["reproduce"]["finetune"]
    return json.loads(json.dumps(key))


def pretraining_key(config: RunConfig) -> str:
    return hashlib.sha256(json.dumps(manifest_key(config), sort_keys=True).encode()).hexdigest()[:16]


def earlier_timing(timing_path: Path, key: str) -> dict:
    """timing.json of an earlier pre-training with this very key, else {}: when the model, the aux model,
    the curriculum or the plan changed, neither its shards nor its training are reused, even if the
    update count came out the same."""
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {}
    return timing if timing.get("key") == key else {}


def pretrain(method: str, base: RunConfig, out: Path, plan: dict) -> dict:
    """Generate (offline methods) and train under the deadline; returns timing.json's record."""
    home = out / method
    timing_path = home / "timing.json"
    config = method_config(base, method, out, plan["updates"])
    key = pretraining_key(config)
    earlier = earlier_timing(timing_path, key)
    if earlier.get("finished"):
        return earlier
    run_dir = home / "run"
    home.mkdir(parents=True, exist_ok=True)
    manifest = atomic_write_text(home / "manifest.toml", dump_toml(config))
    timing = {"method": method, "key": key, "updates_planned": plan["updates"], "plan": plan,
              "budget_s": base.reproduce.budget_s, "generate_s": earlier.get("generate_s")}
    start = time.time()
    if method in OFFLINE:
        data = home / "epochs"
        if timing["generate_s"] is None or not (data / "manifest.json").is_file():
            run([sys.executable, "-m", "generate", "--manifest", str(manifest), "--out", str(data), "--force"],
                f"{method}: generate")
            timing["generate_s"] = time.time() - start
        else:
            start -= timing["generate_s"]  # shards of this very plan are reused: their time still counts
        atomic_write_json(timing_path, timing)
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished run restarts: its clock did too
    shutil.rmtree(home / "finetune", ignore_errors=True)  # fine-tuning of checkpoints that are gone
    timing.update(start=start, deadline=start + base.reproduce.budget_s, train_start=time.time())
    cmd = [sys.executable, "-m", "train.launch", "--standalone", "--nproc_per_node", "1", "-m", "train",
           "--manifest", str(manifest), "--out", str(run_dir), "--deadline", repr(timing["deadline"])]
    if method in OFFLINE:
        cmd += ["--data", str(home / "epochs")]
    run(cmd, f"{method}: train")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    timing["checkpoints"] = []
    for path in list_checkpoints(run_dir / "checkpoints"):
        step = int(path.stem.split("-")[1])
        timing["checkpoints"].append({"step": step, "path": str(path), "seconds": records[step]["time"] - start,
                                      "val_auc": records[step].get("val_auc")})
    timing.update(finished=True, updates_done=summary["steps"], total_s=timing["checkpoints"][-1]["seconds"],
                  train_s=records[summary["steps"]]["time"] - timing["train_start"])
    atomic_write_json(timing_path, timing)
    return timing


# --- the whole reproduction -----------------------------------------------------------------

def finetune_point(cfg, checkpoint: Path | None, manifest: Path, out_dir: Path, tasks_dir: Path) -> dict:
    backbone = load_backbone(str(checkpoint) if checkpoint else None, str(manifest),
                             "pretrained" if checkpoint else "none", None)
    results = finetune(cfg, backbone, out_dir, tasks_dir)
    summary = results["best"]["summary"]
    return {name: summary[name] for name in ("accuracy", "f1", "matthews")}


def reproduce(manifest: Path, out: Path, tasks_dir: Path, budget_s: float | None = None) -> dict:
    base = load_manifest(manifest)
    if budget_s is not None:
        data = config_to_dict(base)
        data["reproduce"]["budget_s"] = budget_s
        base = config_from_dict(data)
    r = base.reproduce
    out.mkdir(parents=True, exist_ok=True)
    # pre-training text, corpus and aux model live in `out`; the methods share them (shared_dir)
    corpus_source = write_pretraining_corpus(tasks_dir / "rotten_tomatoes", out / "pretrain.jsonl",
                                             tasks_dir / "downloads")
    data = config_to_dict(base)
    data.update(work_dir=str(out), shared_dir="")
    data["corpus"].update(source=str(corpus_source), text_column="text")
    base = config_from_dict(data)
    shared_manifest = atomic_write_text(out / "manifest.toml", dump_toml(base))
    corpus_dir, aux_path = out / "corpus", out / "aux" / AUX_FILE
    prep = prepare_shared(base, shared_manifest, out)

    ft_cfg = resolve_config(table=r.finetune, task="rotten_tomatoes")
    atomic_write_text(out / "finetune.toml", dump_finetune_toml(ft_cfg))
    # fine-tuning folders are per fine-tuning config: changing [reproduce.finetune] redoes them, elsewhere
    ft_name = "ft-" + hashlib.sha256(dump_finetune_toml(ft_cfg).encode()).hexdigest()[:10]

    methods = [m for m in r.methods if m != "none"]
    plans = load_plans(out, base, methods)
    update_s = {}
    for method in (m for m in methods if m not in plans):  # measured one after another, before any method runs
        config = method_config(base, method, out)
        objective = "electra" if method == "electra" else "fast-offline"  # the offline three: one RTD update
        if objective not in update_s:
            update_s[objective] = measure_update_seconds(config, objective, corpus_dir)
        gen_row_s = measure_generation_seconds_per_row(config, corpus_dir, aux_path) if method in OFFLINE else 0.0
        gen_update_s = gen_row_s * config.train.batch_size
        plans[method] = {"update_s": update_s[objective], "generation_s_per_update": gen_update_s,
                         "updates": plan_updates(r.budget_s, r.plan_fraction, update_s[objective], gen_update_s,
                                                 r.checkpoints, r.trainer_startup_s
                                                 + (r.generation_startup_s if method in OFFLINE else 0.0))}
        print(f"reproduce: {method}: {update_s[objective]:.3f} s/update + {gen_update_s:.3f} s of generation per update "
              f"-> {plans[method]['updates']} updates planned", flush=True)
    save_plans(out, base, plans)

    timings = {m: pretrain(m, base, out, plans[m]) for m in methods}
    points = []
    for method in methods:
        for ckpt in timings[method]["checkpoints"]:
            scores = finetune_point(ft_cfg, Path(ckpt["path"]), shared_manifest,
                                    out / method / "finetune" / ft_name / f"step-{ckpt['step']:08d}", tasks_dir)
            points.append({"method": method, **ckpt, **scores})
    if "none" in r.methods:
        scores = finetune_point(ft_cfg, None, shared_manifest, out / "none" / "finetune" / ft_name, tasks_dir)
        points.append({"method": "none", "step": 0, "seconds": 0.0, **scores})
    result = {"manifest": str(manifest), "budget_s": r.budget_s, "prep": prep, "plans": plans, "timings": timings,
              "points": points, "finetune": dump_finetune_toml(ft_cfg), "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name()}
    atomic_write_json(out / "reproduce.json", result)
    table = report(result)
    atomic_write_text(out / "reproduce.md", table)
    plot(result, out / "reproduce.png")
    print(table)
    return result


def plans_key(base: RunConfig, method: str) -> dict:
    """What a method's plan depends on: its manifest (budget and start-up allowances included)."""
    return manifest_key(method_config(base, method, Path(base.work_dir)))


def load_plans(out: Path, base: RunConfig, methods: list[str]) -> dict:
    """Plans measured by an earlier run of this reproduction, for methods whose manifest is unchanged:
    a rerun keeps them, so finished pre-training is not redone because a new measurement differs."""
    path = out / "plans.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    return {m: saved[m]["plan"] for m in methods if m in saved and saved[m]["key"] == plans_key(base, m)}


def save_plans(out: Path, base: RunConfig, plans: dict) -> None:
    atomic_write_json(out / "plans.json", {m: {"key": plans_key(base, m), "plan": p} for m, p in plans.items()})


def prepare_shared(base: RunConfig, manifest: Path, out: Path) -> dict:
    """Corpus and aux model (skipped when current); their measured seconds, kept in prep.json."""
    from corpus.build import corpus_is_current
    from common.aux_record import aux_is_current
    path = out / "prep.json"
    prep = json.loads(path.read_text()) if path.is_file() else {}
    for stage, module, current in (
            ("corpus", "corpus", lambda: corpus_is_current(base, out / "corpus", base.corpus.source)),
            ("aux", "auxiliary", lambda: aux_is_current(base, out / "corpus", out / "aux"))):
        if f"{stage}_s" in prep and current():
            continue
        t0 = time.time()
        run([sys.executable, "-m", module, "--manifest", str(manifest)], stage)
        prep[f"{stage}_s"] = time.time() - t0
        atomic_write_json(path, prep)
    return prep


def fmt(s: dict) -> str:
    return f"{s['median']:.4f} [{s['min']:.4f}, {s['max']:.4f}]"


def report(result: dict) -> str:
    prep, timings = result["prep"], result["timings"]
    seeds = next(iter(result["points"]))["accuracy"]["n"] if result["points"] else 0
    lines = [f"# make reproduce ({result['date']}, {result['device']}, torch {result['torch']})", "",
             f"`python -m experiments.reproduce --manifest {result['manifest']}`: {result['budget_s']:.0f} s of pre-training "
             f"wall-clock per method (generation included), then Rotten Tomatoes dev accuracy, median [min, max] over "
             f"{seeds} fine-tuning seeds. Shared and charged to no method: corpus {prep['corpus_s']:.0f} s, aux model "
             f"training {prep['aux_s']:.0f} s (it stands for an existing model).", "",
             "| method | generation s | training s | updates (planned) | checkpoint: seconds -> dev accuracy | final accuracy | final Matthews | held-out RTD AUC at the checkpoints |",
             "|---|---|---|---|---|---|---|---|"]
    by_method: dict[str, list] = {}
    for p in result["points"]:
        by_method.setdefault(p["method"], []).append(p)
    for method, pts in by_method.items():
        t = timings.get(method, {})
        gen = f"{t['generate_s']:.0f}" if t.get("generate_s") is not None else "-"
        train_s = f"{t['train_s']:.0f}" if "train_s" in t else "-"
        updates = f"{t['updates_done']} ({t['updates_planned']})" if t else "0"
        curve = "; ".join(f"{p['seconds']:.0f} s -> {p['accuracy']['median']:.4f}" for p in pts)
        auc = " / ".join(f"{p['val_auc']:.3f}" for p in pts if p.get("val_auc") is not None) or "-"
        last = pts[-1]
        lines.append(f"| {LABELS[method]} | {gen} | {train_s} | {updates} | {curve} | {fmt(last['accuracy'])} | "
                     f"{fmt(last['matthews'])} | {auc} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Dev accuracy (median, min-max bars) against pre-training wall-clock, one line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(p["method"] for p in result["points"]):
        pts = [p for p in result["points"] if p["method"] == method]
        acc = [p["accuracy"] for p in pts]
        if method == "none":
            ax.axhline(acc[0]["median"], color="gray", linestyle="--", label=LABELS[method])
            ax.axhspan(acc[0]["min"], acc[0]["max"], color="gray", alpha=0.15)
            continue
        x = [p["seconds"] for p in pts]
        y = np.array([a["median"] for a in acc])
        err = np.array([[a["median"] - a["min"] for a in acc], [a["max"] - a["median"] for a in acc]])
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=LABELS[method])
    ax.set_xlabel("pre-training wall-clock, seconds (generation included)")
    ax.set_ylabel("Rotten Tomatoes dev accuracy")
    ax.set_title(f"same budget ({result['budget_s']:.0f} s per method), {result['device']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.reproduce", description=__doc__.split("\n\n")[0])
    add_manifest_argument(parser, "manifests/reproduce.toml")
    parser.add_argument("--out", default=None, help="output folder (default: the manifest's work_dir)")
    parser.add_argument("--budget", type=float, default=None, help="override [reproduce] budget_s (seconds per method)")
    parser.add_argument("--tasks-dir", default="work/tasks", help="where the built-in task is prepared")
    args = parser.parse_args(argv)
    try:
        manifest = Path(args.manifest)
        out = Path(args.out) if args.out else Path(load_manifest(manifest).work_dir)
        reproduce(manifest, out, Path(args.tasks_dir), args.budget)
    except Interrupted as e:
        print(f"reproduce: {e}", file=sys.stderr)
        return 130
    except (ConfigError, CorpusError, TaskError, IncompatibleInputs, RuntimeError, DamagedFile, DiskFull) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
