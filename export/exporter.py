"""`make export`: a trained model as a Hugging Face model directory (docs/export.md).

    python -m export --run RUN --out DIR          the newest checkpoint of a run (the RTD model)
    python -m export --aux WORK/aux/aux.pt --out DIR    our own auxiliary masked LM

The directory holds `config.json`, `model.safetensors`, the tokenizer files, a model card
(`README.md`) and remote code: `configuration_fast_electra.py`, `modeling_fast_electra.py` (from
common/hf_remote/) and `fast_electra_encoder.py`, a verbatim copy of common/model.py, so the export
runs the trainer's own math. Loading needs `trust_remote_code=True`. An exported aux model comes back
as `[aux] source = "hf:DIR"` (paper section 3: the auxiliary model may be retrieved from a public
repository or a previous training round).

The folder is built under a temporary sibling name, loaded back with transformers and compared with
our model on a probe batch, and only then renamed into place: a crash or a failed check publishes
nothing.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common import hf
from common.checkpoint import latest_checkpoint, read_aux_meta, safe_load
from common.config import ModelConfig, RunConfig, config_from_dict, load_manifest
from common.corpus import SplitRows, load_corpus_meta, local_corpus
from common.io import FolderLock, publish_folder, sha256_file
from common.model import MaskedLM, ReplacedTokenDetector, count_parameters
from common.shards import MANIFEST_FILE, data_fingerprint
from common.tokenizer import PAD_ID, Reserved, open_tokenizer
from export.card import card_title, model_card
from export.tokenizer import write_tokenizer

CLASSES = {"AutoModel": "FastElectraModel", "AutoModelForPreTraining": "FastElectraForPreTraining",
           "AutoModelForMaskedLM": "FastElectraForMaskedLM",
           "AutoModelForSequenceClassification": "FastElectraForSequenceClassification",
           "AutoModelForTokenClassification": "FastElectraForTokenClassification"}
PREFIX = "fast_electra."  # base_model_prefix of the remote classes
PROBE_TOLERANCE = 1e-4    # fp32, same operations on both sides: the probe differs by rounding at most


class ExportError(ValueError):
    """Bad input for the export (said with the file or folder it is about)."""


@dataclass
class Trained:
    """A model to export, in our names and ids."""
    kind: str
    """'rtd' (a trainer checkpoint) or 'mlm' (our auxiliary model)."""
    state_dict: dict
    """encoder.* and head.* as common.model names them."""
    model_config: ModelConfig
    num_layers: int
    tokenizer: object
    """common.tokenizer.Tokenizer or common.hf.HFTokenizer."""
    max_seq_len: int
    facts: dict
    """What the model card says about its training."""


def require_transformers():
    """transformers >= 5 and safetensors (imported offline by common/hf.py), or an error with the install command."""
    try:
        import safetensors  # noqa: F401
        transformers = hf.transformers()
    except (ImportError, hf.HFError):
        raise ExportError("make export needs the optional extra: pip install -e '.[hf]' "
                          "(transformers, tokenizers, safetensors)") from None
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ExportError(f"make export needs transformers >= 5 (its config and tied-weight formats); found "
                          f"{transformers.__version__}: pip install -e '.[hf]'")
    transformers.utils.logging.disable_progress_bar()
    return transformers


def open_corpus_tokenizer(corpus_dir: Path, vocab_size: int, what: Path):
    try:
        tokenizer = open_tokenizer(corpus_dir)
    except (FileNotFoundError, ValueError) as e:
        raise ExportError(f"the tokenizer of {what} is not usable in {corpus_dir} ({e}); pass the corpus "
                          f"folder it was trained on with --corpus") from None
    if tokenizer.vocab_size != vocab_size:
        raise ExportError(f"{what} has a vocabulary of {vocab_size} tokens but the tokenizer in {corpus_dir} has "
                          f"{tokenizer.vocab_size}; pass the corpus folder it was trained on with --corpus")
    return tokenizer


def tokens_seen(data_dir: Path, fingerprint: str, rows: int) -> int | None:
    """Tokens in the first `rows` rows of the stream the checkpoint was trained on (its data manifest's
    per-shard counts, the last shard prorated), or None when `data_dir` does not hold that stream."""
    path = data_dir / MANIFEST_FILE
    if not fingerprint or not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    if data_fingerprint(manifest) != fingerprint:
        return None
    total = 0.0
    for shard in (s for e in manifest["epochs"] for s in e["shards"]):
        start, count = shard["stream_start"], shard["rows"]
        if start < rows and count:
            total += shard["tokens"] * min(count, rows - start) / count
    return round(total)


def from_run(run: Path, corpus: Path | None = None, data: Path | None = None) -> Trained:
    """The newest checkpoint of a run folder (or a step-XXXXXXXX.pt file): its detector."""
    if run.is_file():
        path, state = run, safe_load(run)
    else:
        if not run.is_dir():
            raise ExportError(f"run folder {run} does not exist")
        found = latest_checkpoint(run / "checkpoints") or latest_checkpoint(run)
        if not found:
            raise ExportError(f"{run} holds no trainer checkpoint ({run / 'checkpoints'}/step-XXXXXXXX.pt); "
                              f"train it first (make train RUN={run})")
        path, state = found
    if not isinstance(state, dict) or not {"model", "config", "step"} <= state.keys():
        raise ExportError(f"{path} is not a trainer checkpoint (no 'model', 'config' and 'step')")
    config: RunConfig = config_from_dict(state["config"])
    model = state["model"]
    prefix = "discriminator." if any(k.startswith("discriminator.") for k in model) else ""  # objective electra
    weights = {k[len(prefix):]: v for k, v in model.items() if k.startswith((prefix + "encoder.", prefix + "head."))}
    if "encoder.embed.weight" not in weights or "head.out.weight" not in weights:
        raise ExportError(f"{path} holds no replaced-token detector (encoder.* and head.* weights)")
    vocab_size = weights["encoder.embed.weight"].shape[0]
    corpus_dir = local_corpus(corpus or config.corpus_dir, splits=("valid",))  # s3://: a copy here (rows: check_tokenizer's)
    tokenizer = open_corpus_tokenizer(corpus_dir, vocab_size, path)
    recorded = state.get("tokenizer_sha256") or ""  # the corpus.json hash the trainer saw; older checkpoints: none
    if recorded and recorded != tokenizer.sha256:
        raise ExportError(f"checkpoint {path} was trained on data made with tokenizer {recorded[:12]}, but "
                          f"{tokenizer.path} is {tokenizer.sha256[:12]}: the export would read the model with the "
                          f"wrong ids; pass --corpus with the corpus the run's shards were made from")
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    history = state.get("history", {})
    from_summary = bool(summary) and summary.get("steps") == state["step"]  # else a later run's summary, or none
    final = summary.get("end") if from_summary else history.get("last")
    rows = state.get("rows_consumed", state["step"] * config.train.batch_size)
    facts = {
        "checkpoint": str(path), "checkpoint_sha256": sha256_file(path), "run_dir": str(run_dir),
        "manifest_name": config.name, "objective": config.train.objective,
        "resolved_manifest": str(run_dir / "resolved_manifest.toml") if (run_dir / "resolved_manifest.toml").is_file() else None,
        "corpus": summary.get("corpus") or config.corpus.source, "corpus_dir": str(corpus_dir),
        "steps": state["step"], "batch_size": config.train.batch_size, "rows_seen": rows,
        "tokens_seen": tokens_seen(data or config.epochs_dir, state.get("data_manifest_sha256", ""), rows),
        "data_dir": str(data or config.epochs_dir), "lr": config.train.lr,
        "validation_start": history.get("start"), "validation_final": final,
        "metrics_from": "summary.json" if from_summary else "the checkpoint's history",
        "temperature_consumed": history.get("temperature_consumed"),
    }
    return Trained("rtd", weights, config.model, config.model.num_layers, tokenizer, config.corpus.max_seq_len, facts)


def from_aux(aux_path: Path, corpus: Path | None = None) -> Trained:
    """Our own auxiliary masked LM (aux.pt beside its aux.json)."""
    try:
        meta = read_aux_meta(aux_path)
    except FileNotFoundError as e:
        raise ExportError(str(e)) from None
    if meta.get("kind") == "hf":
        raise ExportError(f"{aux_path} records the Hugging Face model {meta['source']}: it is a model directory "
                          f"already, nothing to export")
    payload = safe_load(aux_path)
    needed = ("model_config", "num_layers", "vocab_size", "tokenizer_sha256", "state_dict")
    missing = [k for k in needed if k not in payload] if isinstance(payload, dict) else list(needed)
    if missing or "encoder.embed.weight" not in payload["state_dict"]:
        what = ", ".join(missing) or "encoder weights"
        raise ExportError(f"{aux_path} is not an aux model this project wrote (no {what}); make aux writes one")
    cfg = ModelConfig(**payload["model_config"])
    folder = aux_path.parent
    resolved = folder / "resolved_manifest.toml"
    config = None
    if resolved.is_file():
        config = load_manifest(resolved)
    if corpus is None:
        if config is None:
            raise ExportError(f"{folder} has no resolved_manifest.toml to find the corpus by; pass --corpus")
        corpus = config.corpus_dir
    corpus = local_corpus(corpus, splits=("valid",))  # object storage: a copy here (rows: check_tokenizer's)
    tokenizer = open_corpus_tokenizer(corpus, payload["vocab_size"], aux_path)
    if tokenizer.sha256 != payload["tokenizer_sha256"]:
        raise ExportError(f"{aux_path} was trained with tokenizer sha256 {payload['tokenizer_sha256'][:12]} but "
                          f"the tokenizer in {corpus} has {tokenizer.sha256[:12]}; pass its corpus with --corpus")
    weights = {k: v for k, v in payload["state_dict"].items() if k != "head.embedding.weight"}  # tied: stored once
    facts = {"checkpoint": str(aux_path), "checkpoint_sha256": sha256_file(aux_path), "corpus_dir": str(corpus),
             "manifest_name": config.name if config else None, "corpus": config.corpus.source if config else None,
             "steps": meta.get("steps"), "metrics": meta.get("metrics", {}),
             "batch_size": config.aux.batch_size if config else None}
    max_len = load_corpus_meta(corpus)["max_seq_len"]
    return Trained("mlm", weights, cfg, payload["num_layers"], tokenizer, max_len, facts)


def native_order(tokenizer) -> np.ndarray | None:
    """For an hf: tokenizer, its native id of each of our ids; None for ours (exported in our ids)."""
    return np.asarray(tokenizer.hf_of, dtype=np.int64) if hasattr(tokenizer, "hf_of") else None


def hf_weights(trained: Trained) -> tuple[dict, int, int]:
    """(tensors under the remote classes' names, vocabulary size, pad id). With an hf: tokenizer the
    vocabulary-indexed tensors are put in its native order; a native id none of ours maps to (only past
    the tokenizer's length) keeps a zero row."""
    hf_of = native_order(trained.tokenizer)
    vocab = trained.state_dict["encoder.embed.weight"].shape[0]
    pad = PAD_ID
    out = {}
    for name, tensor in trained.state_dict.items():
        tensor = tensor.detach().to(torch.float32).contiguous()
        if hf_of is not None and name in ("encoder.embed.weight", "head.bias"):
            native = torch.zeros((max(len(trained.tokenizer.tok), int(hf_of.max()) + 1), *tensor.shape[1:]))
            native[torch.from_numpy(hf_of)] = tensor
            tensor = native
        out[(PREFIX + name) if name.startswith("encoder.") else name] = tensor.clone()
    if hf_of is not None:
        vocab = out[PREFIX + "encoder.embed.weight"].shape[0]
        pad = int(hf_of[PAD_ID])
    return out, vocab, pad


def load_remote_config_class():
    """FastElectraConfig from common/hf_remote (it imports transformers only, so it loads on its own)."""
    spec = importlib.util.spec_from_file_location("fast_electra_export_config",
                                                  hf.REMOTE_DIR / "configuration_fast_electra.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FastElectraConfig


def write_config(trained: Trained, vocab: int, pad: int, folder: Path) -> dict:
    cfg = trained.model_config
    fields = {"vocab_size": vocab, "hidden_size": cfg.hidden_size, "num_layers": trained.num_layers,
              "num_heads": cfg.num_heads, "ffn_size": cfg.ffn_size, "rel_buckets": cfg.rel_buckets,
              "rel_max_distance": cfg.rel_max_distance, "rel_bias_locality": cfg.rel_bias_locality,
              "dropout": cfg.dropout, "pad_token_id": pad, "tie_word_embeddings": True}
    config = load_remote_config_class()(**fields)
    config.architectures = [CLASSES["AutoModelForPreTraining" if trained.kind == "rtd" else "AutoModelForMaskedLM"]]
    config.save_pretrained(str(folder))
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data["auto_map"] = {"AutoConfig": "configuration_fast_electra.FastElectraConfig",
                        **{auto: f"modeling_fast_electra.{name}" for auto, name in CLASSES.items()}}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data


def copy_remote_code(folder: Path) -> None:
    """common/hf_remote's two files and common/model.py, under the names the modeling file imports."""
    for name, source in hf.REMOTE_CODE.items():
        shutil.copyfile(source, folder / name)


def our_model(trained: Trained) -> torch.nn.Module:
    vocab = trained.state_dict["encoder.embed.weight"].shape[0]
    if trained.kind == "rtd":
        model = ReplacedTokenDetector(trained.model_config, vocab)
        model.load_state_dict(trained.state_dict)
    else:
        model = MaskedLM(trained.model_config, vocab, trained.num_layers)
        model.load_state_dict({**trained.state_dict, "head.embedding.weight": trained.state_dict["encoder.embed.weight"]})
    return model.eval()


def probe_batch(vocab: int, reserved: Reserved, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows in our ids, the second padded: [CLS] random tokens (none reserved) [SEP] [PAD]..."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(reserved.head, reserved.stop(vocab), (2, 24), generator=g)
    ids[:, 0] = 2
    mask = torch.ones_like(ids)
    ids[1, 15:], mask[1, 15:] = PAD_ID, 0
    ids[0, -1] = ids[1, 14] = 3
    return ids, mask


def check_tokenizer(trained: Trained, folder: Path, transformers, num_rows: int = 64) -> int:
    """The exported tokenizer against ours on the text of held-out corpus rows (decoded): the same ids, or
    an error quoting the first text that differs. Returns the number of texts compared."""
    if native_order(trained.tokenizer) is not None:
        return 0  # an hf: tokenizer's own files, copied (its model_max_length aside) unchanged
    rows = SplitRows(Path(trained.facts["corpus_dir"]), "valid")
    fast = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=True)
    texts = [trained.tokenizer.decode(rows[i][1:-1]) for i in range(min(num_rows, len(rows)))]
    for text in texts:
        ours, theirs = [2, *trained.tokenizer.encode(text), 3], fast(text)["input_ids"]
        if ours != theirs:
            raise ExportError(f"the exported tokenizer in {folder} tokenizes {text[:80]!r} as {theirs[:12]}..., "
                              f"ours ({trained.tokenizer.path}) as {ours[:12]}...")
    return len(texts)


@torch.no_grad()
def verify(trained: Trained, folder: Path, transformers) -> float:
    """Load the folder as transformers will and compare with our model on a probe batch; returns the
    largest absolute difference of the encoder's hidden states and the head's outputs at non-padding
    positions (the hidden states too: an RTD head projects them onto one direction, which hides most errors)."""
    auto = transformers.AutoModelForPreTraining if trained.kind == "rtd" else transformers.AutoModelForMaskedLM
    theirs = auto.from_pretrained(str(folder), trust_remote_code=True, local_files_only=True).eval()
    ours = our_model(trained)
    ids, mask = probe_batch(trained.state_dict["encoder.embed.weight"].shape[0], trained.tokenizer.reserved)
    hf_of = native_order(trained.tokenizer)
    native_ids = torch.from_numpy(hf_of)[ids] if hf_of is not None else ids
    keep = mask.bool()
    hidden = (theirs.fast_electra(native_ids, mask).last_hidden_state - ours.encoder(ids, mask))[keep].abs().max()
    if trained.kind == "rtd":
        diff = (theirs(native_ids, mask).logits - ours(ids, mask))[keep].abs().max()
    else:
        logits = theirs(native_ids, mask).logits[keep]
        if hf_of is not None:
            logits = logits[:, torch.from_numpy(hf_of)]
        diff = (logits - ours(ids, mask, keep)).abs().max()
    return max(float(diff), float(hidden))


def check_output(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f"output folder {out} exists and is not empty; choose another --out or pass --force "
                              f"to replace it")
        if not (out / "config.json").is_file():
            # --force replaces an earlier export only: a mistyped --out (a run, a home folder) is never deleted
            raise ExportError(f"output folder {out} is not empty and holds no config.json: not a model directory, "
                              f"which is all --force replaces; choose another --out")
        try:
            model_type = json.loads((out / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        if model_type != hf.OWN_MODEL_TYPE:
            # nor another model directory (a downloaded BERT, an hf: aux model): only an earlier export of ours
            raise ExportError(f"output folder {out} holds a model directory that is not an export of this project "
                              f"(its config.json's model_type is {model_type!r}, not {hf.OWN_MODEL_TYPE!r}): --force "
                              f"replaces only an earlier export; choose another --out")


def check_sources_outside(trained: Trained, out: Path) -> None:
    """--force replaces `out`: refuse one that holds what the export reads (`--out RUN --force` would delete the run)."""
    sources = [trained.facts.get(key) for key in ("checkpoint", "run_dir", "corpus_dir", "data_dir")]
    inside = [p for p in sources if p and Path(p).resolve().is_relative_to(out.resolve())]
    if inside:
        raise ExportError(f"output folder {out} holds {inside[0]}, which the export reads (--force would delete it); "
                          f"choose another --out")


def export(trained: Trained, out: Path, force: bool = False, log=print) -> Path:
    """Write `trained` as a Hugging Face model directory at `out` (atomically; verified before it is
    published)."""
    transformers = require_transformers()
    check_sources_outside(trained, out)
    check_output(out, force)
    with FolderLock(out, "python -m export"):
        staging = out.with_name(f".{out.name}.export-tmp")
        if staging.exists():
            shutil.rmtree(staging)  # left by a killed export
        staging.mkdir(parents=True)
        try:
            summary = build(trained, staging, out, transformers)
            publish_folder(staging, out)  # a replaced one (--force) is removed only afterwards
        except OSError as e:  # a write that failed, or transformers not reading the folder back
            raise ExportError(f"the export of {trained.facts['checkpoint']} to {out} failed: "
                              f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}") from None
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    log(f"export: {trained.facts['checkpoint']} -> {out} ({summary})")
    return out


def process_umask() -> int:
    """The process's umask (read by setting it, then setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def build(trained: Trained, staging: Path, out: Path, transformers) -> str:
    """Every file of the export to `out`, in `staging`, checked against our model; returns a one-line description."""
    from safetensors.torch import save_file
    tensors, vocab, pad = hf_weights(trained)
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes its file 0600; the export's other files are the process's default (0644 under umask 022)
    (staging / "model.safetensors").chmod(0o666 & ~process_umask())
    config = write_config(trained, vocab, pad, staging)
    copy_remote_code(staging)
    tokenizer_facts = write_tokenizer(trained.tokenizer, staging, trained.max_seq_len)
    check_tokenizer(trained, staging, transformers)
    diff = verify(trained, staging, transformers)
    if not diff <= PROBE_TOLERANCE:
        raise ExportError(f"the export of {trained.facts['checkpoint']} does not reproduce it under transformers: "
                          f"max |difference| {diff:.3g} on a probe batch (tolerance {PROBE_TOLERANCE}); nothing "
                          f"was written to {out}")
    parameters = count_parameters(our_model(trained))
    (staging / "README.md").write_text(model_card(trained, config, tokenizer_facts, parameters, card_title(trained),
                                                          out.name))
    return (f"{config['architectures'][0]}, {parameters / 1e6:.2f}M parameters, vocabulary {vocab}, tokenizer "
            f"{tokenizer_facts['kind']}; transformers reproduces it on a probe batch within {diff:.1e}")
