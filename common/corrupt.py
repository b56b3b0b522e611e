"""Corrupting rows with the frozen auxiliary model: what the generator writes to the shards and
what `fast-online` computes in the training loop, by the same code.

`Corruptor` loads the aux model once and is then a pure `batch -> batch` function
(paper section 3: mask, aux forward, sample at temperature T, label), unit-tested
without Ray.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common.augment import RowDropout, row_generators
from common.batching import attention_mask, length_batches, masked_inputs, to_device
from common.checkpoint import load_aux
from common.config import GenerateConfig
from common.corpus import term_counts
from common.curriculum import rtd_labels
from common.distributions import (aux_log_probs, chunk_draws, log_interpolation, redraw_without_mass,
                                  sample_from_log_weights, scratch_buffer, smoothed_one_hot_log_probs,
                                  temperature_draws, term_frequency_log_probs, uniform_log_probs)
from common.memory import LOGIT_CHUNK_ENTRIES
from common.model import MaskedLM
from common.tokenizer import Reserved


def needs_term_counts(distribution: str, augmentation: str) -> bool:
    return distribution in ("term_frequency", "tf_to_soh") or (distribution, augmentation) == ("aux", "tf_interpolation")


def top1_hits(logits: torch.Tensor, originals: torch.Tensor) -> torch.Tensor:
    """How many rows of (K, V) `logits` have their argmax at the row's original id (a device scalar). On CPU
    argmax is a slow reduction (~6x `amax` at 1,216 x 8,000): only the rows whose original reaches the row's
    max (or is NaN, which argmax ranks first) are arg-maxed, so a tie is decided as argmax decides it."""
    if logits.device.type != "cpu":  # argmax costs about amax there, and a row subset would sync
        return (logits.argmax(-1) == originals).sum()
    own = logits.gather(1, originals[:, None]).squeeze(1)
    rows = ((own == logits.amax(-1)) | own.isnan()).nonzero().squeeze(1)
    return (logits.index_select(0, rows).argmax(-1) == originals.index_select(0, rows)).sum()


def head_weight(model, autocast: torch.autocast | None) -> torch.Tensor | None:
    """Our aux model's tied head weight (vocabulary x width) in `autocast`'s dtype, cast once; None without
    autocast or for another model. Autocast keeps its casts only of weights that need a gradient, so the
    frozen model's matrix was cast again at every chunk of sampling (its cost on an H200: docs/benchmarks.md,
    bench-gpu). The same values as autocast's own cast."""
    if autocast is None or not isinstance(model, MaskedLM):
        return None
    return model.head.embedding.weight.detach().to(autocast.fast_dtype)


class Corruptor:
    """Frozen aux model -> corrupted ids and RTD labels for a batch of rows. The default is the
    paper's own curriculum (section 3); `distribution` / `augmentation` select the alternatives of
    section 5.1 and appendix C, applied to the rows of a call that come with `gammas`."""

    def __init__(self, aux_path: str | Path, seed: int, mask_prob: float, batch_tokens: int, device: str = "cpu",
                 distribution: str = "aux", augmentation: str = "temperature", soh_alpha: float = 0.35,
                 term_counts: np.ndarray | None = None, compile_draws: bool | None = None):
        """`compile_draws`: the temperature draw of each chunk through `torch.compile`
        (`common.distributions.chunk_draws`); None: on a GPU, where it is faster than step by step
        (docs/benchmarks.md, bench-gpu)."""
        self.device = torch.device(device)
        self.model, self.aux_meta = load_aux(aux_path, map_location=self.device)
        self.seed, self.mask_prob, self.batch_tokens = seed, mask_prob, batch_tokens
        self.distribution, self.augmentation, self.soh_alpha = distribution, augmentation, soh_alpha
        self.vocab_size = int(self.aux_meta["vocab_size"])
        self.reserved = Reserved.of(self.aux_meta)  # ids never sampled (an hf: tokenizer's, common/hf.py)
        self.log_tf = None if term_counts is None else term_frequency_log_probs(term_counts, self.device)
        if self.log_tf is None and needs_term_counts(distribution, augmentation):
            raise ValueError(f"distribution {distribution!r} / augmentation {augmentation!r} needs term counts")
        # bf16 autocast for the aux forward on GPU; softmax and sampling stay in fp32.
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else None
        self.head_weight = head_weight(self.model, self.autocast)
        # Sampling holds one chunk of positions x V logits at a time (2^26 entries: 524 positions at 128K).
        self.chunk_entries = LOGIT_CHUNK_ENTRIES
        if compile_draws is None:
            compile_draws = self.device.type == "cuda"
        # one static shape, the whole chunk (a batch's last chunk padded to it): one graph, and the same kernels
        # whatever the batch, so a shard's bytes do not depend on the order in which shapes were first seen
        self.draws = torch.compile(chunk_draws, dynamic=False) if compile_draws else None
        # The sampler's (positions, V) fp32 arrays (logits on CPU, scaled logits, CDF), kept from chunk to
        # chunk; `sample` runs under the actor's device lock, one call at a time.
        self.scratch: dict[str, torch.Tensor] = {}
        self.device_seconds = 0.0  # time in `sample` (aux forward and sampling), for the benchmarks

    @classmethod
    def from_config(cls, aux_path: str | Path, seed: int, cfg: GenerateConfig, corpus_dir: str | Path,
                    device: str = "cpu") -> "Corruptor":
        """The Corruptor of a manifest's [generate] table (term counts read beside the corpus)."""
        counts = term_counts(corpus_dir) if needs_term_counts(cfg.distribution, cfg.augmentation) else None
        return cls(aux_path, seed, cfg.mask_prob, cfg.batch_tokens, device, cfg.distribution, cfg.augmentation,
                   cfg.soh_alpha, counts)

    def masked_batches(self, rows: list[np.ndarray], row_ids: np.ndarray, epoch: int, drop_rates=None):
        """Per-row masked positions and uniforms, and the length-grouped model inputs as a list of
        (row indices, input ids, attention mask or None if no row is padded, masked flags) on the device, masked by
        `common.batching.masked_inputs`. With `drop_rates`, each row's aux input also gets that fraction of
        [UNK]s (appendix C), drawn after its other draws."""
        row_ids = np.asarray(row_ids)
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        positions, uniforms, batches = [None] * len(rows), [None] * len(rows), []
        for batch in length_batches(lengths, self.batch_tokens):
            longest = int(lengths[batch].max())
            made = masked_inputs([rows[i] for i in batch], row_ids[batch], epoch, self.seed, self.mask_prob, longest,
                                 reserved=self.reserved, vocab_size=self.vocab_size,
                                 drop_rates=None if drop_rates is None else np.asarray(drop_rates)[batch])
            flags, u, offset = made["masked_flags"], made["uniforms"].numpy(), 0
            for i, pos in zip(batch, made["positions"]):
                positions[i] = pos
                uniforms[i], offset = u[offset:offset + len(pos)], offset + len(pos)
            # no row padded (rows grouped by length: most batches of a 512-token corpus): no mask, so the aux
            # encoder keeps one attention bias for the batch (`common.model.Encoder.forward`)
            attn = None if lengths[batch].min() == longest else to_device(attention_mask(lengths[batch], longest),
                                                                          self.device)
            batches.append((batch, to_device(made["masked_ids"], self.device), attn, to_device(flags, self.device)))
        return positions, uniforms, batches

    def aux_logits(self, ids, attn, flags) -> torch.Tensor:
        """The aux model's logits at the masked positions of a batch, all at once, through the head call that
        sampling makes: the pure forward the benchmarks compare generation with. On CPU the result is the kept
        buffer, valid until the Corruptor's next call."""
        with self.autocast or contextlib.nullcontext():
            return self._head(self.model.masked_hidden(ids, attn, flags))

    def aux_hidden(self, ids, attn, flags, dropout=None, attention_dropout=None, generators=None) -> torch.Tensor:
        """The aux encoder's output at the masked positions; with per-row `dropout` / `attention_dropout` rates
        (appendix C), each row's masks drawn from its own generator (`common.augment.row_generators`)."""
        drop = None if dropout is None and attention_dropout is None else (
            RowDropout(attn, dropout, attention_dropout, generators))
        with self.autocast or contextlib.nullcontext():
            return self.model.masked_hidden(ids, attn, flags, drop)

    def _model_free(self, distribution: str, originals: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        """Section 5.1 / appendix B: replaced-token log-probabilities with no aux model, (K, V)."""
        k, v = len(originals), self.vocab_size
        if distribution == "uniform":
            return uniform_log_probs(k, v, self.device, self.reserved)
        if distribution == "term_frequency":
            return self.log_tf.expand(k, v).clone()
        soh = smoothed_one_hot_log_probs(originals, v, self.soh_alpha, self.reserved)
        if distribution == "smoothed_one_hot":
            return soh
        easy = uniform_log_probs(1, v, self.device, self.reserved)[0] if distribution == "uniform_to_soh" else self.log_tf
        return log_interpolation(easy, soh, gammas)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The aux head's logits at a chunk of positions. Without autocast (CPU) our own model writes them
        into a buffer kept from chunk to chunk (a fresh (positions, V) array costs its page faults each time),
        so the result is valid until the next call."""
        if self.autocast is None and isinstance(self.model, MaskedLM):
            shape = (hidden.shape[0], self.vocab_size)
            return self.model.logits(hidden, out=scratch_buffer(self.scratch, "logits", hidden, shape))
        if self.head_weight is not None:
            return self.model.logits(hidden, weight=self.head_weight)
        return self.model.logits(hidden)

    def _sample(self, hidden, part, uniforms, temperatures, gammas, originals):
        """Replacements at one chunk of a batch's masked positions (`part` of the (K,) per-position arrays), the
        aux top-1 hits there (0 without an aux model) and the positions the temperature draw left without mass
        (None where none is left), for the caller to redraw (`redraw_without_mass`). `hidden`: the aux encoder's
        output at those positions, or None. `gammas` None: the aux model at `temperatures` (paper eq. 1),
        whatever the curriculum."""
        distribution = "aux" if gammas is None else self.distribution
        augmentation = "temperature" if gammas is None else self.augmentation
        if distribution != "aux":
            log_w = self._model_free(distribution, originals[part], gammas[part])
            return sample_from_log_weights(log_w, uniforms[part], self.reserved, self.scratch), 0, None
        compiled = self.draws is not None and augmentation != "tf_interpolation"  # every draw at a temperature
        rows, count = hidden[part], len(originals[part])
        short = compiled and count < self.chunk_rows  # a batch's last chunk, padded to the compiled draw's one shape
        if short:
            rows = F.pad(rows, (0, 0, 0, self.chunk_rows - count))
        with self.autocast or contextlib.nullcontext():
            logits = self._head(rows)
        if compiled:  # the top-1 hits in the same graph: its pass for the maxima reads the logits anyway
            t, u, o = temperatures[part], uniforms[part], originals[part]
            if short:
                pad = (0, self.chunk_rows - count)
                t, u, o = F.pad(t, pad, value=1.0), F.pad(u, pad), F.pad(o, pad, value=-1)  # -1: never a hit
            ids, dead, hits = self.draws(logits, t, u, o, self.reserved.head, self.reserved.stop(self.vocab_size))
            return ids[:count], hits, dead[:count]
        hits = top1_hits(logits[:count], originals[part])
        if augmentation == "tf_interpolation":
            log_w = log_interpolation(self.log_tf, aux_log_probs(logits, self.reserved), gammas[part])
            return sample_from_log_weights(log_w, uniforms[part], self.reserved, self.scratch), hits, None
        ids, dead = temperature_draws(logits, temperatures[part], uniforms[part], self.reserved, self.scratch)
        return ids, hits, dead

    @property
    def chunk_rows(self) -> int:
        """Masked positions per chunk of sampling."""
        return max(1, self.chunk_entries // self.vocab_size)

    def sample(self, prepared, rows, row_ids, epoch: int, temperatures, gammas=None) -> tuple[list, int]:
        """The device half of a call: per batch, the aux encoder once, then its head and the sampler over
        chunks of `chunk_entries // V` masked positions, so memory holds one chunk's (positions, V), not the
        batch's. Returns the sampled ids of each batch (host arrays, in its rows' order) and the aux top-1 hits."""
        t0 = time.perf_counter()
        positions, uniforms, batches = prepared
        if np.isnan(temperatures).any():  # here, on the host: the sampler's own check would wait for the device
            raise ValueError("a temperature is NaN")
        step = self.chunk_rows
        out, hits = [], torch.zeros((), dtype=torch.long, device=self.device)
        for batch, ids, attn, flags in batches:
            counts = [len(positions[i]) for i in batch]
            on_device = lambda a, dtype=torch.float32: to_device(torch.from_numpy(a).to(dtype), self.device)
            per_position = lambda values: on_device(np.repeat(values[batch].astype(np.float32), counts))
            originals = on_device(np.concatenate([rows[i][positions[i]] for i in batch]), torch.long)
            u = on_device(np.concatenate([uniforms[i] for i in batch]), torch.float64)
            t = per_position(temperatures)
            g = None if gammas is None else per_position(gammas)
            hidden = None
            if (self.distribution if gammas is not None else "aux") == "aux":
                rates = {}
                if gammas is not None and self.augmentation in ("dropout", "attention_dropout"):
                    rates[self.augmentation] = on_device(gammas[batch].astype(np.float32))
                    rates["generators"] = row_generators(self.seed, epoch, row_ids[batch], self.device)
                hidden = self.aux_hidden(ids, attn, flags, **rates)
            sampled = torch.empty(len(originals), dtype=torch.long, device=self.device)
            dead = torch.zeros(len(originals), dtype=torch.bool, device=self.device)
            for start in range(0, len(originals), step):
                part = slice(start, start + step)
                sampled[part], chunk_hits, chunk_dead = self._sample(hidden, part, u, t, g, originals)
                hits += chunk_hits
                if chunk_dead is not None:
                    dead[part] = chunk_dead
            # positions the fast draw left without mass (broken logits), redrawn once a batch, not at every chunk:
            # asking whether there are any waits for the device
            if dead.any():
                where = dead.nonzero().squeeze(1)
                with self.autocast or contextlib.nullcontext():
                    logits = self._head(hidden[where])
                sampled[where] = redraw_without_mass(logits, t[where], u[where], self.reserved)
            out.append(sampled)
        out = [s.cpu().numpy() for s in out]
        self.device_seconds += time.perf_counter() - t0
        return out, int(hits)

    def prepare(self, rows: list[np.ndarray], row_ids: np.ndarray, epoch: int, gammas: np.ndarray | None = None):
        """The CPU half of a call (per-row masking and uniforms, padded inputs on the device); it needs
        no model, so a GPU actor runs it for the next shard while the device is busy."""
        row_ids = np.asarray(row_ids)
        drop = gammas if gammas is not None and self.distribution == "aux" and self.augmentation == "drop_token" else None
        return self.masked_batches(rows, row_ids, epoch, drop)

    @torch.no_grad()
    def __call__(self, rows: list[np.ndarray], row_ids: np.ndarray, epoch: int, temperatures: np.ndarray,
                 gammas: np.ndarray | None = None, prepared=None) -> dict:
        """Corrupt `rows` (original ids). Returns per-row corrupted ids and labels plus counts:
        masked positions, replaced positions, aux top-1 hits at masked positions (0 with no aux model).
        Without `gammas` the rows are corrupted by the aux model at `temperatures` whatever this
        Corruptor's curriculum (the validation rows; the paper's default path). `prepared`: the
        output of `prepare` for the same arguments, if already computed."""
        row_ids = np.asarray(row_ids)
        prepared = prepared or self.prepare(rows, row_ids, epoch, gammas)
        sampled, top1_hits = self.sample(prepared, rows, row_ids, epoch, temperatures, gammas)
        return self.finish(rows, prepared, sampled, top1_hits)

    @staticmethod
    def finish(rows, prepared, sampled, top1_hits: int) -> dict:
        """The host half after sampling: the sampled ids put in place, the RTD labels."""
        positions, _, batches = prepared
        corrupted = [r.astype(np.int32, copy=True) for r in rows]
        for (batch, *_), ids in zip(batches, sampled):
            offset = 0
            for i in batch:
                k = len(positions[i])
                corrupted[i][positions[i]] = ids[offset:offset + k]
                offset += k
        labels = [rtd_labels(r, c) for r, c in zip(rows, corrupted)]
        return {
            "input_ids": corrupted,
            "labels": labels,
            "masked": int(sum(len(p) for p in positions)),
            "replaced": int(sum(int(l.sum()) for l in labels)),
            "aux_top1": top1_hits,
        }
