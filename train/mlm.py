"""`mlm`: the auxiliary masked LM, trained by the one training loop (`make aux`; paper section 3:
"an existing model from a previous training round"; section 4.1: MLM, lr 5e-4).

The stream is `max_steps x batch_size` rows of the corpus's training split, epoch after epoch,
each epoch a seeded permutation in an order of the aux model's own (`common.plan.epoch_order`:
nothing the size of the corpus is held). Row r of epoch e is masked from the aux stream
(`common.curriculum.AUX_MLM_STREAM`), which never coincides with the masks the generator later
writes for that row. Masked positions always get [MASK], the input the generator feeds the model.
Logits exist only at masked positions, a chunk of positions at a time: each chunk's (positions,
vocabulary) logits are recomputed in the backward pass instead of kept, so a 128K vocabulary costs
one chunk's logits whatever the micro-batch.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from common.batching import attention_mask, flat_positions, masked_inputs, to_device
from common.config import RunConfig
from common.corpus import SplitRows, load_corpus_meta
from common.curriculum import AUX_MLM_STREAM, VALID_EPOCH
from common.memory import LOGIT_CHUNK_ENTRIES  # 2^26 fp32 logits (256 MiB): 524 positions at 128K entries
from common.model import MaskedLM, at_positions
from common.plan import epoch_order, validation_rows
from common.tokenizer import Reserved
from train.objectives import MLM_INPUTS
from train.online import RowsInMemory


def chunk_positions(vocab_size: int) -> int:
    return max(1, LOGIT_CHUNK_ENTRIES // vocab_size)


class CorpusStream:
    """Rows [start, stop) of the aux stream: corpus rows with their row ids and epochs."""

    def __init__(self, corpus_dir: Path, total_rows: int, seed: int):
        self.corpus = SplitRows(corpus_dir, "train")
        self.per_epoch, self.num_rows, self.seed = len(self.corpus), total_rows, seed

    def rows(self, start: int, stop: int) -> dict:
        assert 0 <= start <= stop <= self.num_rows, (start, stop, self.num_rows)
        stream = np.arange(start, stop, dtype=np.int64)
        epochs = stream // self.per_epoch
        row_ids = np.empty_like(stream)
        for epoch in np.unique(epochs):
            at = epochs == epoch
            order = epoch_order(self.per_epoch, int(epoch), self.seed, AUX_MLM_STREAM)
            row_ids[at] = order(stream[at] - epoch * self.per_epoch)
        return {"input_ids": [self.corpus[int(i)] for i in row_ids], "row_id": row_ids, "epoch": epochs,
                "stream_index": stream}


class MLMObjective(MaskedLM):
    """The aux model (its parameters and state_dict are `MaskedLM`'s) whose forward returns the MLM
    loss summed over the masked positions and the top-1 hits, through chunked logits."""

    def forward(self, masked_ids, attention_mask, masked_index, targets):
        """`masked_index`: the masked positions as flat indices (`mlm_tensors`), `targets` the originals there."""
        return self._losses(at_positions(self.encoder(masked_ids, attention_mask), masked_index), targets)

    # Left out of torch.compile (`[train] compile`): a loop over the masked positions' count would be traced
    # into one graph per count, and that count changes with the rows' lengths (a recompile at every batch
    # until torch gives up on compiling). The encoder before it is compiled; this is matrix products.
    @torch.compiler.disable
    def _losses(self, hidden, targets):
        step = chunk_positions(self.head.bias.numel())
        loss, hits = hidden.new_zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.long, device=hidden.device)
        for start in range(0, len(targets), step):
            part = (hidden[start:start + step], targets[start:start + step])
            if torch.is_grad_enabled() and len(targets) > step:  # keep no logits: recompute them in backward
                chunk_loss, chunk_hits = checkpoint(self._chunk, *part, use_reentrant=False)
            else:
                chunk_loss, chunk_hits = self._chunk(*part)
            loss, hits = loss + chunk_loss, hits + chunk_hits
        return loss, hits

    def _chunk(self, hidden, targets):
        logits = self.head(hidden).float()
        return F.cross_entropy(logits, targets, reduction="sum"), (logits.detach().argmax(-1) == targets).sum()


def mlm_tensors(rows: dict, seed: int, mask_prob: float, reserved: Reserved = Reserved(), vocab_size: int = 0) -> dict:
    """Corpus rows -> [MASK]ed inputs, attention mask, the masked positions (flat indices, made here on the
    host: the forward never waits for the device to count them) and the original ids there."""
    lengths = [len(r) for r in rows["input_ids"]]
    batch = masked_inputs(rows["input_ids"], rows["row_id"], rows["epoch"], seed, mask_prob, max(lengths),
                          stream=AUX_MLM_STREAM, reserved=reserved, vocab_size=vocab_size)
    index = flat_positions(batch["masked_flags"])
    return {"masked_ids": batch["masked_ids"], "attention_mask": attention_mask(lengths, max(lengths)),
            "masked_index": index, "targets": batch["original_ids"].flatten()[index]}


def valid_rows(corpus_dir: Path, count: int) -> RowsInMemory:
    """`count` held-out rows spread over the split (`common.plan.validation_rows`), masked (by
    `mlm_tensors`) at the validation epoch."""
    rows = SplitRows(corpus_dir, "valid")
    count = min(count, len(rows))
    ids = validation_rows(np.arange(count), len(rows), count)
    return RowsInMemory({"input_ids": [rows[int(i)] for i in ids], "row_id": ids, "epoch": np.full(len(ids), VALID_EPOCH)})


@torch.no_grad()
def evaluate_mlm(model: MLMObjective, valid: RowsInMemory, device, autocast, to_batch, batch_size: int = 64) -> dict:
    """MLM loss per masked token and top-1 accuracy on the validation rows (`to_batch`: `mlm_tensors`
    with the run's seed, mask rate and reserved ids)."""
    model.eval()
    loss_sum, hits, count = 0.0, 0, 0
    for start in range(0, valid.num_rows, batch_size):
        batch = to_batch(valid.rows(start, min(start + batch_size, valid.num_rows)))
        with autocast:
            loss, hit = model(*(to_device(batch[k], device) for k in MLM_INPUTS))  # page-locked, as in training
        loss_sum, hits, count = loss_sum + float(loss), hits + int(hit), count + len(batch["targets"])
    model.train()
    return {"loss": loss_sum / max(count, 1), "top1": hits / max(count, 1)}


def mlm_streams(config: RunConfig, corpus_dir: Path) -> tuple:
    """(training stream, validation rows, vocabulary size, data key) of the `mlm` objective. The key names
    the corpus (its parts and tokenizer): a checkpoint trained on another corpus is refused on resume."""
    meta = load_corpus_meta(corpus_dir)
    stream = CorpusStream(corpus_dir, config.train.max_steps * config.train.batch_size, config.seed)
    parts = {split: [p["sha256"] for p in meta[split]["parts"]] for split in ("train", "valid")}
    key = hashlib.sha256(json.dumps({"mlm": parts, "tokenizer": meta["tokenizer_sha256"]}).encode()).hexdigest()
    return stream, valid_rows(corpus_dir, config.aux.valid_rows), meta["vocab_size"], key
