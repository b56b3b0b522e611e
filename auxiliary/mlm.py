"""`make aux`: train the auxiliary masked LM, standing in for "an existing model
from a previous training round" (paper section 3; section 4.1: MLM, lr 5e-4).

    python -m auxiliary --manifest manifests/tiny.toml [--corpus DIR] [--out DIR]  (`auxiliary/__main__.py`)

Masked positions always get [MASK] (the generator later feeds the aux model the
same kind of input). Writes aux.pt and aux.json (sha256, vocabulary, metrics).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from common.batching import attention_mask, pad_rows
from common.checkpoint import AUX_FILE, read_aux_meta, save_aux, save_hf_aux
from common.io import sha256_file
from common.config import RunConfig, save_resolved
from common.corpus import SplitRows, load_corpus_meta
from common.sources import CorpusError
from common.curriculum import mask_for_mlm, row_rng
from common.model import MaskedLM, count_parameters
from common.optim import build_optimizer, build_scheduler
from common.tokenizer import open_tokenizer


def mlm_batch(rows: list[np.ndarray], mask_prob: float, seed: int, step: int, row_ids) -> tuple:
    masked, positions = [], []
    for r, rid in zip(rows, row_ids):
        m, pos = mask_for_mlm(r, mask_prob, row_rng(seed, step, int(rid)))
        masked.append(m)
        positions.append(pos)
    ids = pad_rows(masked)
    mask_flags = torch.zeros(ids.shape, dtype=torch.bool)
    for i, pos in enumerate(positions):
        mask_flags[i, torch.from_numpy(pos)] = True
    targets = pad_rows(rows)[mask_flags]
    return ids, attention_mask([len(r) for r in rows], ids.shape[1]), mask_flags, targets


@torch.no_grad()
def evaluate_mlm(model: MaskedLM, rows: list[np.ndarray], mask_prob: float, seed: int, batch_size: int = 64) -> dict:
    model.eval()
    device = next(model.parameters()).device
    loss_sum, correct, count = 0.0, 0, 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        ids, attn, flags, targets = (t.to(device) for t in mlm_batch(chunk, mask_prob, seed, 10**9,
                                                                     range(start, start + len(chunk))))
        logits = model(ids, attn, flags)
        loss_sum += F.cross_entropy(logits.float(), targets, reduction="sum").item()
        correct += (logits.argmax(-1) == targets).sum().item()
        count += len(targets)
    model.train()
    return {"mlm_loss": loss_sum / max(count, 1), "mlm_top1": correct / max(count, 1)}


def train_aux(config: RunConfig, corpus_dir: Path, out_dir: Path, log=print) -> Path:
    cfg = config.aux
    meta = load_corpus_meta(corpus_dir)
    tok = open_tokenizer(corpus_dir)
    train_rows = SplitRows(corpus_dir, "train")  # memory-mapped: flat memory in corpus size
    valid = SplitRows(corpus_dir, "valid")
    valid_rows = [valid[i] for i in range(min(256, len(valid)))]
    torch.manual_seed(config.seed)
    # On a GPU when there is one (fp32; its weights then differ from a CPU run's, as the shards do).
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = MaskedLM(config.model, tok.vocab_size, cfg.num_layers).to(device)
    optimizer = build_optimizer(model, cfg.lr, config.train.betas, config.train.eps, config.train.weight_decay,
                                config.train.rel_bias_lr_scale)  # no embed_lr_scale: the MLM output is tied to it
    scheduler = build_scheduler(optimizer, cfg.warmup_steps, cfg.steps)
    log(f"aux: {count_parameters(model) / 1e6:.2f}M parameters, {cfg.num_layers} layers, "
        f"{cfg.steps} steps x {cfg.batch_size} rows, lr {cfg.lr}, on {device.type}")
    start_metrics = evaluate_mlm(model, valid_rows, cfg.mask_prob, config.seed)
    batch_rng = np.random.default_rng([config.seed, 0xA0C])
    t0, tokens = time.time(), 0
    bar = tqdm(range(cfg.steps), desc="aux MLM", unit="step", dynamic_ncols=True)
    for step in bar:
        row_ids = batch_rng.integers(0, len(train_rows), size=cfg.batch_size)
        rows = [train_rows[i] for i in row_ids]
        ids, attn, flags, targets = (t.to(device) for t in mlm_batch(rows, cfg.mask_prob, config.seed, step, row_ids))
        loss = F.cross_entropy(model(ids, attn, flags).float(), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.clip_norm)
        optimizer.step()
        scheduler.step()
        tokens += int(attn.sum())
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens / (time.time() - t0):.0f}")
    end_metrics = evaluate_mlm(model, valid_rows, cfg.mask_prob, config.seed)
    metrics = {"steps": cfg.steps, "start": start_metrics, "end": end_metrics,
               "tokens_per_s": tokens / (time.time() - t0)}
    path = save_aux(model.cpu(), config.model, cfg.num_layers, tok.vocab_size, meta["tokenizer_sha256"], out_dir, metrics)
    save_resolved(config, out_dir)
    log(f"aux: valid MLM loss {start_metrics['mlm_loss']:.3f} -> {end_metrics['mlm_loss']:.3f}, "
        f"top-1 {start_metrics['mlm_top1']:.3f} -> {end_metrics['mlm_top1']:.3f}; "
        f"{metrics['tokens_per_s']:.0f} tokens/s -> {path}")
    return path


def use_hf_aux(config: RunConfig, corpus_dir: Path, out_dir: Path, log=print) -> Path:
    """`[aux] source = "hf:PATH"`: nothing to train. Check that the model loads as a masked LM, that its
    tokenizer is the corpus's and that the rows fit its positions; record it (common/checkpoint.py)."""
    from common import hf
    source = hf.hf_dir(config.aux.source)
    meta = load_corpus_meta(corpus_dir)
    tok = open_tokenizer(corpus_dir)
    if getattr(tok, "source", None) != str(source):
        raise CorpusError(f"the corpus in {corpus_dir} was not tokenized with the tokenizer of {source}; "
                          f"rebuild it with the same [aux] source (`make corpus`)")
    model = hf.HFMaskedLM(source, tok.hf_of)  # refuses a directory without a masked-LM head
    if config.corpus.max_seq_len > model.max_positions:
        raise CorpusError(f"corpus.max_seq_len = {config.corpus.max_seq_len} is beyond the {model.max_positions} "
                          f"positions of the aux model in {source}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = save_hf_aux(source, tok.hf_of.tolist(), tok.reserved, meta["tokenizer_sha256"], out_dir,
                       hf.files_sha256(source, hf.MODEL_FILES))
    save_resolved(config, out_dir)
    log(f"aux: {type(model.model).__name__} from {source} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
        f"parameters), vocabulary {tok.vocab_size} of which {tok.reserved.head + tok.reserved.tail} never sampled "
        f"-> {path}")
    return path


def aux_is_current(config: RunConfig, corpus_dir: Path, out_dir: Path) -> bool:
    """True if aux.pt matches its aux.json, the current corpus's tokenizer and the manifest's sizes."""
    try:
        meta = read_aux_meta(out_dir / AUX_FILE)
        corpus = load_corpus_meta(corpus_dir)
    except (FileNotFoundError, CorpusError):
        return False
    if config.aux.source or meta.get("kind") == "hf":
        from common import hf
        source = hf.hf_dir(config.aux.source)
        return (meta.get("kind") == "hf" and source is not None and meta["source"] == str(source)
                and meta["tokenizer_sha256"] == corpus["tokenizer_sha256"]
                and meta["model_sha256"] == hf.files_sha256(source, hf.MODEL_FILES)
                and sha256_file(out_dir / AUX_FILE) == meta["sha256"])
    return (meta["tokenizer_sha256"] == corpus["tokenizer_sha256"] and meta["num_layers"] == config.aux.num_layers
            and meta["hidden_size"] == config.model.hidden_size and meta.get("steps") == config.aux.steps
            and sha256_file(out_dir / AUX_FILE) == meta["sha256"])
