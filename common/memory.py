"""The pre-flight check: one training micro-batch's peak memory, estimated before any work, against
what the device has (docs/design.md, trainer contract: a micro-batch that cannot fit stops the job first).

The estimate counts, for the model being trained (its parameters counted on the meta device, so
nothing is allocated):
  - 16 bytes per parameter: fp32 weights, gradients and Adam's two moments (+2 on a GPU under bf16
    autocast, for the cast copies of the weights); in the backward pass a tied embedding (the MLM
    output layer) holds two more table-sized gradients while its two contributions are summed, and
    accumulation one more (the new gradient beside the one it is added to);
  - the activations kept for the backward pass: per encoder layer, ACT_HIDDEN values per token and
    hidden unit, ACT_FFN per token and feed-forward unit and ACT_ATTENTION per (head, query, key); the
    (rows, heads, L, L) attention bias and its gradient once per encoder;
  - the head: the RTD head's per-token values, or the MLM head's masked positions and one chunk of
    (positions, vocabulary) fp32 logits with their softmax and gradient (`train.mlm`);
  - the process itself (interpreter, torch, the data reader): RUNTIME_BYTES, and TRITON_BYTES on CPU where
    Triton is installed (torch._dynamo, which every trainer imports, imports it then: `runtime_bytes`).
The coefficients were fitted to measured peaks on CPU (docs/benchmarks.md, the pre-flight estimate);
on a GPU the same counts are taken at 2 bytes per bf16 value, not yet checked against a measurement.
The generator's actors have an estimate of their own (`generation_need`, below).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from common.config import ConfigError, RunConfig

ACT_HIDDEN = 14.0
ACT_FFN = 3.0
ACT_ATTENTION = 2.0
RUNTIME_BYTES = {"cpu": 330 * 2**20, "cuda": 1024 * 2**20}
# Triton's modules in a CPU process (torch 2.13, Triton 3.9: `import torch._dynamo` peaks 100 MB higher where Triton
# can be imported than where it cannot in a fresh `make setup` venv, 71 MB in an older one; the larger counted).
# On a GPU, RUNTIME_BYTES["cuda"] stands for it (CUDA builds of torch bring Triton).
TRITON_BYTES = 100 * 2**20
# fp32 logits of one chunk of masked positions (train/mlm.py chunks by this constant)
LOGIT_CHUNK_ENTRIES = 2**26


def count_parameters_of(build) -> int:
    """Parameters of the model `build()` makes, counted on the meta device (no memory, no init cost)."""
    with torch.device("meta"):
        model = build()
    return sum(p.numel() for p in model.parameters())


def encoder_depths(config: RunConfig) -> list[int]:
    """Depths of the encoders one micro-batch runs through with gradients."""
    depth = config.model.num_layers
    if config.train.objective == "electra":
        return [depth, config.aux.num_layers]  # discriminator and generator (train/objectives.py)
    return [depth]


def parameters(config: RunConfig, vocab_size: int) -> int:
    from common.model import MaskedLM, ReplacedTokenDetector
    if config.train.objective == "mlm":
        return count_parameters_of(lambda: MaskedLM(config.model, vocab_size, config.model.num_layers))
    count = count_parameters_of(lambda: ReplacedTokenDetector(config.model, vocab_size))
    if config.train.objective == "electra":  # the generator shares the embeddings
        count += count_parameters_of(lambda: MaskedLM(config.model, vocab_size, encoder_depths(config)[1]))
        count -= vocab_size * config.model.hidden_size + 2 * config.model.hidden_size
    return count


def estimate_peak_bytes(config: RunConfig, vocab_size: int, rows: int, device_type: str = "cpu",
                        seq_len: int = 0, params: int = 0, accumulating: bool = True) -> float:
    """Estimated peak bytes of one process training `rows` rows per micro-batch of `seq_len` tokens
    (default: corpus.max_seq_len), with or without accumulation over micro-batches; `params` may be
    given to skip counting them."""
    m = config.model
    seq_len = seq_len or config.corpus.max_seq_len
    params = params or parameters(config, vocab_size)
    gpu = device_type == "cuda"
    value = 2 if gpu else 4  # bytes of an activation: bf16 under autocast on a GPU, fp32 on CPU
    table = vocab_size * m.hidden_size * 4  # the token embedding's fp32 gradient
    static = params * (18 if gpu else 16) + table * ((2 if config.train.objective in ("mlm", "electra") else 0)
                                                     + (1 if accumulating else 0))
    tokens = rows * seq_len
    attention = rows * m.num_heads * seq_len * seq_len
    acts = 0.0
    for depth in encoder_depths(config):
        acts += depth * (tokens * (ACT_HIDDEN * m.hidden_size + ACT_FFN * m.ffn_size) + ACT_ATTENTION * attention) * value
        acts += 2 * attention * value  # the bias shared by the layers, and its gradient
    objective = config.train.objective
    if objective in ("mlm", "electra"):
        mask_prob = config.aux.mask_prob if objective == "mlm" else config.generate.mask_prob
        masked = tokens * mask_prob
        chunk = min(masked, max(1, LOGIT_CHUNK_ENTRIES // vocab_size)) if objective == "mlm" else masked
        acts += masked * m.hidden_size * 4 * 4 + 3 * chunk * vocab_size * 4
    if objective != "mlm":
        acts += tokens * m.hidden_size * 3 * 4
    return runtime_bytes(device_type) + static + acts


def runtime_bytes(device_type: str) -> float:
    """What the process itself holds (interpreter, torch, the data reader), beyond its model and batches."""
    if device_type == "cuda":
        return RUNTIME_BYTES["cuda"]
    import importlib.util
    return RUNTIME_BYTES["cpu"] + (TRITON_BYTES if importlib.util.find_spec("triton") is not None else 0)


def available_bytes(device: torch.device) -> tuple[float, str]:
    """(bytes this process may use, where the number comes from): free GPU memory, or on CPU the
    smaller of MemAvailable and the cgroup's limit less its usage, shared by the ranks on this machine."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # blocks this process's caching allocator holds but no tensor uses (fast-online and electra corrupt
        # their validation rows on the GPU before the check) are the device's to give: free for this run
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return float(free + cached), f"free memory of {torch.cuda.get_device_name(device)}"
    available, source = host_available_bytes()
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks_here > 1:
        return available / ranks_here, f"{source} / {ranks_here} ranks on this machine"
    return available, source


def host_available_bytes() -> tuple[float, str]:
    """(bytes of RAM this machine can still give, where the number comes from): the smaller of MemAvailable
    and the memory cgroup's limit less its usage."""
    available, source = _meminfo_available(), "available RAM (MemAvailable)"
    limit = _cgroup_room()
    if limit is not None and limit < available:
        available, source = limit, "the memory cgroup's room"
    return available, source


def _meminfo_available() -> float:
    available = _proc_bytes("/proc/meminfo", "MemAvailable")
    return float("inf") if available is None else available  # not Linux: no number to check against


def _proc_bytes(path: str, key: str) -> float | None:
    """A `KEY: N kB` line of a /proc file, in bytes; None where there is none (not Linux)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_room() -> float | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
    except OSError:
        return None
    return None if limit == "max" else float(limit) - float(used)


def largest_fitting(config: RunConfig, vocab_size: int, budget: float, device_type: str, share: int,
                    params: int) -> int:
    """The largest micro-batch dividing a rank's `share` of rows whose estimate fits `budget` (0: none)."""
    fits = [m for m in range(1, share + 1) if share % m == 0
            and estimate_peak_bytes(config, vocab_size, m, device_type, params=params, accumulating=m < share) <= budget]
    return max(fits, default=0)


def preflight(config: RunConfig, vocab_size: int, micro: int, device: torch.device, what: str = "train",
              share: int = 0, beside: tuple[float, str] = (0.0, "")) -> float:
    """Refuse, before any work, a micro-batch of `micro` rows whose estimated peak exceeds the device's
    memory, naming both numbers and the largest micro-batch that fits. Returns the estimate in bytes.
    `beside`: (bytes, what) held beside the training at its peak whatever the micro-batch (fast-online's aux
    model: `online_aux_need`). FAST_ELECTRA_MEMORY_BYTES overrides the device's number (tests; a machine whose
    limit is elsewhere)."""
    params = parameters(config, vocab_size)
    extra, extra_what = beside
    need = extra + estimate_peak_bytes(config, vocab_size, micro, device.type, params=params,
                                       accumulating=micro < (share or micro))
    override = os.environ.get("FAST_ELECTRA_MEMORY_BYTES")
    have, source = (float(override), "FAST_ELECTRA_MEMORY_BYTES") if override else available_bytes(device)
    if need > have:
        best = largest_fitting(config, vocab_size, have - extra, device.type, share or micro, params)
        advice = (f"set {what}.micro_batch = {best} (accumulation makes up the batch)" if best else
                  "no micro-batch of this model fits: use a device with more memory" + (
                      " or more ranks, or a smaller [generate] batch_tokens (the aux model corrupts each rank's rows"
                      " of a batch in batches of that many tokens)" if extra else ""))
        held = f"; {extra / 2**30:.2f} GiB of it {extra_what}" if extra else ""
        raise ConfigError(f"{what}.micro_batch = {micro} rows of {config.corpus.max_seq_len} tokens needs about "
                          f"{need / 2**30:.2f} GiB by the pre-flight estimate ({params / 1e6:.1f}M parameters{held}), "
                          f"but {source} is {have / 2**30:.2f} GiB; {advice}")
    return need


def online_aux_need(corruptor, rows: int, seq_len: int, gpu: bool) -> float:
    """What fast-online's frozen aux model (`common.corrupt.Corruptor`) adds to the trainer's peak: its weights
    as loaded (with the head's bf16 copy on a GPU), and the corruption of a rank's `rows` of a batch, which its
    reader does while the detector trains (the generation actor's terms, `generation_need`: a batch of up to
    the corruptor's `batch_tokens` through the aux encoder, one sampling chunk, the rows' masking and labels;
    on a GPU the device's share). The pre-flight reads the free memory after the aux model is loaded, so its
    weights count twice there: a margin of their size (0.5 GB at base, 0.7 with a GPU's bf16 head)."""
    model = corruptor.model
    head = getattr(corruptor, "head_weight", None)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if head is not None and all(head.data_ptr() != p.data_ptr() for p in model.parameters()):
        weights += head.numel() * head.element_size()
    host, device = generation_need(aux_shape(model, corruptor.vocab_size), corruptor.batch_tokens, seq_len,
                                   rows * seq_len, 1, corruptor.mask_prob, gpu=gpu)
    return weights + (device if gpu else host - GEN_FIXED)


# --- generation actors -----------------------------------------------------------------------------------
# What one generation actor holds at its peak beyond what it holds once its aux model is loaded, per unit of
# work: fitted to the peak RSS of CPU actors writing a shard (22 shapes of full rows, 2 x 128 to 4 x 768 wide,
# vocabularies of 8K-128K, batches of 8K-64K tokens, shards of 64K-4M tokens), then the padded batches' own
# term measured apart (docs/benchmarks.md, bench-scale). On a GPU the aux forward and the sampler count the
# same values at 2 bytes (bf16 under autocast) instead of 4.
GEN_FIXED = 150 * 2**20
GEN_PER_LOGIT = 11.0        # per (position, id) of a sampling chunk: its logits and the sampler's kept arrays
GEN_PER_FFN = 8.0           # per token x feed-forward unit of a batch through the aux encoder
GEN_PER_HIDDEN = 20.0       # per token x hidden unit of that batch
GEN_PER_SCORE = 0.3         # per token x head x key position of that batch
# A batch with a padded row has an attention bias per row, (rows, heads, L, L): a corpus's short rows (each
# document's last) make such batches of nearly full length, so a shard's peak has one.
GEN_PER_PADDED_SCORE = 4.0
GEN_PER_SHARD_TOKEN = 30.0  # per token of a shard in flight, on the host: its rows, masking, labels, Parquet
GEN_DEVICE_SHARD_TOKEN = 9.0  # per token of a shard in flight, on a GPU: its masked ids (int64) and flags
# The share of free memory the actors may plan to fill: Ray's memory monitor kills workers at 95% of a node's
# memory, and a GPU's caching allocator holds more than its tensors.
GEN_HEADROOM = 0.9


@dataclasses.dataclass(frozen=True)
class AuxShape:
    hidden: int
    ffn: int
    heads: int
    vocab: int

    def __str__(self) -> str:
        return f"{self.hidden} wide, {self.ffn} feed-forward, {self.heads} heads, {self.vocab:,} ids"


def aux_shape(model, vocab_size: int) -> AuxShape:
    """The widths the generation estimate needs, of our aux model or a Hugging Face one (`common.hf`; a family
    without a feed-forward width in its config, e.g. DistilBERT's `hidden_dim`, falls back through its names,
    then to 4 x the width)."""
    config = getattr(getattr(model, "model", None), "config", None)
    if config is None:
        layer = model.encoder.layers[0]
        return AuxShape(layer.qkv.in_features, layer.ffn_in.out_features, layer.num_heads, vocab_size)
    first = lambda *names: next((getattr(config, n) for n in names if getattr(config, n, None)), None)
    hidden = first("hidden_size", "dim", "d_model", "n_embd")
    return AuxShape(hidden, first("intermediate_size", "hidden_dim", "d_ff", "n_inner") or 4 * hidden,
                    first("num_attention_heads", "n_heads", "n_head") or max(1, hidden // 64), vocab_size)


def generation_need(shape: AuxShape, batch_tokens: int, seq_len: int, shard_tokens: int, in_flight: int,
                    mask_prob: float, chunk_entries: int = LOGIT_CHUNK_ENTRIES, gpu: bool = False) -> tuple[float, float]:
    """(host bytes, GPU bytes) one generation actor needs at its peak beyond what it holds once its aux model
    is loaded: one batch of `batch_tokens` through the aux encoder (one row at least, a shard at most; its rows
    padded, as a corpus's short rows make some), one chunk of sampling (its masked positions x the
    vocabulary, `common.corrupt.Corruptor.sample`; a GPU's compiled draw always takes a whole chunk), and
    `in_flight` shards of `shard_tokens` being masked, labelled and written."""
    tokens = max(min(batch_tokens, shard_tokens), seq_len)
    chunk_rows = max(1, chunk_entries // shape.vocab)
    positions = chunk_rows if gpu else min(chunk_rows, max(1, round(mask_prob * tokens)))
    model = (GEN_PER_FFN * tokens * shape.ffn + GEN_PER_HIDDEN * tokens * shape.hidden
             + (GEN_PER_SCORE + GEN_PER_PADDED_SCORE) * tokens * shape.heads * seq_len
             + GEN_PER_LOGIT * positions * shape.vocab)
    host = GEN_FIXED + GEN_PER_SHARD_TOKEN * shard_tokens * in_flight
    if gpu:
        return host, model / 2 + GEN_DEVICE_SHARD_TOKEN * shard_tokens * in_flight
    return host + model, 0.0


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM, Linux). Not getrusage's ru_maxrss: Linux keeps it across exec, so a
    process read at least its parent's RSS at the fork (a trainer under a launcher, a benchmark's probe)."""
    peak = _proc_bytes("/proc/self/status", "VmHWM")
    if peak is not None:
        return int(peak)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # not Linux (macOS: bytes)
