"""`make bench-flops`: the paper's efficiency table (section 4.3, Table "Computation cost per batch
per update and memory consumption of ELECTRA"), recomputed from our own model classes.

    python -m bench.flops [--json bench/results/flops.json] [--md bench/results/flops.md]

Parameter counts come from `common.model` built on the meta device at the `base` and `large`
manifests (no memory is allocated); shapes, sequence length, vocabulary, batch and mask rate come
from the same manifests. Nothing is timed, so the figures do not depend on the machine.

Accounting convention that reproduces the paper's table (found by recomputing every cell):

Computation, GFLOPs = 1e9 FLOPs, per ONE 512-token sequence per update. The caption says "per
batch", but the numbers are per sequence; multiply by the batch (2048) for a whole update.
  - Forward FLOPs by Hoffmann et al. 2022 (Chinchilla), appendix F: embeddings counted as a matmul
    (2 * L * V * d, V = 128,000, not 131,072), and per layer the QKV projections, the key@query
    logits, the attention-weighted reduction, the output projection and the dense block.
  - The softmax term (3 * heads * L^2 per layer) is left out, and neither model gets a final-logits
    term: not the main model's RTD head, not the auxiliary model's MLM output layer.
    (With the softmax term every cell is 0.03-0.06% higher: still within 0.5%.)
  - Backward = 2 x forward, so a trained model costs 3 x forward: the main model always, and the
    jointly trained generator of the original ELECTRA. Fast-ELECTRA's frozen auxiliary model runs
    the forward pass only (1 x), hence the ratio 0.33.
  - The auxiliary model is the main model's width at depth 4 (base) / 6 (large), the paper's
    architecture table (1/3 of the main depth for base, 1/4 for large), in both methods.
The "full accounting" variant adds what the convention leaves out: the softmax term, the auxiliary
model's MLM output layer (2 * d * V per masked position, 15% of 512 = 76.8 positions) and the main
model's one-logit RTD output (2 * d per position). Head dense layers stay out, as in Chinchilla.

Memory, GB = 1e9 bytes (not GiB), whole batch of 2048 sequences, no gradient accumulation:
  - 20 bytes per trained parameter (fp16 weight and gradient, fp32 master weight and two Adam
    moments), 2 bytes per inference-only parameter (its fp16 weight).
  - Main model: all its parameters, token embedding included, are trained.
  - Original ELECTRA's generator: trained, but its token embedding (V x d) is left out since it is
    shared with the main model. Fast-ELECTRA's auxiliary model: all parameters at 2 bytes.
  - Activations: only the output of each encoding layer is stored (checkpointing inside a layer),
    2 bytes each: batch * L * d * num_layers, for trained models only (the embedding output and the
    heads are not counted). The inference-only auxiliary model stores none.
"Offline" is this project's path (section 4.3, "Offline preprocessing"): the auxiliary model ran
ahead of time, so it costs the trainer nothing.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from common.config import RunConfig, load_manifest
from common.io import atomic_write_json, atomic_write_text
from common.model import MaskedLM, ReplacedTokenDetector, count_parameters

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {"base": ROOT / "manifests/base.toml", "large": ROOT / "manifests/large.toml"}
TRAIN_MULTIPLIER = 3  # forward + backward, backward = 2 x forward (Kaplan et al. 2020)
BYTES_TRAINED = 20  # fp16 weight 2 + fp16 grad 2 + fp32 master 4 + Adam m 4 + Adam v 4 (Smith et al. 2022)
BYTES_INFERENCE = 2  # fp16 weight only
BYTES_ACTIVATION = 2  # one fp16 value per stored activation
GB = 1e9

# The paper's table, section 4.3 (tables/efficiency-analysis.tex): (main, aux, total) per method.
PAPER_GFLOPS = {
    "base": {"original": (591.9, 398.6, 990.5), "fast": (591.9, 132.9, 724.8)},
    "large": {"original": (1407.7, 653.9, 2061.6), "fast": (1407.7, 218.0, 1625.6)},
}
PAPER_MEMORY_GB = {
    "base": {"original": (23.0, 7.0, 30.0), "fast": (23.0, 0.25, 23.3)},
    "large": {"original": (60.2, 14.4, 74.6), "fast": (60.2, 0.42, 60.6)},
}
# The paper's architecture table (appendix A): parameters of main, aux and token embedding.
PAPER_PARAMS = {"base": (184e6, 127e6, 98e6), "large": (434e6, 208e6, 131e6)}


@dataclass(frozen=True)
class Encoder:
    """The shape the FLOPs formula needs: one transformer encoder of `num_layers` layers."""
    hidden_size: int
    ffn_size: int
    num_heads: int
    num_layers: int
    vocab_size: int


@dataclass(frozen=True)
class Params:
    """Parameter counts of our model classes at one preset."""
    main: int
    """ReplacedTokenDetector: encoder + RTD head."""
    aux: int
    """MaskedLM: encoder + MLM head (output layer tied to the token embedding)."""
    embed: int
    """The token embedding (vocab x hidden), shared by main and generator in the original ELECTRA."""


def count_params(config: RunConfig) -> Params:
    """Build main and aux model on the meta device (nothing allocated) and count their parameters.

    Paper appendix A, table "Configuration of model architectures"."""
    vocab = config.tokenizer.vocab_size
    with torch.device("meta"):
        main = ReplacedTokenDetector(config.model, vocab)
        aux = MaskedLM(config.model, vocab, config.aux.num_layers)
    return Params(main=count_parameters(main), aux=count_parameters(aux),
                  embed=aux.encoder.embed.weight.numel())


def encoder_forward_flops(enc: Encoder, seq_len: int, softmax: bool) -> float:
    """Forward FLOPs of embeddings + layers for one sequence, no output layer.

    Hoffmann et al. 2022, appendix F, as used by the paper in section 4.3 ("Computation cost").
    key_size * num_heads = hidden_size for our models."""
    L, d, f, h, V = seq_len, enc.hidden_size, enc.ffn_size, enc.num_heads, enc.vocab_size
    embeddings = 2 * L * V * d
    qkv = 2 * 3 * L * d * d
    logits = 2 * L * L * d  # key @ query
    softmax_flops = 3 * h * L * L if softmax else 0
    reduction = 2 * L * L * d  # softmax @ value
    projection = 2 * L * d * d
    dense = 2 * L * (d * f + f * d)
    layer = qkv + logits + softmax_flops + reduction + projection + dense
    return embeddings + enc.num_layers * layer


def output_layer_flops(hidden_size: int, output_size: int, positions: float) -> float:
    """Chinchilla's "final logits" term, 2 * d * output_size per position (appendix F).

    Used only by the full accounting: the paper's section 4.3 figures leave it out."""
    return 2 * positions * hidden_size * output_size


def training_gflops(forward_flops: float, trained: bool) -> float:
    """Section 4.3: backward = 2 x forward, so a trained model costs 3 x forward, a frozen one 1 x."""
    return forward_flops * (TRAIN_MULTIPLIER if trained else 1) / GB


def parameter_gb(params: int, trained: bool) -> float:
    """Section 4.3 ("Memory cost"): 20 bytes per trained parameter, 2 per inference-only one."""
    return params * (BYTES_TRAINED if trained else BYTES_INFERENCE) / GB


def activation_gb(batch: int, seq_len: int, hidden_size: int, num_layers: int) -> float:
    """Section 4.3: with checkpointing only each encoding layer's output is stored, in fp16,
    for the whole batch (footnote: gradient accumulation ignored)."""
    return batch * seq_len * hidden_size * num_layers * BYTES_ACTIVATION / GB


def efficiency_table(config: RunConfig, full: bool = False) -> dict:
    """One preset's rows {method: {main_gflops, aux_gflops, ..., total_memory_gb}} (section 4.3 table).

    `full=False` is the paper's convention; `full=True` adds softmax and both output layers."""
    m = config.model
    seq_len, vocab, batch = config.corpus.max_seq_len, config.tokenizer.vocab_size, config.train.batch_size
    main_enc = Encoder(m.hidden_size, m.ffn_size, m.num_heads, m.num_layers, vocab)
    aux_enc = Encoder(m.hidden_size, m.ffn_size, m.num_heads, config.aux.num_layers, vocab)
    main_fwd = encoder_forward_flops(main_enc, seq_len, softmax=full)
    aux_fwd = encoder_forward_flops(aux_enc, seq_len, softmax=full)
    if full:
        masked = config.generate.mask_prob * seq_len  # 0.15 * 512 = 76.8 positions
        main_fwd += output_layer_flops(m.hidden_size, 1, seq_len)  # one RTD logit per token
        aux_fwd += output_layer_flops(m.hidden_size, vocab, masked)  # MLM logits at masked positions

    p = count_params(config)
    main_mem = parameter_gb(p.main, trained=True) + activation_gb(batch, seq_len, m.hidden_size, m.num_layers)
    generator_mem = (parameter_gb(p.aux - p.embed, trained=True)
                     + activation_gb(batch, seq_len, m.hidden_size, config.aux.num_layers))
    frozen_aux_mem = parameter_gb(p.aux, trained=False)

    main_gflops = training_gflops(main_fwd, trained=True)
    aux_cost = {"original": (training_gflops(aux_fwd, trained=True), generator_mem),
                "fast": (training_gflops(aux_fwd, trained=False), frozen_aux_mem),
                "offline": (0.0, 0.0)}
    rows = {}
    for method, (aux_gflops, aux_mem) in aux_cost.items():
        rows[method] = {"main_gflops": main_gflops, "aux_gflops": aux_gflops,
                        "total_gflops": main_gflops + aux_gflops,
                        "main_memory_gb": main_mem, "aux_memory_gb": aux_mem, "total_memory_gb": main_mem + aux_mem}
    rows["ratio"] = {k: rows["fast"][k] / rows["original"][k] for k in rows["fast"]}
    return rows


def compute_all(presets: dict[str, Path] = PRESETS) -> dict:
    """{"paper": {preset: rows}, "full": {preset: rows}, "params": {preset: Params}}."""
    out = {"paper": {}, "full": {}, "params": {}}
    for name, path in presets.items():
        config = load_manifest(path)
        out["paper"][name] = efficiency_table(config, full=False)
        out["full"][name] = efficiency_table(config, full=True)
        out["params"][name] = count_params(config)
    return out


def flat_json(results: dict) -> dict:
    """docs/design.md: one key per cell, e.g. base_original_aux_gflops; full_ prefix for full accounting."""
    flat = {}
    for variant, prefix in (("paper", ""), ("full", "full_")):
        for preset, rows in results[variant].items():
            for method, cells in rows.items():
                for cell, value in cells.items():
                    flat[f"{prefix}{preset}_{method}_{cell}"] = round(value, 6)
    for preset, p in results["params"].items():
        flat.update({f"{preset}_main_params": p.main, f"{preset}_aux_params": p.aux,
                     f"{preset}_embed_params": p.embed})
    return flat


def _row(label: str, cells: dict, ratio: bool) -> str:
    g = "{:>8.2f}" if ratio else "{:>8.1f}"
    mem = "{:>7.2f}"
    return (f"  {label:<13}" + "".join(g.format(cells[k]) for k in ("main_gflops", "aux_gflops", "total_gflops"))
            + "  |" + "".join(mem.format(cells[k]) for k in ("main_memory_gb", "aux_memory_gb", "total_memory_gb")))


def format_table(rows_by_preset: dict, title: str) -> str:
    lines = [title, f"  {'':<13}{'Computation (GFLOPs)':^24}  |{'Memory (GB)':^21}",
             f"  {'':<13}{'Main':>8}{'Aux':>8}{'Total':>8}  |{'Main':>7}{'Aux':>7}{'Total':>7}"]
    labels = {"original": "Original", "fast": "Fast-ELECTRA", "ratio": "Ratio", "offline": "Offline"}
    for preset, rows in rows_by_preset.items():
        lines.append(preset.capitalize())
        for method in ("original", "fast", "ratio", "offline"):
            lines.append(_row(labels[method], rows[method], ratio=method == "ratio"))
    return "\n".join(lines)


def printed_decimals(value: float) -> int:
    """Digits after the point as the paper prints the cell (23.0 -> 1, 0.25 -> 2)."""
    return len(repr(value).split(".")[1])


def paper_deviation(rows_by_preset: dict) -> str:
    """Largest relative deviation from the paper's printed cells, computation and memory apart,
    and whether every cell rounds to the paper's printed value."""
    worst = {"gflops": (0.0, ""), "memory": (0.0, "")}
    unrounded = []
    for preset, rows in rows_by_preset.items():
        for method in ("original", "fast"):
            for kind, paper, suffix in (("gflops", PAPER_GFLOPS, "gflops"), ("memory", PAPER_MEMORY_GB, "memory_gb")):
                for part, ref in zip(("main", "aux", "total"), paper[preset][method]):
                    ours = rows[method][f"{part}_{suffix}"]
                    if round(ours, printed_decimals(ref)) != ref:
                        unrounded.append(f"{preset} {method} {part}: {ours:.3f} vs {ref}")
                    dev = ours / ref - 1
                    if abs(dev) > abs(worst[kind][0]):
                        worst[kind] = (dev, f"{preset} {method} {part} {ours:.4g} vs {ref}")
    rounding = ("every cell rounds to the paper's printed value" if not unrounded
                else "cells that do not round to the paper's: " + "; ".join(unrounded))
    return (f"largest deviation from the paper: computation {worst['gflops'][0]:+.3%} ({worst['gflops'][1]}), "
            f"memory {worst['memory'][0]:+.2%} ({worst['memory'][1]}, printed with 2 digits);\n  {rounding}")


def report(results: dict) -> str:
    params = "\n".join(
        f"  {preset:<6} main {p.main / 1e6:6.1f}M (paper {PAPER_PARAMS[preset][0] / 1e6:.0f}M)   "
        f"aux {p.aux / 1e6:6.1f}M (paper {PAPER_PARAMS[preset][1] / 1e6:.0f}M)   "
        f"embed {p.embed / 1e6:6.1f}M (paper {PAPER_PARAMS[preset][2] / 1e6:.0f}M)"
        for preset, p in results["params"].items())
    return "\n\n".join([
        "Parameters of common.model at manifests/{base,large}.toml (meta device):\n" + params,
        format_table(results["paper"], "Paper convention (section 4.3 table): GFLOPs per 512-token sequence per "
                     "update; memory in GB (1e9 B) for batch 2048"),
        "  FLOPs: Chinchilla app. F, embeddings + layers, softmax term and output layers left out;\n"
        "  trained model = 3 x forward (main; original generator), frozen aux = 1 x forward.\n"
        "  Memory: 20 B per trained parameter (original generator without its shared token embedding),\n"
        "  2 B per frozen-aux parameter, + fp16 output of every trained encoding layer x batch x 512 x hidden.\n"
        "  " + paper_deviation(results["paper"]),
        format_table(results["full"], "Full accounting: as above + softmax, aux MLM output layer at 15% x 512 = "
                     "76.8 masked positions, main RTD output (1 logit per token)"),
    ])


def markdown(results: dict) -> str:
    lines = ["# bench-flops", "", "`python -m bench.flops`: the paper's section 4.3 table from our model classes "
             "(analytic, machine-independent). GFLOPs per 512-token sequence per update; memory GB for batch 2048.",
             "", "| preset | accounting | method | main GFLOPs | aux GFLOPs | total GFLOPs "
             "| main GB | aux GB | total GB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for variant in ("paper", "full"):
        for preset, rows in results[variant].items():
            for method, c in rows.items():
                g = ".2f" if method == "ratio" else ".1f"
                lines.append(f"| {preset} | {variant} | {method} | {c['main_gflops']:{g}} | {c['aux_gflops']:{g}} | "
                             f"{c['total_gflops']:{g}} | {c['main_memory_gb']:.2f} | {c['aux_memory_gb']:.2f} | "
                             f"{c['total_memory_gb']:.2f} |")
    lines += ["", paper_deviation(results["paper"]), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the table as a flat JSON object here")
    parser.add_argument("--md", default=None, help="write a Markdown summary here")
    args = parser.parse_args(argv)
    results = compute_all()
    print(report(results))
    if args.json:
        atomic_write_json(args.json, flat_json(results))
    if args.md:
        atomic_write_text(args.md, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
