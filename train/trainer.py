"""The one training loop: by default Fast-ELECTRA's RTD loss on the generator's shards (paper section 3:
min_theta L_RTD(theta); the aux model costs nothing here), and the same loop for the baselines
(`fast-online`, `electra`) and the aux model's own MLM run (`mlm`). `train()` is the loop, top to bottom.

Global batch b at step s = stream rows [s*b, (s+1)*b); rank r of W reads its contiguous b/W
rows as micro-batches of `micro_batch` rows, built one at a time. The loss is the mean over all
non-pad tokens (masked positions for the MLM losses) of the global batch, so W ranks give the
same update as one. Checkpoints (`train/state.py`) hold everything needed to continue bitwise.
The same loop trains the auxiliary masked LM (objective `mlm`, `make aux`: `train/mlm.py`).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import signal
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from common.attention import use_fused
from common.batching import to_device
from common.checkpoint import AUX_FILE, list_checkpoints, local_aux
from common.config import ConfigError, RunConfig, accumulation, load_manifest, save_resolved
from common.corpus import CORPUS_META, load_corpus_meta, local_corpus
from common.tokenizer import Reserved, tokenizer_reserved
from common.curriculum import masked_count
from common.distributed import all_max, all_reduce, any_rank, barrier, setup_distributed
from common.embedding import use_eager_backward
from common.io import FolderLock, atomic_write_json, atomic_write_text, parse_jsonl, remove_stale_tmp
from common.storage import is_remote, location
from common.memory import online_aux_need, peak_rss_bytes, preflight
from common.model import ReplacedTokenDetector, count_parameters
from common.shards import MANIFEST_FILE, PLAN_FILE
from common.optim import build_optimizer, build_scheduler
from train import state
from train.data import DataError, open_data, rank_slice, to_tensors
from train.metrics import TensorBoardLog, rtd_metrics
from train.mlm import MLMObjective, evaluate_mlm, mlm_streams, mlm_tensors
from train.objectives import ElectraPair, electra_tensors, forward_losses, objective
from train.plots import plot_curves

# curves.png is redrawn after an evaluation at most this often (a redraw takes ~0.5-1 s of rank 0's time), and
# once at the end of the run (the summary draws it; the last evaluation does not draw it first)
PLOT_INTERVAL_S = 60.0


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_bytes() / 2**20


@torch.no_grad()
def evaluate(model, valid, device, autocast, batch_size: int = 64) -> dict:
    """RTD metrics on all held-out rows (generated at T = 1)."""
    model.eval()
    logits, labels, masks = [], [], []
    for start in range(0, valid.num_rows, batch_size):
        batch = to_tensors(valid.rows(start, min(start + batch_size, valid.num_rows)))
        mask = to_device(batch["attention_mask"], device) if batch["padded"] else None  # as in training
        with autocast:
            out = model(to_device(batch["input_ids"], device), mask)
        logits.append(out.float().cpu().flatten())
        labels.append(batch["labels"].flatten())
        masks.append(batch["attention_mask"].flatten())
    model.train()
    return rtd_metrics(torch.cat(logits), torch.cat(labels), torch.cat(masks))


def corpus_folder(config: RunConfig, args):
    """The corpus the run reads (its rows, its tokenizer): --corpus, else the manifest's."""
    return location(args.corpus) if getattr(args, "corpus", None) else config.corpus_dir


def data_folder(config: RunConfig, args):
    """The shard folder a fast-offline run reads: --data, else the manifest's."""
    return location(args.data) if args.data else config.epochs_dir


def known_vocab(config: RunConfig, args) -> int | None:
    """The vocabulary size the data will have, from what is on disk now: the shard folder's manifest or plan
    (fast-offline), else the corpus's corpus.json; None where none is there yet (a generator not started)."""
    places = [corpus_folder(config, args) / CORPUS_META]
    if config.train.objective == "fast-offline":
        data_dir = data_folder(config, args)
        places[:0] = [data_dir / MANIFEST_FILE, data_dir / PLAN_FILE]
    for path in places:
        try:
            return int(json.loads(path.read_text())["vocab_size"])
        except Exception:  # a hint only: what cannot be read here, open_streams reads and reports
            continue
    return None


def open_streams(config: RunConfig, args, device: torch.device, aux_loaded=None) -> tuple:
    """(training stream, validation rows, vocabulary size, replaced-token prior, data key, data description,
    the sha256 of the tokenizer the data was made with). `aux_loaded(corruptor)`: for the online objectives,
    called once their aux model is loaded, before it corrupts any row."""
    objective_name = config.train.objective
    corpus_dir = corpus_folder(config, args)
    if objective_name != "fast-offline":
        corpus_dir = local_corpus(corpus_dir)  # the rows themselves: a copy on this machine if on object storage
    if objective_name == "mlm":  # the aux model's own training on the corpus (`make aux`)
        stream, valid, vocab_size, key = mlm_streams(config, corpus_dir)
        return (stream, valid, vocab_size, None, key, f"mlm on {corpus_dir}",
                load_corpus_meta(corpus_dir)["tokenizer_sha256"])
    if objective_name == "fast-offline":  # the product: shards written once by generate/ (or being written: --follow)
        data_dir = data_folder(config, args)
        follow = getattr(args, "follow_timeout", 600.0) if getattr(args, "follow", False) else 0.0
        quiet = int(os.environ.get("RANK", "0")) != 0
        # finished or followed, the same way on every rank: a generator (re)started beside the ranks removes the
        # manifest while it checks the shards, and ranks that differ here differ in their collectives later
        world = int(os.environ.get("WORLD_SIZE", "1"))
        finished = (location(data_dir) / MANIFEST_FILE).is_file()
        if follow:
            finished = not any_rank(not finished, world)
        data = open_data(data_dir, config, follow, log=(lambda _: None) if quiet else tqdm.write,
                         generator_pid=getattr(args, "follow_pid", 0) or 0, finished=finished, world=world)
        manifest = data["manifest"]
        return (data["train"], data["valid"], manifest["vocab_size"], data["prior"], data["fingerprint"], data_dir,
                manifest.get("tokenizer_sha256", ""))
    # fast-online: the same rows, corrupted in the loop by the frozen aux model; electra: by the generator
    from train.online import online_streams
    aux_path = local_aux(location(args.aux) if getattr(args, "aux", None) else config.aux_dir / AUX_FILE)
    # the rank's own GPU by index: the corruptor also runs on the reader thread, whose current device is cuda:0
    stream, valid, vocab_size, manifest_hash = online_streams(config, corpus_dir, aux_path, str(device),
                                                              corrupt=objective_name == "fast-online",
                                                              loaded=aux_loaded)
    prior = config.generate.mask_prob  # nearly every masked position is replaced (shards: ~0.99)
    return (stream, valid, vocab_size, prior, manifest_hash, f"{objective_name} from {corpus_dir} (validation rows by "
            f"{aux_path})", load_corpus_meta(corpus_dir)["tokenizer_sha256"])


def accumulate(ddp_model, micro_rows: list[dict], to_batch, device, autocast, world: int, objective_name: str,
               electra_lambda: float, count_masked):
    """Forward and backward over this rank's micro-batches of one update, each made into tensors only when
    its turn comes (DDP syncs on the last). Returns the global loss (RTD per token; MLM per masked position
    for `mlm`), the MLM loss and top-1 (electra's generator, or `mlm`'s) and the token count. The losses stay
    on the device (float64 sums, the same numbers as summing their Python floats): nothing here waits for it."""
    mlm_kind = objective_name in ("electra", "mlm")
    local_tokens = sum(len(r) for rows in micro_rows for r in rows["input_ids"])
    local_masked = sum(count_masked(rows["input_ids"]) for rows in micro_rows) if mlm_kind else 0
    global_tokens, global_masked = all_reduce([float(local_tokens), float(local_masked)], world)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # RTD loss, MLM loss, MLM top-1 hits
    for i, rows in enumerate(micro_rows):
        batch = to_batch(rows)
        sync = ddp_model.no_sync() if (world > 1 and i < len(micro_rows) - 1) else contextlib.nullcontext()
        with sync, autocast:
            loss, mlm, hits = forward_losses(ddp_model, batch, device, objective_name == "electra")
            # DDP averages gradients over ranks, so divide by global / W: the result is d(sum / global_tokens).
            objective(loss, mlm, global_tokens / world, global_masked / world, electra_lambda).backward()
        if loss is not None:
            sums[0] += loss.detach().double()
        if mlm is not None:
            sums[1] += mlm.detach().double()
            sums[2] += hits.double()
    if world > 1:  # NCCL reduces the device tensor without a host sync; gloo on CPU
        torch.distributed.all_reduce(sums)
    if objective_name == "mlm":
        return sums[1] / global_masked, {"top1": sums[2] / global_masked}, global_tokens
    extra = {"generator_mlm_loss": sums[1] / global_masked, "generator_top1": sums[2] / global_masked} if mlm_kind else {}
    return sums[0] / global_tokens, extra, global_tokens


def compiled(setting: str, device: torch.device) -> bool:
    """`[train] compile`: "auto" compiles on a GPU only (measured faster there; on CPU slower to start than it
    saves at the presets' sizes)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def update(ddp_model, model, optimizer, scheduler, micro_rows: list[dict], to_batch, device, autocast, world: int,
           tc, count_masked=None) -> tuple[torch.Tensor, dict, float, torch.Tensor, torch.Tensor]:
    """One training update: forward and backward over the micro-batches, clip, step, schedule. A non-finite
    loss or gradient norm skips the optimizer step (the schedule still moves on: it indexes the rows, the
    lr and the temperature). `count_masked(rows)`: how many positions `to_batch` masks in them (the MLM
    losses' normaliser). Returns (loss, extra metrics, global tokens, gradient norm, stepped), the tensors
    on the device: the update never waits for the device (the trainer reads them at its log steps).

    The skip is decided on the device: the trainer's fused AdamW (`common.optim.build_optimizer`) takes
    `found_inf` (as under a GradScaler) and leaves weights, moments and step count untouched where it is 1."""
    loss, extra, tokens = accumulate(ddp_model, micro_rows, to_batch, device, autocast, world, tc.objective,
                                     tc.electra_lambda, count_masked)
    finite_loss = torch.isfinite(loss)
    # clipped whatever the loss: a non-finite one is skipped below, and its norm reported as NaN
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm)
    grad_norm = torch.where(finite_loss, norm.to(torch.float32), float("nan"))
    # an infinite norm would turn every gradient into NaN through the clip, and the weights would follow
    stepped = finite_loss & torch.isfinite(grad_norm)
    optimizer.found_inf = (~stepped).to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # a later step() elsewhere (a benchmark's) is not gated by this update's
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss, extra, tokens, grad_norm, stepped


def build_model(config: RunConfig, vocab_size: int, prior: float, device: torch.device,
                reserved: Reserved = Reserved()) -> tuple:
    """(the model to train, the detector that validation scores): the same initial weights on every rank."""
    torch.manual_seed(config.train.seed)
    if config.train.objective == "mlm":  # the aux model: its own depth, no RTD head
        model = detector = MLMObjective(config.model, vocab_size, config.model.num_layers).to(device)
    elif config.train.objective == "electra":  # generator + discriminator, embeddings shared
        model = ElectraPair(config.model, vocab_size, config.aux.num_layers, reserved).to(device)
        detector = model.discriminator
    else:
        model = detector = ReplacedTokenDetector(config.model, vocab_size).to(device)
    if config.train.objective != "mlm":
        detector.head.start_at_base_rate(prior)  # "init well": step 0 = majority baseline
    if config.train.attention == "auto" and device.type == "cuda":
        use_fused(model)  # the T5 bias's gradient in a fused kernel (common/attention.py)
    return model, detector


def open_metrics(run_dir: Path, config: RunConfig, step: int) -> Path:
    """Rank 0: the run folder with the resolved config, metrics.jsonl cut back to the resumed step (a line
    torn by a kill or a full disk dropped)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(config, run_dir)
    path = run_dir / "metrics.jsonl"
    lines = path.read_text(errors="replace").splitlines() if path.is_file() and step else []
    kept = [r for r in parse_jsonl(lines) if r.get("step", step + 1) <= step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return path


def count_skipped(progress, stepped: list[bool], step: int, max_in_a_row: int) -> int | None:
    """Counts the skipped updates among the last `len(stepped)` ones (the newest is update `step` - 1,
    0-based) into `progress`; returns the update at which `max_in_a_row` were skipped in a row, if any."""
    for index, ok in enumerate(stepped, start=step - len(stepped)):
        if ok:
            progress.nonfinite_run = 0
            continue
        progress.nonfinite_total += 1
        progress.nonfinite_run += 1
        if progress.nonfinite_run >= max_in_a_row:
            return index
    return None


def nonfinite_error(progress, step: int, batch_size: int, ckpt_dir: Path) -> FloatingPointError:
    # the newest file by name, not loaded (a base checkpoint is 2 GiB, on every rank): every checkpoint is
    # written from finite weights, and --resume skips a damaged one with a note
    last = list_checkpoints(ckpt_dir)  # `step`: the update's 0-based index; said as metrics.jsonl counts it
    return FloatingPointError(f"{progress.nonfinite_run} non-finite losses in a row, last at step {step + 1} "
                              f"(stream rows {step * batch_size}..{(step + 1) * batch_size - 1}); "
                              f"last good checkpoint: {last[-1] if last else 'none'}")


def train(args, after_step=None) -> dict:
    """`args`: manifest, data, out, resume (and optionally sets, corpus, aux, deadline, follow, follow_timeout,
    follow_pid). `after_step(step)`
    is called after every update (the tests' fault injection). Rank 0 holds the run folder's lock."""
    rank, world, device = setup_distributed()
    config = load_manifest(args.manifest, getattr(args, "sets", ()))
    run_dir = location(args.out) if args.out else config.run_dir
    if is_remote(run_dir):
        raise ConfigError(f"the run folder must be on this machine's file system, not {run_dir} (checkpoints and "
                          f"metrics are written locally; the data, corpus and aux model may be on object storage)")
    lock = FolderLock(run_dir, "the trainer").acquire() if rank == 0 else None
    if lock:  # a checkpoint's temporary left by a kill mid-save: as large as a checkpoint, at every preemption
        removed = sum(remove_stale_tmp(folder) for folder in (run_dir, run_dir / "checkpoints") if folder.is_dir())
        if removed:
            print(f"train: removed {removed} temporary file(s) a killed run left in {run_dir}")
    try:
        with StopRequest() as stop:
            return run(args, config, run_dir, rank, world, device, after_step, stop)
    finally:
        if lock:
            lock.release()


def run(args, config: RunConfig, run_dir: Path, rank: int, world: int, device: torch.device, after_step,
        stop: "StopRequest") -> dict:
    """The training loop, top to bottom."""
    tc = config.train
    mlm = tc.objective == "mlm"
    micro, accum = accumulation(tc.batch_size, world, tc.micro_batch, "aux" if mlm else "train")
    if tc.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("train.tensorboard = true needs the tensorboard package: pip install -e '.[tensorboard]'")
    # Before any work: refuse a micro-batch whose estimated peak memory exceeds the device's. On the vocabulary
    # already on disk first, so that neither waiting for shards (--follow) nor corrupting the validation rows on
    # the device (the online objectives) comes before it; again if the data's own differs.
    check_memory = partial(preflight, config, micro=micro, device=device, what="aux" if mlm else "train",
                           share=tc.batch_size // world)
    if vocab_hint := known_vocab(config, args):
        check_memory(vocab_hint)

    def aux_checked(corruptor):  # fast-online: its frozen aux model stays beside the detector, corrupting each batch
        nonlocal check_memory
        need = online_aux_need(corruptor, tc.batch_size // world, config.corpus.max_seq_len, device.type == "cuda")
        check_memory = partial(check_memory, beside=(need, "fast-online's aux model and its corruption of a batch"))
        check_memory(corruptor.vocab_size)
    stream, valid, vocab_size, prior, manifest_hash, data_desc, tokenizer_sha256 = open_streams(
        config, args, device, aux_checked if tc.objective == "fast-online" else None)
    if vocab_size != vocab_hint:
        check_memory(vocab_size)
    # train.verify_shards: this rank's shards' sha256 too, while the model is built and the step-0 evaluation
    # runs (fast-offline); without it every page read is checked against its CRC32 as it is read.
    following = getattr(stream, "follower", None) is not None  # shards checked as they arrive instead
    if following:
        stream.verify_arrivals = (rank, world, tc.batch_size) if tc.verify_shards else None
    checking = ThreadPoolExecutor(max_workers=1).submit(stream.verify, rank, world) \
        if tc.verify_shards and hasattr(stream, "verify") and not following else None
    needed = tc.max_steps * tc.batch_size
    if stream.num_rows < needed and not tc.allow_short_stream:  # never silently fewer steps than asked
        raise DataError(f"{data_desc} holds {stream.num_rows} training rows; train.max_steps {tc.max_steps} x "
                        f"train.batch_size {tc.batch_size} needs {needed}. Generate a stream for this budget "
                        f"(generate.epochs = 0 derives the epochs from it) or set train.allow_short_stream = true")
    # 16 rows x 128 tokens = 2,048 tokens per update on the tiny preset.
    total_steps = stream.num_rows // tc.batch_size
    if tc.max_steps:
        total_steps = min(total_steps, tc.max_steps)
    dropped_rows = stream.num_rows - total_steps * tc.batch_size

    # the ids never masked nor sampled: the specials, and an hf: tokenizer's unused entries
    corpus_dir = corpus_folder(config, args)
    reserved = tokenizer_reserved(local_corpus(corpus_dir, splits=())) if tc.objective in ("electra", "mlm") else Reserved()
    mask_prob = config.aux.mask_prob if mlm else config.generate.mask_prob
    masking = {"seed": config.seed, "mask_prob": mask_prob, "reserved": reserved, "vocab_size": vocab_size}
    to_batch = (partial(mlm_tensors, **masking) if mlm else partial(electra_tensors, **masking)
                if tc.objective == "electra" else to_tensors)
    count_masked = partial(masked_count, mask_prob=mask_prob, reserved=reserved, vocab_size=vocab_size)
    model, detector = build_model(config, vocab_size, prior, device, reserved)
    optimizer = build_optimizer(model, tc.lr, tc.betas, tc.eps, tc.weight_decay, tc.rel_bias_lr_scale,
                                tc.embed_lr_scale)
    scheduler = build_scheduler(optimizer, tc.warmup_steps, total_steps)
    # A non-finite update is skipped, yet the schedule moves on with the step (it indexes rows, the lr and the
    # temperature); torch would warn about the call order if the very first update were the skipped one.
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    torch.manual_seed(state.dropout_seed(tc.seed, rank))  # dropout stream of this rank

    ckpt_dir, progress = run_dir / "checkpoints", state.Progress()
    evaluate_now = partial(evaluate_mlm, to_batch=to_batch) if mlm else evaluate
    if args.resume and (restored := state.restore(ckpt_dir, model, optimizer, scheduler, config, manifest_hash,
                                                  data_desc, rank, world, device)):
        path, progress = restored
        if rank == 0:
            print(f"train: resumed from {path} at step {progress.step}")
    elif ckpt_dir.is_dir() and any(ckpt_dir.iterdir()) and not args.resume:
        raise ConfigError(f"{run_dir} already holds checkpoints; pass --resume or choose another --out")

    ddp_model = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model  # the one place
    use_compile = compiled(tc.compile, device)
    if use_compile:  # checkpoints and validation use `model` itself: its names stay plain
        use_eager_backward(model)  # the lookup's backward as ATen's kernel, not Inductor's (common/embedding.py)
        ddp_model = torch.compile(ddp_model)
    is_main, history = rank == 0, progress.history
    if is_main:
        metrics_path = open_metrics(run_dir, config, progress.step)
        if progress.step < total_steps:  # training more: a summary left by an earlier run in the folder is not
            (run_dir / "summary.json").unlink(missing_ok=True)  # this one's (a sweep reads it as finished)
        board = TensorBoardLog(run_dir, progress.step) if tc.tensorboard else None
        print(f"train: {count_parameters(model) / 1e6:.2f}M parameters, {world} rank(s) on {device}, "
              f"{total_steps} steps x {tc.batch_size} rows ({micro} per micro-batch, {accum} accumulated); "
              f"{dropped_rows} tail rows dropped; data {data_desc}"
              f"{'; under torch.compile' if use_compile else ''}"
              f"{'; attention in the fused kernel' if any(getattr(m, 'fused_attention', None) for m in model.modules()) else ''}")
        if dropped_rows >= tc.batch_size and tc.objective not in ("mlm", "electra"):  # rows at T = 1 there
            # each row's temperature (curriculum strength) was set by its place in the whole stream (paper
            # section 3: u = the fraction of training done): a run that stops early never reaches the schedule's end
            print(f"train: note: this run reads {total_steps * tc.batch_size / stream.num_rows:.0%} of a stream "
                  f"made for {stream.num_rows // tc.batch_size} steps of {tc.batch_size} rows: its last rows are "
                  f"not at the end of the temperature schedule (generate a stream for this budget: "
                  f"generate.epochs = 0)")
        if tc.warmup_steps > total_steps > 0:  # a smoke run may want it; a real one never does
            print(f"train: note: warmup_steps = {tc.warmup_steps} > the run's {total_steps} updates: the learning "
                  f"rate reaches {tc.lr * total_steps / tc.warmup_steps:.3g} at most, "
                  f"{total_steps / tc.warmup_steps:.0%} of its peak {tc.lr:g}")
        if "start" not in history:
            history["start"] = {"step": 0, **evaluate_now(detector, valid, device, autocast)}
    if checking is not None:
        problems = checking.result()
        if any_rank(bool(problems), world):
            raise DataError(f"damaged shards in {data_desc}, found before the first update: "
                            + ("; ".join(problems[:5]) if problems else "(on another rank)")
                            + "; run `make generate-epochs` (it redoes them)")
    barrier(world)

    def read_step(s: int) -> dict:
        """This rank's rows of step `s` (pure reading: the same rows whenever it runs)."""
        return stream.rows(*rank_slice(s, tc.batch_size, rank, world)) if s < total_steps else {}

    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shards")  # fetches step s+1 during step s

    def stop_reading() -> None:
        """The read of a step no update will take ends now, one waiting for the generator included."""
        if following:
            stream.follower.cancelled.set()
        reader.shutdown(cancel_futures=True)
    next_rows = reader.submit(read_step, progress.step)
    bar = tqdm(total=total_steps, initial=progress.step, desc="aux MLM" if mlm else "train", unit="step",
               disable=not is_main, dynamic_ncols=True)
    t_start, tokens_seen, temps, last_plot = time.time(), 0, [math.inf, -math.inf], -math.inf
    deadline, deadline_hit = getattr(args, "deadline", 0.0), False  # Unix time; 0 = none
    stop.armed, stopped = True, False  # from here a SIGTERM waits for the update in flight
    unread = []  # each update's "stepped" flag on the device, read at the next log, evaluation or checkpoint step
    while progress.step < total_steps and not (deadline_hit or stopped):
        step = progress.step
        try:  # damage found in what this rank reads stops the run here, before the update
            rows = stop.wait_for(next_rows, f"the shards of step {step + 1}", ckpt_dir, is_main, following)
        except (DataError, Stopped):
            bar.close()  # the error goes on a line of its own
            stop_reading()
            raise
        next_rows = reader.submit(read_step, step + 1)
        if "temperature" in rows:  # the RTD streams: the curriculum's temperatures consumed
            neg_t_min, t_max = all_max([-float(rows["temperature"].min()), float(rows["temperature"].max())], world)
            temps = [min(temps[0], -neg_t_min), max(temps[1], t_max)]
            consumed = history.setdefault("temperature_consumed", [math.inf, -math.inf])
            history["temperature_consumed"] = [min(consumed[0], temps[0]), max(consumed[1], temps[1])]
        micro_rows = [{k: v[i * micro:(i + 1) * micro] for k, v in rows.items()} for i in range(accum)]
        lr = scheduler.get_last_lr()[0]
        step_loss, extra, global_tokens, grad_norm, stepped = update(ddp_model, model, optimizer, scheduler, micro_rows,
                                                                     to_batch, device, autocast, world, tc, count_masked)
        unread.append(stepped)
        progress.step = step = step + 1
        # A wall-clock budget (make reproduce) or a SIGTERM to any rank: every rank stops after the same update.
        asked = [float(bool(deadline) and time.time() >= deadline), float(stop.signal is not None)]
        if world > 1 or any(asked):
            asked = all_max(asked, world)
            deadline_hit, stopped = (flag > 0 and step < total_steps for flag in asked)
        final = step == total_steps or deadline_hit or stopped
        tokens_seen += global_tokens
        tokens_per_s = tokens_seen / (time.time() - t_start)
        bar.update(1)
        record = None
        log_now, eval_now, ckpt_now = (step % every == 0 or final for every in (tc.log_every, tc.eval_every,
                                                                                 tc.ckpt_every))
        # stopped: the checkpoint at once, no evaluation but a due one (torchrun's grace before SIGKILL is 30 s)
        eval_now = eval_now and (step % tc.eval_every == 0 or not stopped)
        if log_now or eval_now or ckpt_now or len(unread) >= tc.max_nonfinite_steps:
            # The host reads the device here only, not at every update: which updates were skipped (too many in
            # a row stop the run before anything after them is saved, at most max_nonfinite_steps updates
            # late), then the numbers to log.
            failed_at = count_skipped(progress, torch.stack(unread).tolist(), step, tc.max_nonfinite_steps)
            if failed_at is not None:
                bar.close()
                stop_reading()
                if is_main:
                    plot_curves(run_dir)  # what was logged, for the run someone will want to look at
                raise nonfinite_error(progress, failed_at, tc.batch_size, ckpt_dir)
            unread = []
        if log_now:
            extra = {k: float(v) for k, v in extra.items()}
            record = {"step": step, "time": time.time(), "loss": float(step_loss), "lr": lr, "grad_norm": float(grad_norm),
                      **({} if mlm else {"temperature_min": temps[0], "temperature_max": temps[1]}),
                      "tokens_per_s": tokens_per_s,
                      "peak_memory_mb": peak_memory_mb(device), "nonfinite_steps": progress.nonfinite_total,
                      "rows": [step * tc.batch_size - tc.batch_size, step * tc.batch_size], **extra}
            if is_main:
                shown = {"top1": f"{extra['top1']:.3f}"} if mlm else {"T": f"{temps[1]:.3f}"}
                bar.set_postfix(loss=f"{record['loss']:.4f}", **shown, tok_s=f"{tokens_per_s:.0f}")
            temps = [math.inf, -math.inf]
        if eval_now:
            if is_main:
                evaluation = evaluate_now(detector, valid, device, autocast)
                history["last"] = {"step": step, **evaluation}
                record = {**(record or {"step": step}), **{f"val_{k}": v for k, v in evaluation.items()}}
            barrier(world)
        if is_main and record:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if board:
                board.write(record)
            if "val_loss" in record and not final and time.time() - last_plot >= PLOT_INTERVAL_S:
                plot_curves(run_dir)
                last_plot = time.time()
        if ckpt_now:
            saved = state.save(ckpt_dir, tc.keep_checkpoints, progress, model, optimizer, scheduler, config,
                               manifest_hash, rank, world, device, tokenizer_sha256)
        if after_step:
            after_step(step)
    stop.armed = False
    bar.close()
    stop_reading()
    if is_main and board:
        board.close()
    if stopped:  # not finished: no summary.json (what marks a finished run), the checkpoint says where it is
        if is_main:
            print(f"train: stopped by {stop.name if stop.signal else 'a signal to another rank'} after step "
                  f"{progress.step} of {total_steps}, checkpoint {saved}; {RESUMING}", flush=True)
            plot_curves(run_dir)
        barrier(world)  # the process group is left for the process's end (train/__main__.py, `leave`)
        raise Stopped(stop.signal or signal.SIGTERM)
    elapsed = time.time() - t_start
    summary = {}
    if is_main:
        if deadline_hit:
            print(f"train: stopped by --deadline after step {progress.step} of {total_steps}")
        if following and stream.follower.waits:
            print(f"train: followed the generation, waiting {stream.follower.waited_s:.1f}s in all for "
                  f"{stream.follower.waits} shard(s)")
        finished = run_dir / "summary.json"
        if not tokens_seen and finished.is_file():  # a finished run resumed (make train again): its summary stands
            summary = json.loads(finished.read_text())
            print(f"train: the run in {run_dir} was already complete at step {progress.step}; nothing to train, "
                  f"its summary:\n\n{summary_text(summary)}")
        else:
            summary = write_summary(run_dir, history, progress.step, dropped_rows, tokens_seen / max(elapsed, 1e-9),
                                    progress.nonfinite_total, device, planned_steps=total_steps,
                                    corpus=config.corpus.source, data_fingerprint=manifest_hash)
    # Every rank is past its last collective here; the process group is not torn down but left to the process's
    # end (`os._exit` in train/__main__.py, `leave`): gloo's teardown deadlocked (a rank hung after the summary, once in
    # CI): the main thread, holding the GIL, joined a gloo thread that was freeing the last barrier's work and
    # waited for the GIL to release its tensors (~ProcessGroupGloo, from the DDP reducer's last reference).
    barrier(world)
    return summary


RESUMING = "rerun the same command to continue (make train resumes by itself; python -m train with --resume)"


class Stopped(Exception):
    """The run stopped early on SIGTERM or Ctrl-C (`StopRequest`); what it kept has been said."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum


class StopRequest:
    """SIGTERM (a cluster's preemption, torchrun passing on its own) or Ctrl-C (SIGINT, which a terminal sends
    to make, the trainer and its ranks alike) while the loop runs (`armed`) asks it to stop after the update in
    flight, with a checkpoint, instead of losing up to `ckpt_every` updates; a second Ctrl-C stops it at once.
    Before and after the loop it stops the trainer at once (Stopped, so the run folder is released). Only the
    main thread can take a signal; elsewhere (a test calling `train` from a thread) nothing is installed."""
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal, self.armed, self._previous = None, False, {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._ask) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}

    @property
    def name(self) -> str:
        return "Ctrl-C" if self.signal == signal.SIGINT else "SIGTERM"

    def _ask(self, signum, frame) -> None:
        again = self.signal == signal.SIGINT == signum
        self.signal = signum
        if not self.armed or again:
            raise Stopped(signum)
        if signum == signal.SIGINT:
            print("\ntrain: Ctrl-C: stopping after the update in flight, with a checkpoint (Ctrl-C again stops at "
                  "once, without one)", file=sys.stderr, flush=True)

    def wait_for(self, future, what: str, ckpt_dir: Path, say: bool, following: bool = True):
        """`future`'s result. `following` (a step waiting for the generator's shards, for as long as the generator
        takes): a SIGTERM while it is not there stops the trainer without a checkpoint (the ranks are not at one
        update), the newest one said. Otherwise (a slow read: a network file system, object storage, online
        corruption) the read is waited for, and the stop comes after the update, with a checkpoint."""
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if future.done():  # the read's own TimeoutError (a network file system, object storage)
                    raise
                if self.signal is not None and following:
                    if say:
                        newest = list_checkpoints(ckpt_dir)
                        print(f"train: stopped by {self.name} while waiting for {what}; the newest checkpoint "
                              f"({newest[-1] if newest else 'none yet'}) stays; {RESUMING}", flush=True)
                    raise Stopped(self.signal) from None


def write_summary(run_dir: Path, history: dict, total_steps: int, dropped_rows: int,
                  tokens_per_s: float, nonfinite: int, device, planned_steps: int, corpus: str = "",
                  data_fingerprint: str = "") -> dict:
    start, end = history["start"], history.get("last", history["start"])
    consumed = history.get("temperature_consumed", [math.nan, math.nan])
    plot_curves(run_dir)
    summary = {"steps": total_steps, "planned_steps": planned_steps, "dropped_tail_rows": dropped_rows, "start": start,
               "end": end, "temperature_consumed": consumed, "tokens_per_s": tokens_per_s,
               "nonfinite_steps": nonfinite, "device": str(device), "run_dir": str(run_dir), "corpus": corpus,
               "data_fingerprint": data_fingerprint}
    atomic_write_json(run_dir / "summary.json", summary)
    print("\n" + summary_text(summary))
    return summary


def summary_text(summary: dict) -> str:
    """What the end of a run prints, from its summary.json alone (the README's example is checked
    against a recorded one this way: tests/test_layout.py)."""
    start, end, consumed = summary["start"], summary["end"], summary["temperature_consumed"]
    if "top1" in start:  # the aux model's MLM run
        return "\n".join([
            f"aux MLM run: {summary['steps']} steps on {summary['device']}, {summary['tokens_per_s']:.0f} tokens/s",
            f"  validation (held-out rows, masked)  step {start['step']:>6}   step {end['step']:>6}",
            *(f"    {label:<34}{start[key]:>11.4f}   {end[key]:>11.4f}" for label, key in
              (("MLM loss", "loss"), ("top-1 accuracy", "top1"))),
            f"  outputs: {summary['run_dir']}/metrics.jsonl, curves.png, summary.json, checkpoints/",
        ])
    rows = [("RTD loss", "loss"), ("accuracy", "accuracy"), ("recall (replaced tokens)", "recall"),
            ("precision (replaced tokens)", "precision"), ("AUC", "auc")]
    return "\n".join([
        f"Fast-ELECTRA run: {summary['steps']} steps on {summary['device']}, {summary['tokens_per_s']:.0f} tokens/s "
        f"(this session); corpus {summary['corpus']}",
        f"  validation (held-out rows, T = 1)   step {start['step']:>6}   step {end['step']:>6}",
        *(f"    {label:<34}{start[key]:>11.4f}   {end[key]:>11.4f}" for label, key in rows),
        f"  temperatures consumed: {consumed[0]:.4f} .. {consumed[1]:.4f}",
        f"  outputs: {summary['run_dir']}/metrics.jsonl, curves.png, summary.json, checkpoints/",
    ])
