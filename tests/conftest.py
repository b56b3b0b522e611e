"""Shared tiny fixtures: a corpus the tests write themselves, a tiny config, a 2-layer aux."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import RunConfig, config_from_dict, dump_toml

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the king queen lord lady speaks answers comes goes night day sword crown love death "
         "fair foul good noble heart blood sweet sorrow friend enemy castle field heaven earth "
         "thou thee thy hath doth shall will must never ever now then here there").split()


def write_text_corpus(folder: Path, num_docs: int = 6, sentences: int = 120, seed: int = 0) -> Path:
    """A folder of .txt documents of seeded pseudo-English, one work per file."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for d in range(num_docs):
        paragraphs = []
        for _ in range(sentences // 6):
            lines = [" ".join(rng.choice(WORDS, size=rng.integers(4, 12))).capitalize() + "." for _ in range(6)]
            paragraphs.append("\n".join(lines))
        (folder / f"work_{d:02d}.txt").write_text(f"TITLE {d}\n\n" + "\n\n".join(paragraphs) + "\n")
    return folder


def run_ranks(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)` for a launcher and its ranks; on a
    timeout, every process of the command is first asked for its stacks (SIGUSR1, which the stages answer
    through `common.process.stacks_on_sigusr1`; the ranks before their launcher, which a bare torchrun does not
    survive, and the ranks die with it), then killed, and the test fails with the stacks: where a run hung
    shows in the test's failure, in CI too. The command never outlives the call, whatever stops it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [*reversed(descendants(proc.pid)), proc.pid]:  # one at a time: they share a stderr
                signal_all([pid], signal.SIGUSR1)
                try:
                    proc.communicate(timeout=1.0)  # reading the pipes meanwhile (a retry loses no output)
                except subprocess.TimeoutExpired:
                    pass
            signal_all([*descendants(proc.pid), proc.pid], signal.SIGKILL)
            out, err = proc.communicate(timeout=60)
            pytest.fail(f"{' '.join(map(str, cmd))} timed out after {timeout:g} s; its output and stacks:\n"
                        f"{out[-3000:]}\n{err[-20000:]}")
    finally:
        if proc.poll() is None:
            signal_all([*descendants(proc.pid), proc.pid], signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def descendants(pid: int) -> list[int]:
    """The processes under `pid` (children, theirs, ...), read from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass  # gone meanwhile
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def signal_all(pids: list[int], sig: int, pause: float = 0.0) -> None:
    """`sig` to each of `pids` in turn, `pause` seconds apart (stacks dumped into one shared stderr at once
    interleave)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        time.sleep(pause)


def tiny_config(work_dir: Path, **overrides) -> RunConfig:
    data = {
        "name": "test", "work_dir": str(work_dir), "seed": 7,
        "corpus": {"source": str(work_dir / "raw"), "max_seq_len": 32, "min_seq_len": 8,
                   "valid_fraction": 0.2, "unit_mb": 0.01},
        "tokenizer": {"vocab_size": 320},
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "ffn_size": 64,
                  "rel_buckets": 8, "rel_max_distance": 16, "dropout": 0.1},
        "aux": {"num_layers": 2, "steps": 6, "batch_size": 8, "warmup_steps": 2},
        "generate": {"epochs": 2, "rows_per_epoch": 0, "rows_per_shard": 40, "batch_tokens": 512,
                     "valid_rows": 24},
        "train": {"batch_size": 8, "warmup_steps": 2, "eval_every": 4, "log_every": 1, "ckpt_every": 4,
                  "rel_bias_lr_scale": 10.0},
    }
    for section, values in overrides.items():
        if isinstance(values, dict):
            data[section].update(values)
        else:
            data[section] = values
    return config_from_dict(data)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """A corpus, tokenizer and 2-layer aux model built once per test session."""
    from corpus.build import build_corpus
    from auxiliary.mlm import train_aux
    work = tmp_path_factory.mktemp("work")
    write_text_corpus(work / "raw")
    config = tiny_config(work)
    torch.set_num_threads(1)
    build_corpus(config, config.corpus_dir, log=lambda *_: None)
    train_aux(config, config.corpus_dir, config.aux_dir, log=lambda *_: None, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return config


@pytest.fixture
def env_with_repo():
    """Environment for subprocesses that import this repository's packages."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture
def gloo_env(env_with_repo):
    """For several ranks on this one machine: the GPUs hidden, so every rank runs on CPU over gloo
    (ranks of one machine cannot share a GPU under NCCL; a 1-GPU machine has none for rank 1)."""
    return {**env_with_repo, "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="session")
def generated(built, tmp_path_factory):
    """Two epochs generated once per session by the real CLI: Ray with 2 CPU workers."""
    folder = tmp_path_factory.mktemp("gen")
    manifest = folder / "test.toml"
    manifest.write_text(dump_toml(built))
    out = folder / "epochs"
    result = subprocess.run([sys.executable, "-m", "generate", "--manifest", str(manifest), "--out", str(out),
                             "--workers", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return manifest, out, result


@pytest.fixture(scope="session")
def trained_reference(generated, tmp_path_factory):
    """(step, loss) of every logged step of a trainer run over the session's finished generated folder: what a
    run that follows the generation, or reads the same shards from object storage, must reproduce exactly."""
    import json
    manifest, data, _ = generated
    run = tmp_path_factory.mktemp("reference") / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run([sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(data),
                             "--out", str(run)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


def train_with(built, manifest_path, tmp_path, env, **train):
    """Run `python -m train` on the fixture corpus and aux model with [train] overrides (objectives that
    corrupt in the loop); returns the process result and the metrics.jsonl records."""
    import json
    from common.checkpoint import AUX_FILE
    from common.config import config_to_dict, load_manifest
    values = config_to_dict(load_manifest(manifest_path))
    values["train"].update(train)
    path = tmp_path / "variant.toml"
    path.write_text(dump_toml(config_from_dict(values)))
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "train", "--manifest", str(path), "--out", str(run),
                             "--corpus", str(built.corpus_dir), "--aux", str(built.aux_dir / AUX_FILE)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def temperature_at(u, t0: float, tau: float):
    """Paper section 3, eq. (exp-decay), written out independently of the code under test:
    T(u) = 1 + (T0 - 1) exp(-u / tau), u = fraction of training."""
    if isinstance(u, np.ndarray):
        return 1.0 + (t0 - 1.0) * np.exp(-u / tau)
    return 1.0 + (t0 - 1.0) * math.exp(-u / tau)
