"""`make bench-efficiency`: seconds per update and peak memory of electra / fast-online / fast-offline,
same main model, same batch, measured interleaved in one run (paper section 4.3, table
"efficiency on device"), and the break-even number of reuses of the dumped shards.

    python -m bench.efficiency --manifest manifests/tiny.toml [--layers 6] [--steps 24] [--vocab paper]

Shape: the manifest's main model at `--layers` depth (CPU default 6, so the 2-layer tiny aux is
1/3 of it, the paper's proportion; the electra generator has the aux model's depth and the main width).
  fast-offline  rows read from the shards (as the trainer reads them), RTD update
  fast-online   the same rows corrupted in the loop by the frozen aux model (train/online.py), RTD update
  electra       the same rows masked, generator MLM + sampling + discriminator, joint update (the manifest's lambda)
Vocabulary: `--vocab 0` (default) is the data's (tiny: 8000, so V/d = 31 at width 256); `--vocab paper`
is the paper's proportion, round(128000 * hidden / 768) (42667 at 256, V/d = 166.7 as in base), the term
that drives the paper's 0.598; `--vocab N` any N >= the data's. Main model, electra generator and
fast-online's aux model all get V rows; the aux is then a seeded random one of the real aux's architecture
(compute does not depend on its weights), written to a temporary aux.pt. Data ids stay < the data's
vocabulary, valid in the bigger tables. Results: bench/results/efficiency-paper-vocab.{json,md}
(`efficiency-vocab<N>` for another N) beside the data vocabulary's efficiency.{json,md}.
`make bench-efficiency` passes `--vocab paper` (BENCH_VOCAB=0: the data's).
Memory: on GPU, torch.cuda.max_memory_allocated per mode; on CPU, each mode runs in its own process
and reports its peak RSS above the process's RSS before the mode built anything.
Allocator (CPU): glibc gives big freed blocks back to the kernel, so every update faults its activations'
pages in again; the minor page faults per update are reported. `--keep-freed-memory` times with them kept,
as the CUDA caching allocator keeps them (common/cpu_memory.py; results get a `-kept-memory` suffix).
Break-even: generation is paid once (g seconds per update's worth of rows, measured here with the
generator's own Corruptor + Parquet writer); offline's total cost over n runs, g + n * t_off, beats
online's n * t_on from n >= g / (t_on - t_off).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch

from bench import machine
from bench.flops import PRESETS, Encoder, encoder_forward_flops, output_layer_flops
from common.checkpoint import AUX_FILE, save_aux
from common.cpu_memory import keep_freed_memory
from common.curriculum import masked_count
from common.config import config_from_dict, config_to_dict, load_manifest
from common.io import atomic_write_json, atomic_write_text
from common.corpus import load_corpus_meta
from common.model import MaskedLM, ReplacedTokenDetector
from common.optim import build_optimizer, build_scheduler
from common.shards import SHARD_ENCODING, SHARD_SCHEMA, int_lists, write_parquet
import train.trainer as trainer
from train.objectives import electra_tensors
from train.data import load_data_manifest, to_tensors, training_stream
from train.objectives import ElectraPair
from train.online import OnlineStream

RESULTS = Path("bench/results")
MODES = ("electra", "fast-online", "fast-offline")


def bench_config(manifest: str, layers: int):
    values = config_to_dict(load_manifest(manifest))
    values["model"]["num_layers"] = layers
    return config_from_dict(values)


def paper_vocab(hidden_size: int) -> int:
    """The paper's vocabulary-to-width proportion (manifests/base.toml: 128000 / 768) at `hidden_size`:
    42667 at 256."""
    base = load_manifest(PRESETS["base"])
    return round(base.tokenizer.vocab_size * hidden_size / base.model.hidden_size)


def vocab_arg(text: str) -> str | int:
    if text == "paper":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--vocab takes 'paper' or a number of tokens, not {text!r}")
    return int(text)


def resolve_vocab(option: str | int, config) -> int:
    """`--vocab` -> the number of tokens of every model: 0 = the data's, 'paper' = the paper's proportion."""
    data = config.tokenizer.vocab_size
    vocab = paper_vocab(config.model.hidden_size) if option == "paper" else option or data
    if vocab < data:
        raise ValueError(f"--vocab {vocab} is smaller than the data's vocabulary ({data}): its ids would not fit")
    return vocab


def save_random_aux(config, vocab: int, out_dir: Path) -> Path:
    """An aux.pt of the real aux's architecture (auxiliary/mlm.py) with `vocab` tokens, seeded random weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = MaskedLM(config.model, vocab, config.aux.num_layers)
    sha = load_corpus_meta(config.corpus_dir)["tokenizer_sha256"]  # the ids are still that tokenizer's
    return save_aux(model, config.model, config.aux.num_layers, vocab, sha, out_dir,
                    {"steps": 0, "note": f"bench.efficiency: random weights, vocabulary {vocab}"})


@contextmanager
def bench_aux(config, vocab: int, given: str | None = None):
    """The aux.pt fast-online and the generation timing load: `given`, else the trained one when the
    vocabulary is the data's, else a random one of `vocab` tokens in a temporary folder."""
    if given:
        yield Path(given)
    elif vocab == config.tokenizer.vocab_size:
        yield config.aux_dir / AUX_FILE
    else:
        with tempfile.TemporaryDirectory(prefix="bench-aux-") as tmp:
            yield save_random_aux(config, vocab, Path(tmp))


class Mode:
    """One objective: its stream, its model + optimizer, and `step()` = read the next batch and update.
    `vocab`: the models' vocabulary (default: the data's); `aux_path`: fast-online's aux (default: WORK/aux)."""

    def __init__(self, name: str, config, data_dir: Path, device: torch.device, vocab: int | None = None,
                 aux_path: Path | None = None):
        self.name, self.config, self.device = name, config, device
        tc, g = config.train, config.generate
        manifest, _ = load_data_manifest(data_dir, config)
        if name == "fast-offline":
            self.stream = training_stream(data_dir, manifest)
        else:
            from common.corrupt import Corruptor
            corruptor = Corruptor(aux_path or config.aux_dir / AUX_FILE, config.seed, g.mask_prob, g.batch_tokens,
                                  device=device.type) if name == "fast-online" else None
            assert corruptor is None or vocab is None or corruptor.vocab_size == vocab, (corruptor.vocab_size, vocab)
            self.stream = OnlineStream(config, config.corpus_dir, corruptor)
        torch.manual_seed(tc.seed)
        vocab = vocab or manifest["vocab_size"]
        self.model = (ElectraPair(config.model, vocab, config.aux.num_layers) if name == "electra" else ReplacedTokenDetector(config.model, vocab)).to(device)
        self.optimizer = build_optimizer(self.model, tc.lr, tc.betas, tc.eps, tc.weight_decay, tc.rel_bias_lr_scale,
                                         tc.embed_lr_scale)
        self.scheduler = build_scheduler(self.optimizer, tc.warmup_steps, 10_000)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
        self.to_batch = partial(electra_tensors, seed=config.seed, mask_prob=g.mask_prob) if name == "electra" else to_tensors
        self.tc = dataclasses.replace(tc, objective=name)  # what the trainer's update function reads
        self.count_masked = partial(masked_count, mask_prob=g.mask_prob)
        self.position = 0

    def step(self) -> None:
        b = self.config.train.batch_size
        if self.position + b > self.stream.num_rows:
            self.position = 0
        rows = self.stream.rows(self.position, self.position + b)
        self.position += b
        # the trainer's own update (train.trainer.update): its loss, backward, clip, AdamW, schedule
        trainer.update(self.model, self.model, self.optimizer, self.scheduler, [rows], self.to_batch, self.device,
                       self.autocast, 1, self.tc, self.count_masked)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def generation_seconds_per_update(config, data_dir: Path, device: torch.device, repeats: int, aux_path: Path) -> float:
    """What generate/ spends per update's worth of rows: Corruptor (mask, aux, sample, label) + Parquet write."""
    from common.corrupt import Corruptor
    g = config.generate
    corruptor = Corruptor(aux_path, config.seed, g.mask_prob, g.batch_tokens, device=str(device))
    stream = OnlineStream(config, config.corpus_dir, None)
    b = config.train.batch_size
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            rows = stream.rows(r * b, (r + 1) * b)
            t0 = time.perf_counter()
            out = corruptor(rows["input_ids"], np.asarray(rows["row_id"]), rows["epoch"][0], rows["temperature"].astype(np.float64))
            write_parquet(Path(tmp) / f"s{r}.parquet", {
                "stream_index": rows["stream_index"], "row_id": np.asarray(rows["row_id"], dtype=np.int64),
                "temperature": rows["temperature"], "input_ids": int_lists(out["input_ids"], SHARD_SCHEMA.field("input_ids").type.value_type),
                "labels": int_lists(out["labels"], SHARD_SCHEMA.field("labels").type.value_type)},
                SHARD_SCHEMA, SHARD_ENCODING, g.zstd_level)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def analytic_ratios(config, vocab: int | None = None) -> dict:
    """FLOPs per sequence per update for the measured shape, two conventions (bench/flops.py);
    `vocab`: the models' vocabulary (default: the data's)."""
    m, L, V = config.model, config.corpus.max_seq_len, vocab or config.tokenizer.vocab_size
    enc = lambda layers: Encoder(m.hidden_size, m.ffn_size, m.num_heads, layers, V)
    aux_layers = gen_layers = config.aux.num_layers  # ELECTRA's generator has the aux model's depth
    masked = config.generate.mask_prob * L
    # the paper's convention: embeddings as a matmul, no output layers
    main, gen, aux = (encoder_forward_flops(enc(n), L, softmax=False) for n in (m.num_layers, gen_layers, aux_layers))
    paper = {"offline_vs_electra": 3 * main / (3 * main + 3 * gen), "online_vs_electra": (3 * main + aux) / (3 * main + 3 * gen)}
    # as executed: embedding lookups cost nothing, MLM output layer at masked positions, RTD head per token
    lookup = lambda n: encoder_forward_flops(enc(n), L, softmax=True) - 2 * L * V * m.hidden_size
    head = lambda positions, out: output_layer_flops(m.hidden_size, m.hidden_size, positions) + output_layer_flops(m.hidden_size, out, positions)
    main_x = lookup(m.num_layers) + head(L, 1)
    gen_x, aux_x = lookup(gen_layers) + head(masked, V), lookup(aux_layers) + head(masked, V)
    executed = {"offline_vs_electra": 3 * main_x / (3 * main_x + 3 * gen_x),
                "online_vs_electra": (3 * main_x + aux_x) / (3 * main_x + 3 * gen_x)}
    return {"paper_convention": paper, "as_executed": executed}


def design_ratios(seconds: dict, memory: dict, analytic: dict) -> dict:
    """The results' ratios under docs/design.md's key names (ours / ELECTRA); the analytic reference is
    the paper's own FLOPs convention, the as-executed count beside it."""
    return {"offline_vs_electra_time": seconds["fast-offline"] / seconds["electra"],
            "online_vs_electra_time": seconds["fast-online"] / seconds["electra"],
            "offline_vs_electra_memory": memory["fast-offline"] / memory["electra"],
            "online_vs_electra_memory": memory["fast-online"] / memory["electra"],
            "analytic_offline_vs_electra": analytic["paper_convention"]["offline_vs_electra"],
            "analytic_offline_vs_electra_as_executed": analytic["as_executed"]["offline_vs_electra"]}


def rss_mb() -> float:
    """Current resident set size of this process (Linux /proc), in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_probe(manifest: str, layers: int, data_dir: str, mode: str, steps: int, vocab: int, aux_path: Path) -> None:
    """In a fresh process: peak RSS while one mode builds its stream and model and runs `steps`
    updates, minus the RSS before it started (a sampling thread reads RSS every 0.5 ms; ru_maxrss
    cannot be used, its peak is set by the imports)."""
    config = bench_config(manifest, layers)
    base, peak, done = rss_mb(), [0.0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.0005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    runner = Mode(mode, config, Path(data_dir), torch.device("cpu"), vocab, aux_path)
    for _ in range(steps):
        runner.step()
    done.set()
    sampler.join()
    print(json.dumps({"peak_mb": max(peak[0], rss_mb()) - base}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.efficiency")
    parser.add_argument("--manifest", default="manifests/tiny.toml")
    parser.add_argument("--data", default=None, help="generated shards (default: WORK_DIR/epochs)")
    parser.add_argument("--layers", type=int, default=6, help="main model depth (the manifest's aux and generator depth: 1/3 of 6)")
    parser.add_argument("--steps", type=int, default=24, help="timed updates per mode")
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--vocab", type=vocab_arg, default=0,
                        help="models' vocabulary: 0 = the data's (default), 'paper' = round(128000 * hidden / 768), or N")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="CPU: time with freed blocks kept in the process, as the CUDA caching allocator keeps "
                             "them (common/cpu_memory.py; default: glibc's default, which gives them back)")
    parser.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--aux", default=None, help=argparse.SUPPRESS)  # the probe gets the parent's aux.pt
    args = parser.parse_args(argv)
    config = bench_config(args.manifest, args.layers)
    data_dir = Path(args.data) if args.data else config.epochs_dir
    try:
        vocab = resolve_vocab(args.vocab, config)
    except ValueError as e:
        parser.error(str(e))
    with bench_aux(config, vocab, args.aux) as aux_path:
        if args.memory_probe:
            memory_probe(args.manifest, args.layers, str(data_dir), args.memory_probe, 4, vocab, aux_path)
            return 0
        return run(args, config, data_dir, vocab, aux_path)


def run(args, config, data_dir: Path, vocab: int, aux_path: Path) -> int:
    """Time the three modes interleaved, probe their memory, time generation; write the results."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    is_paper = vocab == paper_vocab(config.model.hidden_size)
    allocator = "cuda caching allocator"
    if device.type == "cpu":
        allocator = "glibc, freed memory kept" if args.keep_freed_memory and keep_freed_memory() else "glibc default"
    if config.aux.num_layers * 3 != args.layers:
        print(f"note: aux has {config.aux.num_layers} layers, main {args.layers}: not the paper's 1/3")

    modes = {name: Mode(name, config, data_dir, device, vocab, aux_path) for name in MODES}
    for mode in modes.values():  # warm-up, not timed
        mode.step()
    times, faults = {name: [] for name in MODES}, {name: 0 for name in MODES}
    while len(times["fast-offline"]) < args.steps:
        for name, mode in modes.items():  # blocks alternate: machine drift hits every mode alike
            for _ in range(args.block):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                mode.step()
                times[name].append(time.perf_counter() - t0)
                faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    seconds = {name: statistics.median(t) for name, t in times.items()}
    faults = {name: faults[name] / len(times[name]) for name in MODES}
    del modes, mode  # the loop's last mode too: its model and optimizer would count in every peak below

    memory = {}
    if device.type == "cuda":
        from bench.gpu import reset_peak_memory
        for name in MODES:
            reset_peak_memory(device)  # the mode measured before freed first, reference cycles included
            runner = Mode(name, config, data_dir, device, vocab, aux_path)
            for _ in range(3):
                runner.step()
            memory[name] = torch.cuda.max_memory_allocated(device) / 2**20
            del runner
    else:
        for name in MODES:
            cmd = [sys.executable, "-m", "bench.efficiency", "--manifest", args.manifest, "--layers", str(args.layers),
                   "--data", str(data_dir), "--vocab", str(vocab), "--aux", str(aux_path), "--memory-probe", name]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            memory[name] = json.loads(out.strip().splitlines()[-1])["peak_mb"]

    g = generation_seconds_per_update(config, data_dir, device, args.steps // 2, aux_path)
    extra = seconds["fast-online"] - seconds["fast-offline"]
    break_even = g / extra if extra > 0 else math.inf
    analytic = analytic_ratios(config, vocab)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": {"main_layers": args.layers, "aux_layers": config.aux.num_layers, "generator_layers": config.aux.num_layers,
                  "hidden": config.model.hidden_size, "seq_len": config.corpus.max_seq_len, "batch_rows": config.train.batch_size,
                  "vocab": vocab, "data_vocab": config.tokenizer.vocab_size, "paper_vocab_proportion": is_paper,
                  "vocab_per_hidden": vocab / config.model.hidden_size},
        "seconds_per_update": seconds, "peak_memory_mb": memory, "allocator": allocator,
        "minor_page_faults_per_update": faults,
        **design_ratios(seconds, memory, analytic), "analytic_flops_ratios": analytic,
        "generation_seconds_per_update": g, "break_even_runs": break_even,
        "steps_per_mode": args.steps, "block": args.block, "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "machine": machine(),
    }
    stem = "efficiency" if device.type == "cpu" else "efficiency-gpu"
    if vocab != config.tokenizer.vocab_size:  # the default shape's results stay where they are
        stem += "-paper-vocab" if is_paper else f"-vocab{vocab}"
    if allocator.endswith("kept"):
        stem += "-kept-memory"
    atomic_write_json(RESULTS / f"{stem}.json", result)
    mem_unit = "MB of RSS above the process baseline" if device.type == "cpu" else "MB (max allocated)"
    s, mem, d = seconds, memory, config.model.hidden_size
    md = [f"# bench-efficiency ({result['device']})", "",
          f"`python -m bench.efficiency --manifest {args.manifest} --layers {args.layers} --steps {args.steps}"
          f"{f' --vocab {args.vocab}' if args.vocab else ''}{' --keep-freed-memory' if args.keep_freed_memory else ''}` on "
          f"{result['machine']}, {result['cpu_count']} cores, torch {result['torch']}. Main model {args.layers} x "
          f"{config.model.hidden_size}, aux {config.aux.num_layers} layers, generator {config.aux.num_layers} layers, "
          f"{config.train.batch_size} rows x {config.corpus.max_seq_len} tokens per update; medians of {args.steps} "
          f"interleaved updates per method. Allocator while timing: {allocator}"
          f"{' (common/cpu_memory.py; the memory probes run with the default)' if allocator.endswith('kept') else ''}.", "",
          (f"Vocabulary: the data's, {vocab} tokens (V / d = {vocab / d:.1f}; the paper's base: 166.7)."
           if vocab == config.tokenizer.vocab_size else
           f"Vocabulary: {vocab} tokens in every model (V / d = {vocab / d:.1f}"
           f"{', the paper proportion 128000 / 768' if is_paper else ''}); the data's {config.tokenizer.vocab_size} "
           f"ids in bigger tables, fast-online's aux model a seeded random one of that vocabulary."), "",
          f"| method | s / update | ratio | minor page faults / update | peak memory, {mem_unit} | ratio |",
          "|---|---|---|---|---|---|"]
    for name in MODES:
        md.append(f"| {name} | {s[name]:.4f} | {s[name] / s['electra']:.3f} | {faults[name]:.0f} | {mem[name]:.0f} | "
                  f"{mem[name] / mem['electra']:.3f} |")
    md += ["", f"Analytic FLOPs ratio fast-offline / electra for this shape: {analytic['paper_convention']['offline_vs_electra']:.3f} "
           f"(paper convention), {analytic['as_executed']['offline_vs_electra']:.3f} (as executed: lookups free, output layers counted); "
           f"fast-online / electra: {analytic['paper_convention']['online_vs_electra']:.3f} / {analytic['as_executed']['online_vs_electra']:.3f}.",
           "", f"Break-even: generating one update's rows costs {g:.4f} s (Corruptor + Parquet write); fast-online pays "
           f"{extra:.4f} s more per update than fast-offline, so the dumped shards are cheaper in total from "
           f"{break_even:.2f} training runs on (n >= g / (t_online - t_offline); "
           f"{math.ceil(break_even) if math.isfinite(break_even) else 'never'} run(s))."]
    atomic_write_text(RESULTS / f"{stem}.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
