"""Fine-tuning results over seeds: median and spread per grid point, the best point, and the
results.json / results.md files. The best point is the one with the highest median of the
task's metric over seeds (on the dev set, as GLUE dev results are reported; the median over
seeds is the usual protocol of the works the paper follows, e.g. COCO-LM and METRO)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from common.io import atomic_write_json, atomic_write_text

AXES = (("lr", "lr"), ("epochs", "epochs"), ("batch_size", "batch"), ("weight_decay", "wd"),
        ("warmup_fraction", "warm-up"))


def point_name(point: dict) -> str:
    """A folder name for a grid point, e.g. 'lr0.0001-ep3-bs32-wd0.01-wu0.06'."""
    return (f"lr{point['lr']:g}-ep{point['epochs']}-bs{point['batch_size']}-wd{point['weight_decay']:g}"
            f"-wu{point['warmup_fraction']:g}")


def spread(values: list[float]) -> dict:
    """Median, mean, sample standard deviation (0 for one value), min and max."""
    v = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(v)), "mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "min": float(v.min()), "max": float(v.max()), "n": len(v)}


def summarize(points: list[dict], runs: dict[str, list[dict]], metric: str) -> dict:
    """Per point: its runs and the spread of every metric; `best`: the highest median of `metric`
    (nan counts as worst; ties go to the earlier point)."""
    rows = []
    for point in points:
        point_runs = runs[point_name(point)]
        names = point_runs[0]["metrics"].keys()
        rows.append({"name": point_name(point), "point": point, "runs": point_runs,
                     "summary": {m: spread([r["metrics"][m] for r in point_runs]) for m in names}})

    def score(row):
        median = row["summary"][metric]["median"]
        return -math.inf if math.isnan(median) else median
    best = max(rows, key=score)  # max keeps the first of equal scores
    return {"metric": metric, "points": rows,
            "best": {"name": best["name"], "point": best["point"], "summary": best["summary"]}}


def markdown(results: dict) -> str:
    metric, task, backbone = results["metric"], results["task"], results["backbone"]
    names = list(results["points"][0]["summary"])
    source = backbone.get("checkpoint", "random initialisation") if backbone["init"] == "pretrained" else \
        "random initialisation (--init none)"
    lines = [f"# Fine-tuning on {Path(task['folder']).name}", "",
             f"- model: {source}; {backbone['parameters'] / 1e6:.2f}M parameters; {results['device']}",
             f"- task: {task['train_rows']} train / {task['dev_rows']} dev examples from {task['folder']}; "
             f"labels {task['labels'] or 'regression'}",
             f"- dev metrics after the last update: median [min, max] and std over seeds; "
             f"best point by median {metric} (marked *)", ""]
    head = [label for _, label in AXES] + ["updates", "seeds"] + names
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["points"]:
        # what ran: fewer updates than the epochs give where `max_steps` caps them
        updates = "/".join(str(n) for n in sorted({r["steps"] for r in row["runs"]}))
        cells = [f"{row['point'][key]:g}" for key, _ in AXES] + [updates, str(len(row["runs"]))]
        for m in names:
            s = row["summary"][m]
            cells.append(f"{s['median']:.4f} [{s['min']:.4f}, {s['max']:.4f}] ±{s['std']:.4f}")
        if row["name"] == results["best"]["name"]:
            cells[0] = "*" + cells[0]
        lines.append("| " + " | ".join(cells) + " |")
    best = results["best"]["summary"][metric]
    lines += ["", f"Best: {results['best']['name']}: {metric} median {best['median']:.4f} "
                  f"(min {best['min']:.4f}, max {best['max']:.4f}, std {best['std']:.4f}, {best['n']} seeds); "
                  f"{results['seconds']:.0f} s in all.", ""]
    return "\n".join(lines)


def write_results(out_dir: Path, results: dict) -> None:
    atomic_write_json(out_dir / "results.json", results)
    atomic_write_text(out_dir / "results.md", markdown(results))
