"""Short-run ablation of the tiny preset's learning-rate multipliers and RTD-head prior init.

    python -m experiments.ablate_tiny --steps 256 --embed-lr-scale 30 --rel-bias-lr-scale 100 --prior-init

Trains the tiny main model in-process on the generated shards (rows in stream order, the trainer's
optimizer and schedule) and prints validation metrics every 64 updates. A development tool that
backs the figures in docs/design.md (design notes); not a test, not part of `make train`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time

import torch

from common.config import ConfigError, load_manifest
from common.model import ReplacedTokenDetector
from common.optim import build_optimizer, build_scheduler
from train import trainer
from train.data import DataError, load_data_manifest, replaced_rate, to_tensors, training_stream, validation_stream
from train.metrics import rtd_metrics


def main(argv=None) -> int:
    try:
        return run(argv)
    except (ConfigError, DataError, FileNotFoundError) as e:  # a user's mistake: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.ablate_tiny")
    parser.add_argument("--manifest", default="manifests/tiny.toml")
    parser.add_argument("--data", default="work/tiny/epochs")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--rel-bias-lr-scale", type=float, default=1.0)
    parser.add_argument("--embed-lr-scale", type=float, default=1.0)
    parser.add_argument("--prior-init", action="store_true")
    args = parser.parse_args(argv)
    config = load_manifest(args.manifest)
    tc = dataclasses.replace(config.train, objective="fast-offline")  # RTD on the shards
    manifest, _ = load_data_manifest(args.data, config)
    stream, valid = training_stream(args.data, manifest), validation_stream(args.data, manifest)
    torch.manual_seed(tc.seed)
    model = ReplacedTokenDetector(config.model, manifest["vocab_size"])
    if args.prior_init:
        model.head.start_at_base_rate(replaced_rate(manifest))
    optimizer = build_optimizer(model, tc.lr, tc.betas, tc.eps, tc.weight_decay, args.rel_bias_lr_scale,
                                args.embed_lr_scale)
    scheduler = build_scheduler(optimizer, tc.warmup_steps, args.steps)
    held_out = to_tensors(valid.rows(0, valid.num_rows))
    steps_per_pass = stream.num_rows // tc.batch_size
    if not steps_per_pass:
        raise DataError(f"{args.data} holds {stream.num_rows} training rows, fewer than one batch of "
                        f"train.batch_size = {tc.batch_size}")
    t0 = time.time()
    for step in range(args.steps):
        start = (step % steps_per_pass) * tc.batch_size  # wraps around the stream if asked for more
        trainer.update(model, model, optimizer, scheduler, [stream.rows(start, start + tc.batch_size)], to_tensors,
                       torch.device("cpu"), contextlib.nullcontext(), 1, tc)  # the trainer's own update
        if (step + 1) % 64 == 0 or step + 1 == args.steps:
            model.eval()
            with torch.no_grad():
                m = rtd_metrics(model(held_out["input_ids"], held_out["attention_mask"]), held_out["labels"],
                                held_out["attention_mask"])
            model.train()
            print(f"step {step + 1:5d}  val loss {m['loss']:.4f}  acc {m['accuracy']:.4f}  "
                  f"recall {m['recall']:.4f}  AUC {m['auc']:.4f}  ({time.time() - t0:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
