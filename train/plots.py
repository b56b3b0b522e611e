"""Training curves as PNG beside metrics.jsonl (docs/design.md: "plots are PNG files beside them").

    python -m train.plots RUN_DIR        # redraw RUN_DIR/curves.png from RUN_DIR/metrics.jsonl
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from common.io import atomic_path, parse_jsonl

PANELS = (  # (title, metrics.jsonl keys)
    ("loss (RTD; MLM for the aux model)", ("loss", "val_loss")),
    ("validation: replaced class (RTD), top-1 (MLM)", ("val_accuracy", "val_recall", "val_precision", "val_auc",
                                                       "top1", "val_top1")),
    ("learning rate", ("lr",)),
    ("temperature consumed", ("temperature_min", "temperature_max")),
    ("gradient norm (before clipping)", ("grad_norm",)),
    ("tokens/s", ("tokens_per_s",)),
)


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl; a line torn by a kill or a full disk is left out."""
    return parse_jsonl(Path(path).read_text(errors="replace").splitlines())


def plot_curves(run_dir: str | Path, name: str = "curves.png") -> Path | None:
    """Draw every panel that has data; returns the PNG path (None if there is nothing to draw yet)."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    if not records:
        return None
    # fixed margins: matplotlib's constrained layout measures every tick label, most of a plot's time
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    fig.subplots_adjust(left=0.05, right=0.985, bottom=0.07, top=0.9, wspace=0.22, hspace=0.3)
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r and r[key] is not None and math.isfinite(r[key])]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if key.startswith("val_") else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1 and ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"{run_dir.name}: {records[-1]['step']} steps")
    path = run_dir / name
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(plot_curves(sys.argv[1] if len(sys.argv) > 1 else "work/tiny/runs/default"))
