"""`make plots`: the curriculum design space as PNG (paper section 5.1 figure, appendix C).

    python -m generate.plots --manifest PATH [--out DIR] [--corpus DIR] [--aux PATH]

Writes to OUT (default WORK_DIR/plots):
    schedules.png                     each schedule function gamma(u) / gamma_max over u, for a few tau
    replaced_token_distributions.png  the replaced-token distribution at one masked position of the
                                      paper's example sentence: uniform, term frequency, smoothed
                                      one-hot and the aux model at a few temperatures, tokens ranked
                                      by their frequency in the training corpus (log-log)
Both are computed by the generator's own functions (`common.curriculum`, `common.distributions`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from common.checkpoint import AUX_FILE, IncompatibleInputs, load_aux
from common.config import ConfigError, add_manifest_argument, add_set_argument, load_manifest
from common.corpus import term_counts
from common.curriculum import strength_at
from common.distributions import (aux_log_probs, replacement_probs, smoothed_one_hot_log_probs, temperature_scaled,
                                  term_frequency_log_probs, uniform_log_probs)
from common.io import DamagedFile, atomic_path
from common.sources import CorpusError
from common.tokenizer import CLS_ID, MASK_ID, SEP_ID, Tokenizer, open_tokenizer

# Paper section 5.1, footnote: a quote from Clark et al. (2020), "[large]" is the replaced token.
EXAMPLE = ("most current training methods require", "large", "amounts of compute to be effective")
SCHEDULE_TAUS = {"exponential": (0.05, 0.1, 0.3, 0.5, 0.7),  # the paper's sweep of tau (section 4.4)
                 "polynomial": (1.0, 3.0, 9.0), "stepwise": (2.0, 4.0, 10.0), "constant": (1.0,)}


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=90, format="png")
    plt.close(fig)
    return path


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def plot_schedules(path: Path) -> Path:
    """Appendix C: the four schedule functions of u, as gamma(u) / gamma_max (for temperature
    scaling, gamma = T - 1, so the exponential with tau = 0.1 is the paper's T(u) with T0 = 2)."""
    plt = _pyplot()
    u = np.linspace(0.0, 1.0, 1001)
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8), sharey=True, constrained_layout=True)
    formulas = {"exponential": "exp(-u/tau)", "constant": "1", "polynomial": "(1-u)^tau",
                "stepwise": "1 - floor(u tau)/tau"}
    for ax, (schedule, taus) in zip(axes, SCHEDULE_TAUS.items()):
        for tau in taus:
            label = None if schedule == "constant" else f"tau = {tau:g}"
            ax.plot(u, strength_at(u, schedule, 1.0, tau), label=label, lw=2.2 if tau in (0.1, 9.0, 10.0) else 1.2)
        ax.set_title(f"{schedule}: {formulas[schedule]}")
        ax.set_xlabel("u (fraction of training)")
        ax.grid(alpha=0.3)
        if schedule != "constant":
            ax.legend(fontsize=8)
    axes[0].set_ylabel("gamma(u) / gamma_max")
    return _save(fig, path)


def example_distributions(model, tok: Tokenizer, counts: np.ndarray, temperatures=(1.0, 2.0, 4.0),
                          alpha: float = 0.35) -> dict:
    """Section 5.1 figure: replaced-token probabilities (V,) at the first piece of the example's masked
    word, per distribution; plus `original` (its id) and `rank` (token ids by corpus frequency). `tok`: ours,
    or an hf: aux model's (common.hf.HFTokenizer), whose reserved ids get no mass, as in the generator."""
    reserved = tok.reserved
    before, word, after = EXAMPLE
    prefix, with_word = tok.encode(before), tok.encode(f"{before} {word}")
    ids = [CLS_ID, *tok.encode(f"{before} {word} {after}"), SEP_ID]
    limit = getattr(model, "max_positions", 0)  # an hf: model's position table; ours has none
    if limit and len(ids) > limit:  # its right context cut to fit
        ids = ids[:limit - 1] + [SEP_ID]
    positions = list(range(1 + len(prefix), 1 + len(with_word)))
    original = ids[positions[0]]
    masked = torch.tensor([ids])
    masked[0, positions] = MASK_ID
    flags = torch.zeros_like(masked, dtype=torch.bool)
    flags[0, positions[0]] = True
    with torch.no_grad():
        logits = model(masked, torch.ones_like(masked, dtype=torch.bool), flags)
    vocab = logits.shape[1]
    out = {"uniform": replacement_probs(uniform_log_probs(1, vocab, reserved=reserved), reserved),
           "term frequency": replacement_probs(term_frequency_log_probs(counts)[None], reserved),
           f"smoothed one-hot (alpha = {alpha:g})": replacement_probs(
               smoothed_one_hot_log_probs(torch.tensor([original]), vocab, alpha, reserved), reserved)}
    for t in temperatures:
        out[f"aux model, T = {t:g}"] = replacement_probs(
            temperature_scaled(aux_log_probs(logits, reserved), torch.tensor([t])), reserved)
    dists = {name: p[0].numpy() for name, p in out.items()}
    keys = counts.astype(np.float64).copy()
    stop = reserved.stop(vocab)
    keys[:reserved.head], keys[stop:] = -1.0, -1.0  # reserved ids last: they are in no distribution
    return {"distributions": dists, "original": original, "word": word,
            "rank": np.argsort(-keys, kind="stable")[:stop - reserved.head]}


def plot_distributions(example: dict, path: Path) -> Path:
    plt = _pyplot()
    rank = example["rank"]
    x = np.arange(1, len(rank) + 1)
    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    where = int(np.flatnonzero(rank == example["original"])[0])
    ax.axvline(where + 1, color="0.5", ls="--", lw=0.8, zorder=0,
               label=f"original token '{example['word']}' (rank {where + 1}); dots: its probability")
    aux_names = [n for n in example["distributions"] if n.startswith("aux")]
    shades = plt.cm.Reds(np.linspace(0.95, 0.45, len(aux_names)))
    colors = {**dict(zip(("uniform", "term frequency"), ("tab:blue", "tab:orange"))), **dict(zip(aux_names, shades))}
    for name, probs in example["distributions"].items():
        p = probs[rank]
        color = colors.get(name, "tab:green")
        ax.plot(x[p > 0], p[p > 0], lw=1.0, label=name, color=color)
        ax.plot([where + 1], [p[where]], "o", color=color, markersize=6, markeredgecolor="k", markeredgewidth=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("token, ranked by term frequency in the training corpus")
    ax.set_ylabel("probability of the replaced token")
    ax.set_title("replaced-token distributions: " + " ".join((EXAMPLE[0], f"[{EXAMPLE[1]}]", EXAMPLE[2])), fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m generate.plots", description=__doc__.split("\n\n")[0])
    add_manifest_argument(parser)
    add_set_argument(parser)
    parser.add_argument("--out", default=None, help="output folder (default: WORK_DIR/plots)")
    parser.add_argument("--corpus", default=None, help="corpus folder (default: the manifest's)")
    parser.add_argument("--aux", default=None, help="auxiliary model (default: the manifest's)")
    args = parser.parse_args(argv)
    try:
        config = load_manifest(args.manifest, args.sets)
        out = Path(args.out) if args.out else Path(config.work_dir) / "plots"
        corpus = Path(args.corpus) if args.corpus else config.corpus_dir
        aux = Path(args.aux) if args.aux else config.aux_dir / AUX_FILE
        model, _ = load_aux(aux)
        example = example_distributions(model, open_tokenizer(corpus), term_counts(corpus),
                                        alpha=config.generate.soh_alpha)
        paths = [plot_schedules(out / "schedules.png"), plot_distributions(example, out / "replaced_token_distributions.png")]
    except (ConfigError, CorpusError, IncompatibleInputs, FileNotFoundError, DamagedFile) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("plots: " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
