"""`make train`: the Fast-ELECTRA trainer. RTD loss only, on the generator's shards
(paper section 3: min_theta L_RTD(theta); the aux model costs nothing here).

    torchrun --nproc_per_node N -m train --manifest PATH --data DIR --out RUN [--resume]

One loop, top to bottom. Global batch b at step s = stream rows [s*b, (s+1)*b);
rank r of W reads its contiguous b/W rows as `grad_accum` micro-batches. The loss
is the mean over all non-pad tokens of the global batch, so W ranks give the
same update as one. Checkpoints hold everything needed to continue bitwise.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import signal
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from common.batching import attention_mask
from common.checkpoint import AUX_FILE, IncompatibleInputs, latest_checkpoint, save_checkpoint
from common.config import ConfigError, config_from_dict, config_to_dict, load_manifest, save_resolved
from common.io import atomic_write_json, atomic_write_text
from common.model import ReplacedTokenDetector, count_parameters
from common.optim import build_optimizer, build_scheduler
from train.data import (DataError, load_data_manifest, rank_slice, replaced_rate, to_tensors, training_stream,
                        validation_stream)
from train.metrics import rtd_metrics
from train.electra import ElectraPair, masked_inputs
from train.plots import plot_curves

# Fault injection for tests: SIGKILL this process right after finishing step N (a real kill, not an exception).
KILL_AT_STEP_ENV = "FAST_ELECTRA_TEST_KILL_AT_STEP"
# curves.png is redrawn after an evaluation at most this often (a redraw takes ~1 s of rank 0's time), and
# always at the end of the run
PLOT_INTERVAL_S = 60.0


def setup_distributed() -> tuple[int, int, torch.device]:
    """torchrun sets WORLD_SIZE/RANK; NCCL on GPU, gloo on CPU. Plain `python -m train` is one rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        # NCCL for CUDA tensors; gloo also on GPU machines for the few CPU scalars we reduce.
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@torch.no_grad()
def evaluate(model, valid, device, autocast, batch_size: int = 64) -> dict:
    """RTD metrics on all held-out rows (generated at T = 1)."""
    model.eval()
    logits, labels, masks = [], [], []
    for start in range(0, valid.num_rows, batch_size):
        batch = to_tensors(valid.rows(start, min(start + batch_size, valid.num_rows)))
        with autocast:
            out = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        logits.append(out.float().cpu().flatten())
        labels.append(batch["labels"].flatten())
        masks.append(batch["attention_mask"].flatten())
    model.train()
    return rtd_metrics(torch.cat(logits), torch.cat(labels), torch.cat(masks))


def electra_tensors(rows: dict, seed: int = 0, mask_prob: float = 0.15) -> dict:
    """`electra`: original rows -> padded originals, [MASK]ed inputs, masked flags and uniforms."""
    lengths = [len(r) for r in rows["input_ids"]]
    batch = masked_inputs(rows["input_ids"], rows["row_id"], rows["epoch"], seed, mask_prob, max(lengths))
    return {**batch, "attention_mask": attention_mask(lengths, max(lengths))}


ELECTRA_INPUTS = ("masked_ids", "attention_mask", "masked_flags", "original_ids", "uniforms")


def forward_losses(model, batch: dict, device, electra: bool) -> tuple:
    """One micro-batch through the model: (RTD loss summed over its non-pad tokens, and for `electra`
    the generator's MLM loss summed over its masked positions and its top-1 hits; else None, None)."""
    mask = batch["attention_mask"].to(device)
    if electra:  # the generator masks, predicts and samples; the discriminator detects
        mlm, logits, labels, hits = model(*(batch[k].to(device) for k in ELECTRA_INPUTS))
    else:
        logits, labels = model(batch["input_ids"].to(device), mask), batch["labels"].to(device)
        mlm = hits = None
    rtd = F.binary_cross_entropy_with_logits(logits[mask].float(), labels[mask], reduction="sum")
    return rtd, mlm, hits


def objective(rtd_sum, mlm_sum, tokens: float, masked: float, electra_lambda: float):
    """The loss to differentiate: RTD mean over tokens (paper section 3), or for `electra`
    L_MLM + lambda * L_RTD (paper section 2). `tokens` / `masked`: the counts the sums are over."""
    rtd = rtd_sum / tokens
    return rtd if mlm_sum is None else mlm_sum / masked + electra_lambda * rtd


def all_reduce(values: list[float], world: int, op=None) -> list[float]:
    """Sum (or `op`) of a few floats over all ranks."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


def train(args) -> dict:
    rank, world, device = setup_distributed()
    config = load_manifest(args.manifest)
    tc = config.train
    run_dir = Path(args.out) if args.out else config.run_dir
    data_dir = Path(args.data) if args.data else config.epochs_dir
    if tc.batch_size % (world * tc.grad_accum):
        raise ConfigError(f"train.batch_size {tc.batch_size} must be divisible by ranks x grad_accum "
                          f"= {world} x {tc.grad_accum}")
    if tc.objective == "fast-offline":  # the product: shards written once by generate/
        manifest, manifest_hash = load_data_manifest(data_dir, config)
        stream, valid = training_stream(data_dir, manifest), validation_stream(data_dir, manifest)
        vocab_size, prior = manifest["vocab_size"], replaced_rate(manifest)
    else:  # fast-online: the same rows, corrupted in the loop by the frozen aux model; electra: by the generator
        from train.online import online_streams
        corpus_dir = Path(args.corpus) if args.corpus else config.corpus_dir
        aux_path = Path(args.aux) if args.aux else config.aux_dir / AUX_FILE
        stream, valid, vocab_size, manifest_hash = online_streams(config, corpus_dir, aux_path, device.type,
                                                                  corrupt=tc.objective == "fast-online")
        prior = config.generate.mask_prob  # nearly every masked position is replaced (shards: ~0.99)
        data_dir = f"{tc.objective} from {corpus_dir} (validation rows by {aux_path})"
    electra = tc.objective == "electra"
    # 32 rows x 128 tokens = 4096 tokens per update on the tiny preset.
    total_steps = stream.num_rows // tc.batch_size
    if tc.max_steps:
        total_steps = min(total_steps, tc.max_steps)
    dropped_rows = stream.num_rows - total_steps * tc.batch_size
    micro = tc.batch_size // (world * tc.grad_accum)

    torch.manual_seed(tc.seed)  # same initial weights on every rank
    if electra:  # generator + discriminator, embeddings shared; `detector` is what validation scores
        model = ElectraPair(config.model, vocab_size).to(device)
        detector = model.discriminator
    else:
        model = detector = ReplacedTokenDetector(config.model, vocab_size).to(device)
    detector.head.start_at_base_rate(prior)  # "init well": step 0 = majority baseline
    optimizer = build_optimizer(model, tc.lr, tc.betas, tc.eps, tc.weight_decay, tc.rel_bias_lr_scale,
                                tc.embed_lr_scale)
    scheduler = build_scheduler(optimizer, tc.warmup_steps, total_steps)
    # A non-finite update is skipped, yet the schedule moves on with the step (it indexes rows, the lr and the
    # temperature); torch would warn about the call order if the very first update were the skipped one.
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    torch.manual_seed(tc.seed + 1000 + rank)  # dropout stream of this rank

    step, history, nonfinite_total, nonfinite_run = 0, {}, 0, 0
    ckpt_dir = run_dir / "checkpoints"
    if args.resume and (found := latest_checkpoint(ckpt_dir)):
        path, state = found
        if state["data_manifest_sha256"] != manifest_hash:
            raise IncompatibleInputs(f"checkpoint {path} was trained on a data manifest with sha256 "
                                     f"{state['data_manifest_sha256'][:12]}, {data_dir} has {manifest_hash[:12]}")
        if config_to_dict(config_from_dict(state["config"])) != config_to_dict(config):  # defaults of newer keys filled in
            raise IncompatibleInputs(f"checkpoint {path} was made with another config; use a new --out")
        model.load_state_dict(state["model"])
        # the step's kernel is build_optimizer's, not the checkpoint's: one saved before the fused step resumes fused
        for saved, built in zip(state["optimizer"]["param_groups"], optimizer.param_groups):
            saved["fused"], saved["foreach"] = built["fused"], built["foreach"]
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, history = state["step"], state["history"]
        nonfinite_total, nonfinite_run = state["nonfinite_total"], state["nonfinite_run"]
        if state["world_size"] == world:
            cpu_state, cuda_state = state["rng"][rank]
            torch.set_rng_state(cpu_state)
            if cuda_state is not None and device.type == "cuda":
                torch.cuda.set_rng_state(cuda_state, device)
        if rank == 0:
            print(f"train: resumed from {path} at step {step}")
    elif ckpt_dir.is_dir() and any(ckpt_dir.iterdir()) and not args.resume:
        raise ConfigError(f"{run_dir} already holds checkpoints; pass --resume or choose another --out")

    ddp_model = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model  # the one place
    is_main = rank == 0
    metrics_path = run_dir / "metrics.jsonl"
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_resolved(config, run_dir)
        kept = [l for l in metrics_path.read_text().splitlines() if json.loads(l)["step"] <= step] \
            if metrics_path.is_file() and step else []
        atomic_write_text(metrics_path, "".join(l + "\n" for l in kept))  # drop lines past the resumed step
        print(f"train: {count_parameters(model) / 1e6:.2f}M parameters, {world} rank(s) on {device}, "
              f"{total_steps} steps x {tc.batch_size} rows ({micro} per micro-batch, {tc.grad_accum} accum); "
              f"{dropped_rows} tail rows dropped; data {data_dir}")
        if "start" not in history:
            history["start"] = {"step": 0, **evaluate(detector, valid, device, autocast)}
    if world > 1:
        dist.barrier()

    def read_step(s: int) -> dict:
        """This rank's rows of step `s` (pure reading: the same rows whenever it runs)."""
        return stream.rows(*rank_slice(s, tc.batch_size, rank, world)) if s < total_steps else {}

    # One reader thread fetches step s+1 while the model works on step s.
    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shards")
    next_rows = reader.submit(read_step, step)
    kill_at = int(os.environ.get(KILL_AT_STEP_ENV, "0"))
    to_batch = partial(electra_tensors, seed=config.seed, mask_prob=config.generate.mask_prob) if electra else to_tensors
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", disable=not is_main, dynamic_ncols=True)
    t_start, tokens_seen, temps = time.time(), 0, [math.inf, -math.inf]
    last_plot = -math.inf
    deadline, deadline_hit = getattr(args, "deadline", 0.0), False  # Unix time; 0 = none
    while step < total_steps and not deadline_hit:
        rows = next_rows.result()
        next_rows = reader.submit(read_step, step + 1)
        neg_t_min, t_max = all_reduce([-float(rows["temperature"].min()), float(rows["temperature"].max())],
                                      world, dist.ReduceOp.MAX if world > 1 else None)
        temps = [min(temps[0], -neg_t_min), max(temps[1], t_max)]
        consumed = history.setdefault("temperature_consumed", [math.inf, -math.inf])
        history["temperature_consumed"] = [min(consumed[0], temps[0]), max(consumed[1], temps[1])]
        batches = [to_batch({k: v[i * micro:(i + 1) * micro] for k, v in rows.items()}) for i in range(tc.grad_accum)]
        local_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        local_masked = sum(int(b["masked_flags"].sum()) for b in batches) if electra else 0
        global_tokens, global_masked = all_reduce([float(local_tokens), float(local_masked)], world)
        loss_sum, mlm_sum, mlm_hits = 0.0, 0.0, 0.0
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            sync = ddp_model.no_sync() if (world > 1 and not last) else contextlib.nullcontext()
            with sync, autocast:
                loss, mlm, hits = forward_losses(ddp_model, batch, device, electra)
                # DDP averages gradients over ranks, so divide by global / W: the result is d(sum / global_tokens).
                objective(loss, mlm, global_tokens / world, global_masked / world, tc.electra_lambda).backward()
            loss_sum += loss.item()
            if electra:
                mlm_sum, mlm_hits = mlm_sum + mlm.item(), mlm_hits + float(hits)
        loss_sum, mlm_sum, mlm_hits = all_reduce([loss_sum, mlm_sum, mlm_hits], world)
        step_loss = loss_sum / global_tokens  # the RTD loss, comparable across objectives
        if math.isfinite(step_loss):
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm))
            optimizer.step()
            nonfinite_run = 0
        else:
            grad_norm = float("nan")
            nonfinite_total += 1
            nonfinite_run += 1
            if nonfinite_run >= tc.max_nonfinite_steps:
                bar.close()
                reader.shutdown(cancel_futures=True)
                last = latest_checkpoint(ckpt_dir)
                if is_main:
                    plot_curves(run_dir)  # what was logged, for the run someone will want to look at
                raise FloatingPointError(f"{nonfinite_run} non-finite losses in a row, last at step {step} "
                                         f"(stream rows {step * tc.batch_size}..{(step + 1) * tc.batch_size - 1}); "
                                         f"last good checkpoint: {last[0] if last else 'none'}")
        optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        step += 1
        if deadline:  # a wall-clock budget (make reproduce): every rank stops after the same update
            deadline_hit = all_reduce([float(time.time() >= deadline)], world,
                                      dist.ReduceOp.MAX if world > 1 else None)[0] > 0 and step < total_steps
        final = step == total_steps or deadline_hit
        tokens_seen += global_tokens
        tokens_per_s = tokens_seen / (time.time() - t_start)
        bar.update(1)
        if is_main:
            bar.set_postfix(loss=f"{step_loss:.4f}", T=f"{temps[1]:.3f}", tok_s=f"{tokens_per_s:.0f}")
        record = None
        if step % tc.log_every == 0 or final:
            record = {"step": step, "time": time.time(), "loss": step_loss, "lr": lr, "grad_norm": grad_norm,
                      "temperature_min": temps[0], "temperature_max": temps[1], "tokens_per_s": tokens_per_s,
                      "peak_memory_mb": peak_memory_mb(device), "nonfinite_steps": nonfinite_total,
                      "rows": [step * tc.batch_size - tc.batch_size, step * tc.batch_size]}
            if electra:
                record.update(generator_mlm_loss=mlm_sum / global_masked, generator_top1=mlm_hits / global_masked)
            temps = [math.inf, -math.inf]
        if step % tc.eval_every == 0 or final:
            if is_main:
                evaluation = evaluate(detector, valid, device, autocast)
                history["last"] = {"step": step, **evaluation}
                record = {**(record or {"step": step}), **{f"val_{k}": v for k, v in evaluation.items()}}
            if world > 1:
                dist.barrier()
        if is_main and record:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if "val_loss" in record and time.time() - last_plot >= PLOT_INTERVAL_S:
                plot_curves(run_dir)
                last_plot = time.time()
        if step % tc.ckpt_every == 0 or final:
            # every rank's dropout stream: CPU generator and, on GPU, the CUDA one
            own = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
            rng_states = [None] * world
            if world > 1:
                dist.all_gather_object(rng_states, own)
            else:
                rng_states = [own]
            if is_main:
                save_checkpoint({
                    "step": step, "rows_consumed": step * tc.batch_size, "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": rng_states, "world_size": world, "config": config_to_dict(config),
                    "data_manifest_sha256": manifest_hash, "history": history,
                    "nonfinite_total": nonfinite_total, "nonfinite_run": nonfinite_run,
                }, ckpt_dir, tc.keep_checkpoints)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    bar.close()
    reader.shutdown()
    elapsed = time.time() - t_start
    summary = {}
    if is_main:
        if deadline_hit:
            print(f"train: stopped by --deadline after step {step} of {total_steps}")
        summary = write_summary(run_dir, history, step, dropped_rows, tokens_seen / max(elapsed, 1e-9),
                                nonfinite_total, device, planned_steps=total_steps)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def write_summary(run_dir: Path, history: dict, total_steps: int, dropped_rows: int,
                  tokens_per_s: float, nonfinite: int, device, planned_steps: int) -> dict:
    start, end = history["start"], history.get("last", history["start"])
    consumed = history.get("temperature_consumed", [math.nan, math.nan])
    plot_curves(run_dir)
    summary = {"steps": total_steps, "planned_steps": planned_steps, "dropped_tail_rows": dropped_rows, "start": start, "end": end,
               "temperature_consumed": consumed, "tokens_per_s": tokens_per_s,
               "nonfinite_steps": nonfinite, "device": str(device), "run_dir": str(run_dir)}
    atomic_write_json(run_dir / "summary.json", summary)
    lines = [
        "",
        f"Fast-ELECTRA run: {total_steps} steps on {device}, {tokens_per_s:.0f} tokens/s (this session)",
        f"  validation (held-out rows, T = 1)   step {start['step']:>6}   step {end['step']:>6}",
        f"    RTD loss                          {start['loss']:>11.4f}   {end['loss']:>11.4f}",
        f"    accuracy                          {start['accuracy']:>11.4f}   {end['accuracy']:>11.4f}",
        f"    recall (replaced tokens)          {start['recall']:>11.4f}   {end['recall']:>11.4f}",
        f"    precision (replaced tokens)       {start['precision']:>11.4f}   {end['precision']:>11.4f}",
        f"    AUC                               {start['auc']:>11.4f}   {end['auc']:>11.4f}",
        f"  temperatures consumed: {consumed[0]:.4f} .. {consumed[1]:.4f}",
        f"  outputs: {run_dir}/metrics.jsonl, curves.png, summary.json, checkpoints/",
    ]
    print("\n".join(lines))
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun -m train", description="Fast-ELECTRA RTD trainer on shards.")
    parser.add_argument("--manifest", default="manifests/tiny.toml")
    parser.add_argument("--data", default=None, help="generated shards (default: WORK_DIR/epochs)")
    parser.add_argument("--out", default=None, help="run folder (default: WORK_DIR/runs/default)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    parser.add_argument("--corpus", default=None, help="fast-online only: corpus folder (default: WORK_DIR/corpus)")
    parser.add_argument("--aux", default=None, help="fast-online only: aux model (default: WORK_DIR/aux/aux.pt)")
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="Unix time: stop (evaluate, checkpoint) after the first update that ends past it")
    args = parser.parse_args(argv)
    try:
        train(args)
    except (ConfigError, DataError, IncompatibleInputs) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
