"""`make finetune`: fine-tune the pre-trained main model on a GLUE-style task
(paper section 4.1 "Downstream evaluation setup" and appendix A, table "Hyperparameter search
space in fine-tuning"), over a small grid and several seeds; median and spread reported.

    python -m finetune --checkpoint RUN_DIR_OR_CKPT [--task rotten_tomatoes|DIR] [--out DIR]
                             [--config TOML] [--set KEY=VALUE ...] [--init pretrained|none]
    python -m finetune --init none --manifest manifests/tiny.toml     # the no-pre-training floor

The encoder of the trainer's checkpoint gets a head on its [CLS] state (ELECTRA's: dropout,
dense, GELU, dropout, linear); every weight is trained with AdaMax, linear warm-up and decay,
clipping 1.0. `--init none` trains the same shape from a random initialisation. A pair is
`[CLS] a [SEP] b [SEP]` (our encoder has no segment embeddings, as in pre-training). Output folder
(--out; default RUN/finetune/<task>-pretrained beside the checkpoint, WORK_DIR/finetune/<task>-none):
    finetune.toml        the resolved config (usable as --config)
    runs/<point>/seed-<k>.json  one run: dev metrics, losses; reused when the run is asked again
    results.json, results.md    per grid point median / mean / std / min / max over seeds; the best point
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from common.batching import attention_mask, pad_rows
from common.checkpoint import IncompatibleInputs, latest_checkpoint, safe_load
from common.config import ConfigError, ModelConfig, RunConfig, config_from_dict, load_manifest
from common.distributed import unusable_gpus
from common.corpus import local_corpus
from common.io import atomic_write_json, atomic_write_text, sha256_file
from common.model import Encoder, ReplacedTokenDetector, count_parameters, init_weights
from common.optim import build_scheduler
from common.tokenizer import CLS_ID, SEP_ID, Tokenizer, open_tokenizer
from finetune.config import BUILTIN_TASKS, FinetuneConfig, dump_toml
from finetune.report import point_name, summarize, write_results
from finetune.glue import Examples, TaskError, read_split, task_metrics

RUN_FORMAT_VERSION = 1  # of runs/<point>/seed-<k>.json; part of the key that lets a run be reused


# --- the pre-trained model ------------------------------------------------------------

@dataclasses.dataclass
class Backbone:
    """What every run starts from: the encoder's shape, its weights (None: random), the tokenizer."""
    model_config: ModelConfig
    vocab_size: int
    encoder_state: dict | None
    tokenizer: Tokenizer
    """common.tokenizer.Tokenizer or common.hf.HFTokenizer (a corpus built for an hf: aux model)."""
    source: dict
    home: Path
    """Default parent of the output folder: the checkpoint's run folder, else WORK_DIR/finetune."""


def read_checkpoint(path: Path) -> tuple[Path, dict]:
    """A trainer checkpoint file, or the newest loadable one of a run folder (or its checkpoints/)."""
    if path.is_dir():
        found = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
        if not found:
            raise FileNotFoundError(f"{path} holds no trainer checkpoint (step-*.pt)")
        path, state = found
    elif path.is_file():
        state = safe_load(path)
    else:
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise IncompatibleInputs(f"{path} is not a trainer checkpoint (no 'model' and 'config')")
    return path, state


def encoder_weights(state_dict: dict) -> dict:
    """The main model's encoder; `electra` checkpoints hold it under 'discriminator.'."""
    prefix = "discriminator.encoder." if any(k.startswith("discriminator.") for k in state_dict) else "encoder."
    return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}


def load_backbone(checkpoint: str | None, manifest: str, init: str, corpus: str | None) -> Backbone:
    if init not in ("pretrained", "none"):
        raise ConfigError(f"--init must be 'pretrained' or 'none', got {init!r}")
    state, ckpt_path = None, None
    if checkpoint:
        ckpt_path, state = read_checkpoint(Path(checkpoint))
        config: RunConfig = config_from_dict(state["config"])
    elif init == "pretrained":
        raise ConfigError("pass --checkpoint (a trainer checkpoint or run folder), or --init none")
    else:
        config = load_manifest(manifest)
    corpus_dir = local_corpus(corpus or config.corpus_dir, splits=())  # a folder, or a copy of an s3:// one's tokenizer
    tokenizer = open_tokenizer(corpus_dir)  # ours (SentencePiece), or an hf: aux model's
    source = {"init": init, "tokenizer": str(tokenizer.path), "tokenizer_sha256": tokenizer.sha256,
              "model": dataclasses.asdict(config.model)}
    weights = None
    if state is not None and state.get("tokenizer_sha256") not in (None, "", tokenizer.sha256):
        raise IncompatibleInputs(f"checkpoint {ckpt_path} was trained on data made with tokenizer "
                                 f"{state['tokenizer_sha256'][:12]}, but {tokenizer.path} is {tokenizer.sha256[:12]}: "
                                 f"pass --corpus with the corpus the run's shards were made from")
    if state is not None:
        weights = encoder_weights(state["model"])
        vocab = weights["embed.weight"].shape[0] if "embed.weight" in weights else -1
        if vocab != tokenizer.vocab_size:
            raise IncompatibleInputs(f"checkpoint {ckpt_path} has a vocabulary of {vocab} tokens but the "
                                     f"tokenizer {tokenizer.path} has {tokenizer.vocab_size}")
        ReplacedTokenDetector(config.model, vocab).encoder.load_state_dict(weights)  # fails loudly on a shape mismatch
        source.update(checkpoint=str(ckpt_path), checkpoint_sha256=sha256_file(ckpt_path), step=state.get("step"))
    else:
        source["manifest"] = str(manifest)
    home = Path(config.work_dir) / "finetune"
    if init == "pretrained":
        run_dir = ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else ckpt_path.parent
        home = run_dir / "finetune"
    return Backbone(config.model, tokenizer.vocab_size, weights if init == "pretrained" else None, tokenizer, source,
                    home)


class SequenceClassifier(nn.Module):
    """Encoder + ELECTRA's classification head on the [CLS] state; 1 output = regression."""

    def __init__(self, encoder: Encoder, hidden_size: int, num_outputs: int, dropout: float):
        super().__init__()
        self.encoder, self.dropout = encoder, dropout
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, num_outputs)

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        cls = self.encoder(input_ids, mask)[:, 0]
        h = F.gelu(self.dense(F.dropout(cls, self.dropout, self.training)))
        return self.out(F.dropout(h, self.dropout, self.training))


def build_classifier(backbone: Backbone, num_outputs: int, dropout: float, seed: int) -> SequenceClassifier:
    torch.manual_seed(seed)  # head (and, under --init none, encoder) initialisation
    cfg = dataclasses.replace(backbone.model_config, dropout=dropout)
    encoder = Encoder(cfg, backbone.vocab_size, cfg.num_layers)
    model = SequenceClassifier(encoder, cfg.hidden_size, num_outputs, dropout)
    init_weights(model)
    if backbone.encoder_state is not None:
        encoder.load_state_dict(backbone.encoder_state)
    return model


@torch.no_grad()
def rescale_embedding_rows(encoder: Encoder, rms: float) -> None:
    """Set every token-embedding row to root-mean-square `rms` (the padding row stays zero).

    The encoder reads the table only through `ln_embed`, a LayerNorm per token, so this leaves what
    the model computes unchanged up to LayerNorm's eps (at rms 0.02, eps 1e-5 shrinks the normalised
    row by about 1%, as for a fresh table). What it changes is fine-tuning speed: AdaMax moves each
    coordinate by about lr per update (appendix A's optimizer), whatever the weight's size, and
    pre-training with `embed_lr_scale` grows the rows (tiny preset: RMS 0.38 after 2,511 updates
    against 0.02 fresh), so their direction, all that LayerNorm passes on, turned ~19x more slowly
    than a fresh table's."""
    weight = encoder.embed.weight
    row_rms = weight.float().pow(2).mean(dim=1, keepdim=True).sqrt()
    weight.mul_(torch.where(row_rms > 0, rms / row_rms.clamp_min(1e-30), torch.zeros_like(row_rms)).to(weight.dtype))


# --- data -----------------------------------------------------------------------------

def truncate_pair(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """BERT's longest-first truncation in closed form: drop a token from the longer side (the
    second on a tie) until both fit in `budget`."""
    if len_a + len_b <= budget:
        return len_a, len_b
    if 2 * min(len_a, len_b) <= budget:
        return (len_a, budget - len_a) if len_a < len_b else (budget - len_b, len_b)
    return (budget + 1) // 2, budget // 2


def encode(tokenizer: Tokenizer, examples: Examples, max_len: int) -> list[np.ndarray]:
    """[CLS] a [SEP] (b [SEP]) as id arrays of at most `max_len` tokens."""
    texts_a = tokenizer.encode_batch(examples.text_a)
    texts_b = tokenizer.encode_batch(examples.text_b) if examples.text_b is not None else None
    out = []
    for i, a in enumerate(texts_a):
        if texts_b is None:
            out.append(np.array([CLS_ID] + a[:max_len - 2] + [SEP_ID], dtype=np.int64))
            continue
        b = texts_b[i]
        la, lb = truncate_pair(len(a), len(b), max_len - 3)
        out.append(np.array([CLS_ID] + a[:la] + [SEP_ID] + b[:lb] + [SEP_ID], dtype=np.int64))
    return out


def epoch_batches(lengths: np.ndarray, batch_size: int, pool: int, rng: np.random.Generator) -> list[np.ndarray]:
    """One epoch's batches of row indices, from `rng` only. A permutation of the rows; with pool > 1
    it is cut into pools of `pool` batches, each pool is sorted by length (stable) and cut into batches,
    and the batches are shuffled: a batch holds rows of similar length, so it pads less, and any two
    rows of a pool can still meet. pool = 1: consecutive slices of the permutation."""
    order = rng.permutation(len(lengths))
    if pool > 1:
        span = pool * batch_size
        order = np.concatenate([part[np.argsort(lengths[part], kind="stable")]
                                for part in np.split(order, range(span, len(order), span))])
    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))] if pool > 1 else batches


def collate(ids: list[np.ndarray], rows: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = [ids[i] for i in rows]
    batch = pad_rows(chosen)
    return batch.to(device), attention_mask([len(r) for r in chosen], batch.shape[1]).to(device)


# --- one run --------------------------------------------------------------------------

def build_adamax(model: nn.Module, lr: float, betas, eps: float, weight_decay: float) -> torch.optim.Adamax:
    """AdaMax (paper appendix A). Weight decay is decoupled, as in MT-DNN's optimizer, and only on
    matrices: each group carries `decoupled_weight_decay`, applied by `apply_weight_decay`."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.Adamax([{"params": matrices, "decoupled_weight_decay": weight_decay},
                               {"params": others, "decoupled_weight_decay": 0.0}],
                              lr=lr, betas=tuple(betas), eps=eps, weight_decay=0.0)


@torch.no_grad()
def apply_weight_decay(optimizer: torch.optim.Optimizer) -> None:
    """p <- p (1 - lr * wd) at this step's (scheduled) learning rate."""
    for group in optimizer.param_groups:
        if group["decoupled_weight_decay"]:
            torch._foreach_mul_(group["params"], 1.0 - group["lr"] * group["decoupled_weight_decay"])


@torch.no_grad()
def predict(model: nn.Module, ids: list[np.ndarray], batch_size: int, device, regression: bool) -> np.ndarray:
    """Class index (or score) per example; batches of similar length, results in input order."""
    model.eval()
    order = np.argsort([len(r) for r in ids], kind="stable")
    out = np.empty(len(ids), dtype=np.float32 if regression else np.int64)
    for start in range(0, len(ids), batch_size):
        rows = order[start:start + batch_size]
        logits = model(*collate(ids, rows, device)).float()
        out[rows] = (logits[:, 0] if regression else logits.argmax(-1)).cpu().numpy()
    model.train()
    return out


def finetune_run(model: SequenceClassifier, train: tuple[list[np.ndarray], np.ndarray],
                 dev: tuple[list[np.ndarray], np.ndarray], point: dict, seed: int, cfg: FinetuneConfig,
                 num_labels: int, device, progress: bool = True) -> dict:
    """Train `model` on `train` with the settings of one grid point (paper appendix A) and score
    it on `dev` after the last update. Batches per epoch come from (seed, epoch) only (`epoch_batches`)."""
    train_ids, train_labels = train
    regression = num_labels == 1
    model.to(device).train()
    steps_per_epoch = math.ceil(len(train_ids) / point["batch_size"])  # the last, partial batch is kept
    total = steps_per_epoch * point["epochs"]
    total = min(total, cfg.max_steps) if cfg.max_steps else total
    warmup = int(round(point["warmup_fraction"] * total))
    optimizer = build_adamax(model, point["lr"], cfg.betas, cfg.eps, point["weight_decay"])
    scheduler = build_scheduler(optimizer, warmup, total)
    labels, lengths = torch.from_numpy(train_labels), np.array([len(r) for r in train_ids])
    losses, epoch_losses, step, t0 = [], [], 0, time.time()
    bar = tqdm(total=total, desc=f"{point_name(point)} seed={seed}", unit="step", leave=False, disable=not progress)
    for epoch in range(point["epochs"]):
        if step == total:
            break
        for rows in epoch_batches(lengths, point["batch_size"], cfg.length_pool, np.random.default_rng([seed, epoch])):
            if step == total:
                break
            logits = model(*collate(train_ids, rows, device)).float()
            target = labels[rows].to(device)
            loss = F.mse_loss(logits[:, 0], target) if regression else F.cross_entropy(logits, target)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss at step {step} ({point_name(point)}, seed {seed})")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
            apply_weight_decay(optimizer)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}")
        epoch_losses.append(float(np.mean(losses[epoch * steps_per_epoch:])))
    bar.close()
    predictions = predict(model, dev[0], cfg.eval_batch_size, device, regression)
    metrics = task_metrics(predictions, dev[1], num_labels)
    return {"metrics": metrics, "steps": step, "warmup_steps": warmup, "train_loss_first": losses[0],
            "train_loss_per_epoch": epoch_losses, "seconds": time.time() - t0,
            "predicted_counts": None if regression else np.bincount(predictions, minlength=num_labels).tolist()}


# --- the grid -------------------------------------------------------------------------

def identity(description: dict) -> dict:
    """What makes a run reusable: contents (hashes, shapes, settings), not where files lie."""
    return {k: v for k, v in description.items() if k not in ("folder", "tokenizer", "checkpoint", "manifest")}


def load_task(cfg: FinetuneConfig, tasks_dir: Path) -> tuple[Path, Examples, Examples, list[str]]:
    tc = cfg.task
    folder = Path(tc.path)
    if tc.path in BUILTIN_TASKS and not folder.exists():
        from finetune.rotten_tomatoes import prepare
        folder = prepare(tasks_dir / tc.path)
    if not folder.is_dir():
        raise TaskError(f"task folder {folder} does not exist (built in: {', '.join(BUILTIN_TASKS)})")
    train, names = read_split(folder / tc.train_file, tc.columns, tc.text_a, tc.text_b, tc.label, tc.regression,
                              tc.labels or None)
    dev, _ = read_split(folder / tc.dev_file, tc.columns, tc.text_a, tc.text_b, tc.label, tc.regression, names)
    if 0 < tc.train_examples < len(train):
        keep = np.sort(np.random.default_rng(0).permutation(len(train))[:tc.train_examples])  # one sample for all runs
        train = Examples([train.text_a[i] for i in keep],
                         None if train.text_b is None else [train.text_b[i] for i in keep], train.labels[keep])
    return folder, train, dev, names


def read_run(path: Path) -> dict | None:
    """A finished run's record (seed-K.json), or None: not there, or damaged (written atomically, so by hand or
    by the disk), which is said and the run made again."""
    if not path.is_file():
        return None
    try:
        run = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        run = None
    if isinstance(run, dict) and "key" in run and "metrics" in run:
        return run
    print(f"finetune: {path} is damaged; making that run again", flush=True)
    return None


def finetune(cfg: FinetuneConfig, backbone: Backbone, out_dir: Path, tasks_dir: Path, progress: bool = True) -> dict:
    """Every grid point x seed (runs already in `out_dir` with the same inputs are reused), then
    results.json / results.md. Returns the results."""
    if problem := unusable_gpus("fine-tuning"):
        raise ConfigError(problem)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder, train, dev, label_names = load_task(cfg, tasks_dir)
    num_labels = 1 if cfg.task.regression else len(label_names)
    if cfg.task.selection_metric == "f1" and num_labels != 2:  # F1 of the second class: binary tasks only
        raise ConfigError(f"finetune.task.metric = 'f1' needs a task of two labels; {folder / cfg.task.train_file} "
                          f"has {num_labels} ({', '.join(label_names)}): choose accuracy or matthews")
    task = {"folder": str(folder), "train_rows": len(train), "dev_rows": len(dev), "labels": label_names,
            "metric": cfg.task.selection_metric, "train_sha256": sha256_file(folder / cfg.task.train_file),
            "dev_sha256": sha256_file(folder / cfg.task.dev_file)}
    encoded_train = (encode(backbone.tokenizer, train, cfg.max_seq_len), train.labels)
    encoded_dev = (encode(backbone.tokenizer, dev, cfg.max_seq_len), dev.labels)
    if cfg.dropout < 0:  # the pre-trained model's own dropout, the same for --init none of that shape
        cfg = dataclasses.replace(cfg, dropout=backbone.model_config.dropout)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "finetune.toml", dump_toml(cfg))
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("grid", "seeds", "eval_batch_size")}
    del settings["task"]["path"]  # the task's identity is its files' hashes
    points, t0 = cfg.grid.points(), time.time()
    runs = {point_name(point): [] for point in points}
    runs_bar = tqdm(total=len(points) * len(cfg.seeds), desc="finetune", unit="run", disable=not progress)
    for point in points:
        for seed in cfg.seeds:
            key = {"format_version": RUN_FORMAT_VERSION, "point": point, "seed": seed, "settings": settings,
                   "task": identity(task), "backbone": identity(backbone.source)}
            path = out_dir / "runs" / point_name(point) / f"seed-{seed}.json"
            run = read_run(path)
            if run is not None and run["key"] != key:
                raise ConfigError(f"{path} holds a run of another model, task or setting; use another --out")
            if run is None:
                model = build_classifier(backbone, num_labels, cfg.dropout, seed)
                if cfg.embedding_row_rms:
                    rescale_embedding_rows(model.encoder, cfg.embedding_row_rms)
                run = {"key": key, **finetune_run(model, encoded_train, encoded_dev, point, seed, cfg, num_labels,
                                                  device, progress)}
                atomic_write_json(path, run)
            runs[point_name(point)].append({"seed": seed, **{k: v for k, v in run.items() if k != "key"}})
            runs_bar.update(1)
            runs_bar.set_postfix({cfg.task.selection_metric: f"{run['metrics'][cfg.task.selection_metric]:.4f}"})
    runs_bar.close()
    parameters = count_parameters(build_classifier(backbone, num_labels, cfg.dropout, 0))
    results = summarize(points, runs, cfg.task.selection_metric)
    results.update(task=task, backbone={**backbone.source, "parameters": parameters}, device=str(device),
                   seconds=time.time() - t0)
    write_results(out_dir, results)
    return results
