"""Validation metrics of replaced token detection: loss, accuracy, and precision,
recall and AUC of the replaced class (label 1); the run's metrics as TensorBoard events."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve by the rank-sum (Mann-Whitney) formula, ties averaged."""
    n_pos = int(labels.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), dtype=np.float64)
    # average rank over each run of equal scores
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def rtd_metrics(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> dict:
    """Metrics over the tokens where `mask` is true (padding excluded)."""
    logits, labels = logits[mask].float(), labels[mask].float()
    predicted = logits > 0
    truth = labels > 0.5
    tp = int((predicted & truth).sum())
    fp = int((predicted & ~truth).sum())
    fn = int((~predicted & truth).sum())
    return {
        "loss": F.binary_cross_entropy_with_logits(logits, labels).item(),
        "accuracy": float((predicted == truth).float().mean()),
        "precision": tp / (tp + fp) if tp + fp else 0.0,
        "recall": tp / (tp + fn) if tp + fn else 0.0,
        "auc": roc_auc(logits.numpy(), truth.numpy().astype(np.int64)),
        "replaced_fraction": float(truth.float().mean()),
        "tokens": int(mask.sum()),
    }


class TensorBoardLog:
    """`[train] tensorboard = true`: every number of a metrics.jsonl record also as a TensorBoard scalar, in
    the run folder's `tensorboard/` (tags `train/loss`, `val/auc`, ...; the step is the record's). A resumed run
    purges what the earlier one logged after the checkpoint it resumes from, as metrics.jsonl is cut back.
    Needs the `tensorboard` extra (`pip install -e '.[tensorboard]'`)."""

    def __init__(self, run_dir, resumed_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(f"train.tensorboard = true needs the tensorboard package: pip install -e "
                              f"'.[tensorboard]' ({e})") from None
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resumed_step + 1 if resumed_step else 0)

    def write(self, record: dict) -> None:
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
                self.writer.add_scalar(tag, value, record["step"], walltime=record.get("time"))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
