"""`make sweep`: several trainer configs over the same dumped shards, then one summary table.

    python -m experiments.sweep --manifest PATH [--data DIR] [--out DIR] [--nproc N] [--reuse RUN_DIR ...]
                                [--set KEY=VALUE ...]

The grid is the manifest's [sweep.train] table (key = [values]); every combination
is one run, trained by the ordinary trainer (torchrun for --nproc > 1) on the shards in --data.
The generator is never called: the shards are only read (and checked against their
manifest by the trainer). Output folder:
    <run name>/manifest.toml, metrics.jsonl, curves.png, summary.json, checkpoints/
    sweep.json, sweep.md        final validation metrics per config
Rerunning resumes unfinished runs and skips those finished on these shards with these settings; a
finished run of other shards or settings is handed to the trainer, whose --resume refuses it, naming why.
A --reuse folder (`make sweep` gives the default run's) holding a run finished on these shards with a
combination's settings stands for that combination: it is not trained again.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

from common.checkpoint import IncompatibleInputs
from common.storage import location
from common.config import (ConfigError, RunConfig, add_manifest_argument, add_set_argument, config_from_dict,
                           config_to_dict, dump_toml, load_manifest, resume_trajectory)
from common.io import DamagedFile, DiskFull, atomic_write_json, atomic_write_text
from train.data import DataError, load_data_manifest
from common.process import Interrupted, run_child, trainer_command

METRICS = ("loss", "accuracy", "precision", "recall", "auc")


def expand_grid(config: RunConfig) -> list[tuple[str, dict, RunConfig]]:
    """(run name, the grid values, full config) for every combination of [sweep.train]."""
    grid = config.sweep.train
    if not grid:
        raise ConfigError("the manifest has no [sweep.train] table (e.g. lr = [5e-4, 1e-3, 2e-3])")
    keys = sorted(grid)
    runs = []
    for values in itertools.product(*(grid[k] for k in keys)):
        point = dict(zip(keys, values))
        data = config_to_dict(config)
        data["train"].update(point)
        data["sweep"] = {"train": {}}
        name = "-".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items())
        runs.append((name, point, config_from_dict(data)))  # validates every combination up front
    return runs


def run_one(run_dir: Path, config: RunConfig, data_dir: Path, nproc: int) -> int:
    """Train one config (torchrun for several ranks), resuming if the folder already holds checkpoints."""
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = atomic_write_text(run_dir / "manifest.toml", dump_toml(config))
    cmd = [*trainer_command(nproc), "--manifest", str(manifest), "--data", str(data_dir), "--out", str(run_dir),
           "--resume"]
    return run_child(cmd)


def finished(run_dir: Path, config: RunConfig, fingerprint: str) -> bool:
    """The run in `run_dir` ended on these very shards (its summary's data fingerprint) with the settings that
    change the updates that `config` has: its results stand for this sweep."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        resolved = load_manifest(run_dir / "resolved_manifest.toml")
    except (OSError, ValueError, ConfigError):
        return False
    return (isinstance(summary, dict) and summary.get("data_fingerprint") == fingerprint
            and summary.get("steps") == summary.get("planned_steps")
            and resume_trajectory(config_to_dict(resolved)) == resume_trajectory(config_to_dict(config)))


def best_run(rows: list[dict]) -> str | None:
    """The name of the run of highest validation AUC; a nan AUC (a diverged run) is never the best."""
    scored = [r for r in rows if r.get("end") and not math.isnan(r["end"]["auc"])]  # max() never passes a nan
    return max(scored, key=lambda r: r["end"]["auc"])["name"] if scored else None


def summary_table(rows: list[dict], grid_keys: list[str]) -> str:
    head = grid_keys + ["steps", "status"] + [f"val {m}" for m in METRICS] + ["tokens/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        end = r.get("end") or {}
        cells = [str(r["grid"][k]) for k in grid_keys] + [str(r.get("steps", "-")), r["status"]]
        cells += [f"{end[m]:.4f}" if m in end else "-" for m in METRICS]
        cells.append(f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep(config: RunConfig, data_dir: Path, out_dir: Path, nproc: int, log=print,
          reuse: tuple[Path, ...] = ()) -> list[dict]:
    """Every combination of the grid trained on the shards in `data_dir` (or one of `reuse`'s finished runs that
    has its settings on these shards), then sweep.json and sweep.md in `out_dir`."""
    _, fingerprint = load_data_manifest(data_dir, config)  # no shards, no sweep: fail before any run
    runs = expand_grid(config)
    log(f"sweep: {len(runs)} configs over the shards in {data_dir} (data fingerprint {fingerprint[:12]})")
    rows = []
    for i, (name, point, run_config) in enumerate(runs):
        run_dir = out_dir / name
        done, where = finished(run_dir, run_config, fingerprint), ""
        if not done:  # e.g. make train's own run, when the grid holds the manifest's values
            same = next((r for r in reuse if finished(r, run_config, fingerprint)), None)
            if same is not None:
                run_dir, done, where = same, True, f" in {same}"
        summary_path = run_dir / "summary.json"
        if done:
            log(f"sweep: [{i + 1}/{len(runs)}] {name} already finished{where}")
            code = 0
        else:  # new, unfinished, or finished on other shards or settings (--resume refuses those, naming why)
            log(f"sweep: [{i + 1}/{len(runs)}] {name} -> {run_dir}")
            code = run_one(run_dir, run_config, data_dir, nproc)
        summary = json.loads(summary_path.read_text()) if code == 0 and summary_path.is_file() else {}
        rows.append({"name": name, "grid": point, "run_dir": str(run_dir),
                     "status": "done" if summary else f"failed (exit {code})", **summary})
    best = best_run(rows)
    grid_keys = sorted(config.sweep.train)
    atomic_write_json(out_dir / "sweep.json", {"data_dir": str(data_dir), "data_fingerprint": fingerprint,
                                               "grid": config.sweep.train, "best_by_val_auc": best, "runs": rows})
    table = summary_table(rows, grid_keys)
    atomic_write_text(out_dir / "sweep.md", f"# sweep over {data_dir}\n\nData fingerprint `{fingerprint[:16]}`, "
                      f"same shards for every run; best by validation AUC: `{best}`.\n\n{table}\n")
    log("\n" + table + f"\n\nsweep: best by validation AUC: {best}; {out_dir}/sweep.md, sweep.json")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.sweep", description=__doc__.split("\n\n")[0])
    add_manifest_argument(parser)
    add_set_argument(parser)  # every run's manifest carries them (make's CORPUS= and AUX= set the work folder)
    parser.add_argument("--data", default=None, help="generated shards (default: WORK_DIR/epochs)")
    parser.add_argument("--out", default=None, help="sweep folder (default: WORK_DIR/sweeps/NAME)")
    parser.add_argument("--nproc", type=int, default=1, help="torchrun processes per run")
    parser.add_argument("--reuse", action="append", default=[], metavar="RUN_DIR",
                        help="a finished run that stands for the combination with its settings on these shards")
    args = parser.parse_args(argv)
    if args.nproc < 1:  # before any run is launched
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    try:
        config = load_manifest(args.manifest, args.sets)
        data_dir = location(args.data) if args.data else config.epochs_dir
        out_dir = location(args.out) if args.out else location(config.work_dir) / "sweeps" / config.name
        rows = sweep(config, data_dir, out_dir, args.nproc, reuse=tuple(location(r) for r in args.reuse))
    except Interrupted as e:  # the next run would start at once: the sweep stops with its trainer
        print(f"sweep: {e}", file=sys.stderr)
        return 130
    except (ConfigError, DataError, IncompatibleInputs, DamagedFile, DiskFull) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if all(r["status"] == "done" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
