"""`make aux`: train the auxiliary masked LM, standing in for "an existing model from a previous
training round" (paper section 3; section 4.1: MLM, lr 5e-4).

    python -m auxiliary --manifest manifests/tiny.toml [--nproc N] [--corpus DIR] [--out DIR]  (`auxiliary/__main__.py`)

The aux model trains in the one training loop, as a training job like the main model's: the trainer's
`mlm` objective (`train/mlm.py`) run as its own process (`python -m train`, or torchrun for N ranks),
with a [train] table composed from [aux] (`common.aux_record.aux_run_config`): micro-batches with
accumulation, DDP, checkpoints every `aux.ckpt_every` updates, resume after kill -9, validation,
metrics.jsonl. Its run folder is `aux/run-KEY/`, KEY a hash of everything that decides the updates, so
a changed [aux] starts a fresh run and an unchanged one resumes. When the run has done its `aux.steps`
updates, its last checkpoint is published as aux.pt and aux.json (sha256, vocabulary, MLM metrics): the
file the generator reads.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from common.aux_record import KEY_FORMS, aux_run_config, run_key
from common.checkpoint import latest_checkpoint, save_aux, save_hf_aux
from common.config import RunConfig, dump_toml, save_resolved
from common.corpus import load_corpus_meta
from common.io import atomic_write_text
from common.model import MaskedLM
from common.sources import CorpusError
from common.tokenizer import open_tokenizer
from common.process import run_child, trainer_command

REPO = Path(__file__).resolve().parents[1]


def train_aux(config: RunConfig, corpus_dir: Path, out_dir: Path, log=print, nproc: int = 1, force: bool = False,
              env: dict | None = None) -> Path:
    """Train (or resume) the aux run in a trainer process, then publish its last checkpoint as aux.pt."""
    corpus_dir, out_dir = Path(corpus_dir).resolve(), Path(out_dir).resolve()
    run_dir = out_dir / f"run-{run_key(config, corpus_dir)}"
    for form in KEY_FORMS[1:]:  # a run started before the key changed: resumed, not redone
        earlier = out_dir / f"run-{run_key(config, corpus_dir, form)}"
        if earlier.is_dir() and not run_dir.exists():
            earlier.rename(run_dir)
    if force and run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = run_dir / "aux_run.toml"
    atomic_write_text(manifest, dump_toml(aux_run_config(config)))  # never half a file beside the run
    command = [*trainer_command(nproc), "--manifest", str(manifest), "--corpus", str(corpus_dir),
               "--out", str(run_dir), "--resume"]
    log(f"aux: training in {run_dir} ({nproc} rank(s)): {' '.join(command[1:])}")
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), child_env.get("PYTHONPATH", "")]))
    code = run_child(command, env=child_env)
    if code != 0:
        raise AuxRunError(f"the aux training run in {run_dir} stopped (exit code {code}); run `make aux` again to "
                          f"resume it from its last checkpoint", code)
    return publish(config, corpus_dir, run_dir, out_dir, log)


class AuxRunError(RuntimeError):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def publish(config: RunConfig, corpus_dir: Path, run_dir: Path, out_dir: Path, log=print) -> Path:
    """aux.pt and aux.json from the aux run's last checkpoint: the weights after `aux.steps` updates, the
    validation metrics at its start and end (mlm_loss, mlm_top1); the file's bytes depend on inputs only."""
    found = latest_checkpoint(run_dir / "checkpoints")
    if not found or found[1]["step"] != config.aux.steps:
        raise CorpusError(f"the aux run in {run_dir} has no checkpoint at step {config.aux.steps}")
    path, state = found
    tok, meta = open_tokenizer(corpus_dir), load_corpus_meta(corpus_dir)
    model = MaskedLM(config.model, tok.vocab_size, config.aux.num_layers)
    model.load_state_dict(state["model"])
    history = state["history"]
    renamed = lambda m: {"mlm_loss": m["loss"], "mlm_top1": m["top1"]}  # noqa: E731 - aux.json's names
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    metrics = {"steps": config.aux.steps, "start": renamed(history["start"]), "end": renamed(history["last"]),
               "run_key": run_dir.name.removeprefix("run-"), "tokens_per_s": summary.get("tokens_per_s")}
    out = save_aux(model, config.model, config.aux.num_layers, tok.vocab_size, meta["tokenizer_sha256"], out_dir,
                   metrics)
    save_resolved(config, out_dir)
    log(f"aux: valid MLM loss {metrics['start']['mlm_loss']:.3f} -> {metrics['end']['mlm_loss']:.3f}, "
        f"top-1 {metrics['start']['mlm_top1']:.3f} -> {metrics['end']['mlm_top1']:.3f} ({path.name}) -> {out}")
    return out


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
                       hf.files_sha256(source, hf.model_files(source)))
    save_resolved(config, out_dir)
    log(f"aux: {type(model.model).__name__} from {source} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
        f"parameters), vocabulary {tok.vocab_size} of which {tok.reserved.head + tok.reserved.tail} never sampled "
        f"-> {path}")
    return path
