"""`make bench-aux`: the aux model's training step in bounded memory, at the base preset's aux shape.

    python -m bench.aux [--manifest manifests/base.toml] [--seq-len 64] [--micro 4] [--out bench/results]

Each figure comes from a fresh process that builds the aux model of the manifest (base: 4 x 768,
128,000-entry vocabulary) and runs 2 updates of the trainer's own update function
(`train.trainer.update`, objective `mlm`: accumulation, chunked logits at masked positions, clip,
AdamW) on rows of random non-special ids (compute does not depend on the text), then reports its
peak RSS. Measured in one run:
  peak_rss_8x_vs_1x     peak RSS with a batch of 16 micro-batches over a batch of 2, same micro-batch
                        (target <= 1.1): a step's memory does not grow with the batch. (Accumulating at
                        all costs one table-sized gradient once, whatever the batch: the batch of one
                        micro-batch is reported beside it, peak_rss_no_accumulation_mb.)
  preflight_vs_measured the pre-flight estimate (`common.memory`) over the measured peak, per shape
Writes bench/results/aux.json and aux.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from bench import machine
from common.memory import peak_rss_bytes
from common.config import config_from_dict, config_to_dict, load_manifest
from common.io import atomic_write_json, atomic_write_text
from common.tokenizer import SPECIAL_IDS


def shaped_config(manifest: str, seq_len: int, batch: int, micro: int, layers: int = 0, hidden: int = 0,
                  vocab: int = 0, objective: str = "mlm"):
    """The manifest's aux run config (its depth, [train] from [aux]; with `objective` "fast-offline" its
    main model and [train]) at this sequence length and batch; `layers`, `hidden` and `vocab` replace the
    model's shape when given (calibration)."""
    from common.aux_record import aux_run_config
    config = aux_run_config(load_manifest(manifest)) if objective == "mlm" else load_manifest(manifest)
    data = config_to_dict(config)
    data["corpus"]["max_seq_len"] = seq_len
    data["corpus"]["min_seq_len"] = min(data["corpus"]["min_seq_len"], seq_len)
    data["train"].update(batch_size=batch, micro_batch=micro)
    if layers:
        data["model"]["num_layers"] = layers
    if hidden:
        heads = max(1, hidden // 64)
        data["model"].update(hidden_size=hidden, num_heads=heads, ffn_size=4 * hidden)
    if vocab:
        data["tokenizer"]["vocab_size"] = vocab
    return config_from_dict(data)


def probe(manifest: str, seq_len: int, batch: int, micro: int, steps: int, layers: int, hidden: int, vocab: int,
          objective: str = "mlm") -> dict:
    """In this (fresh) process: `steps` updates of the aux model (or, objective "fast-offline", the main
    model on random labels; "fast-online", on rows corrupted by a random aux model of the manifest's aux depth
    as the trainer's reader does); peak RSS and the pre-flight estimate."""
    from common.memory import estimate_peak_bytes
    from common.model import ReplacedTokenDetector
    from common.optim import build_optimizer, build_scheduler
    from train.data import to_tensors
    from train.mlm import MLMObjective, mlm_tensors
    from common.curriculum import masked_count
    from train.trainer import update
    torch.set_num_threads(2)
    config = shaped_config(manifest, seq_len, batch, micro, layers, hidden, vocab, objective)
    vocab, tc = config.tokenizer.vocab_size, config.train
    torch.manual_seed(0)
    mlm = objective == "mlm"
    model = (MLMObjective if mlm else ReplacedTokenDetector)(config.model, vocab, *([config.model.num_layers] if mlm else []))
    optimizer = build_optimizer(model, tc.lr, tc.betas, tc.eps, tc.weight_decay, tc.rel_bias_lr_scale)
    scheduler = build_scheduler(optimizer, 1, steps)
    rng = np.random.default_rng(0)
    low = max(SPECIAL_IDS) + 1
    to_batch = partial(mlm_tensors, seed=config.seed, mask_prob=config.aux.mask_prob) if mlm else to_tensors
    autocast = torch.autocast("cpu", enabled=False)
    corruptor, aux_need = None, 0.0
    if objective == "fast-online":
        import tempfile
        from common.checkpoint import save_aux
        from common.corrupt import Corruptor
        from common.memory import online_aux_need
        from common.model import MaskedLM
        tmp = tempfile.TemporaryDirectory(prefix="bench-aux-")  # removed when this process ends
        aux_layers = config.aux.num_layers
        path = save_aux(MaskedLM(config.model, vocab, aux_layers), config.model, aux_layers, vocab, "synthetic",
                        tmp.name, {"steps": 0})
        corruptor = Corruptor(path, config.seed, config.generate.mask_prob, config.generate.batch_tokens)
        aux_need = online_aux_need(corruptor, batch, seq_len, gpu=False)
    t0, losses = time.time(), []
    for step in range(steps):
        ids = rng.integers(low, vocab, size=(batch, seq_len)).astype(np.int32)
        labels = rng.random((batch, seq_len)) < 0.15
        if corruptor is not None:  # the rank's rows of the batch, corrupted at once (train.online.OnlineStream)
            made = corruptor(list(ids), np.arange(batch) + step * batch, 0, np.full(batch, 1.5))
            ids, labels = np.stack(made["input_ids"]), np.stack(made["labels"]).astype(bool)
        micro_rows = [{"input_ids": list(ids[i:i + micro]), "row_id": np.arange(i, i + micro) + step * batch,
                       "epoch": np.zeros(micro, dtype=np.int64), **({} if mlm else {"labels": list(labels[i:i + micro])})}
                      for i in range(0, batch, micro)]
        loss, *_ = update(model, model, optimizer, scheduler, micro_rows, to_batch, torch.device("cpu"), autocast, 1,
                          tc, partial(masked_count, mask_prob=config.aux.mask_prob))
        losses.append(float(loss))  # the update leaves it on the device
    peak = peak_rss_bytes()
    estimate = aux_need + estimate_peak_bytes(config, vocab, micro, "cpu", accumulating=micro < batch)
    return {"peak_rss_bytes": peak, "estimate_bytes": estimate, "aux_need_bytes": aux_need,
            "seconds": time.time() - t0, "losses": losses, "layers": config.model.num_layers,
            "hidden": config.model.hidden_size, "vocab": vocab, "seq_len": seq_len, "batch": batch, "micro": micro,
            "objective": objective}


def measure(manifest: str, seq_len: int, batch: int, micro: int, steps: int = 2, layers: int = 0, hidden: int = 0,
            vocab: int = 0, objective: str = "mlm") -> dict:
    """`probe` in a fresh process, so each peak is its own."""
    cmd = [sys.executable, "-m", "bench.aux", "--probe", json.dumps([manifest, seq_len, batch, micro, steps, layers,
                                                                     hidden, vocab, objective])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.aux", description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", default="manifests/base.toml")
    parser.add_argument("--seq-len", type=int, default=64, help="row length (short rows keep it to minutes)")
    parser.add_argument("--micro", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(*json.loads(args.probe))))
        return 0
    # 1x is two micro-batches: accumulating adds one table-sized gradient once (common.memory), whatever
    # the batch; the batch alone without accumulation is measured too (`peak_rss_no_accumulation_mb`)
    alone = measure(args.manifest, args.seq_len, args.micro, args.micro)
    one = measure(args.manifest, args.seq_len, 2 * args.micro, args.micro)
    eight = measure(args.manifest, args.seq_len, 16 * args.micro, args.micro)
    # the pre-flight estimate against the measured peak at other shapes too (CPU, fp32)
    shapes = [measure(args.manifest, 128, 16, 16, layers=2, hidden=256, vocab=8000),
              measure(args.manifest, 512, 8, 8, layers=2, hidden=256, vocab=8000),
              measure(args.manifest, 512, 4, 4, layers=2, hidden=768, vocab=32000),
              measure(args.manifest, 256, 8, 8, layers=4, hidden=768, vocab=128000)]
    rows = [alone, one, eight, *shapes]
    for r in rows:
        r["estimate_over_measured"] = r["estimate_bytes"] / r["peak_rss_bytes"]
    result = {
        "peak_rss_8x_vs_1x": eight["peak_rss_bytes"] / one["peak_rss_bytes"],
        "preflight_max_error": max(abs(r["estimate_over_measured"] - 1) for r in rows),
        "peak_rss_1x_mb": one["peak_rss_bytes"] / 2**20, "peak_rss_8x_mb": eight["peak_rss_bytes"] / 2**20,
        "peak_rss_no_accumulation_mb": alone["peak_rss_bytes"] / 2**20,
        "seconds_per_update_1x": one["seconds"] / 2, "seconds_per_update_8x": eight["seconds"] / 2,
        "shapes": rows, "manifest": args.manifest, "seq_len": args.seq_len, "micro_batch": args.micro,
        "machine": f"{machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
    }
    out = Path(args.out)
    atomic_write_json(out / "aux.json", result)
    lines = ["# make bench-aux", "", f"{result['date']}, {result['machine']}; {args.manifest}'s aux shape, rows of "
             f"{args.seq_len} random ids, micro-batch {args.micro}, 2 updates per process (the peak is in the "
             f"second: Adam's moments exist by then).", "",
             "| layers x width, vocab | seq | batch | micro | peak RSS MB | pre-flight MB | est / measured | s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layers']} x {r['hidden']}, {r['vocab']} | {r['seq_len']} | {r['batch']} | {r['micro']} | "
                     f"{r['peak_rss_bytes'] / 2**20:.0f} | {r['estimate_bytes'] / 2**20:.0f} | "
                     f"{r['estimate_over_measured']:.3f} | {r['seconds']:.1f} |")
    lines += ["", f"peak_rss_8x_vs_1x = {result['peak_rss_8x_vs_1x']:.3f} (target <= 1.1); "
              f"preflight_max_error = {result['preflight_max_error']:.3f}"]
    atomic_write_text(out / "aux.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
