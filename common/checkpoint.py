"""Saving and loading: the auxiliary model artifact and the trainer's checkpoints.

Both are written atomically (temporary file, fsync, rename). A checkpoint that
cannot be read back is ignored by `latest_checkpoint`, never trusted.
"""
from __future__ import annotations

import dataclasses
import errno
import pickle
import re
from functools import partial
from pathlib import Path

import torch

from common.config import ModelConfig
from common.io import DamagedFile, atomic_path, atomic_write_json, parse_json, read_json, retried, sha256_file
from common.model import MaskedLM
from common.tokenizer import Reserved

AUX_FILE = "aux.pt"
AUX_META = "aux.json"


class IncompatibleInputs(ValueError):
    """Two inputs of a stage disagree (vocabulary, tokenizer, sequence length, schema)."""


class CheckpointUnreadable(OSError):
    """A checkpoint the file system would not read (an I/O error, not its bytes), after retries."""


def safe_load(path: str | Path, map_location="cpu", mmap: bool = False) -> dict:
    """torch.load with `weights_only=True`: tensors and plain types only, so a file received from someone
    else cannot run code on load (refused: `IncompatibleInputs`). A file torch cannot read (cut short, another
    format) is a `DamagedFile` (`latest_checkpoint` skips it). Both messages name the file. A read the file
    system failed (EIO, a stale NFS handle, no permission) stays an OSError, and a host out of memory a
    MemoryError: neither says anything of the file's bytes.

    `mmap`: the tensors stay in the file's pages (the page cache, shared by every process of a machine that
    loads the file) until copied out, instead of each process holding a private copy of the whole file."""
    try:
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except RuntimeError as e:
            if mmap and "_use_new_zipfile_serialization" in str(e):  # not a zip archive: read it the plain way,
                return torch.load(path, map_location=map_location, weights_only=True)  # which says what it is
            raise
    except pickle.UnpicklingError as e:
        # "Unsupported global: GLOBAL builtins.open ...", "Trying to load unsupported GLOBAL posix.system ..."
        if re.search("unsupported global", str(e), re.IGNORECASE):
            raise IncompatibleInputs(f"{path} holds objects other than tensors and plain types (pickled code?); "
                                     f"refusing to load it: loading could run code. Use a file written by this "
                                     f"project ({first_line(e)[:200]})") from None
        raise DamagedFile(f"{path} is not a checkpoint this project wrote (damaged, cut short or another "
                          f"format: torch.load found no tensors and plain types in it)") from None
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: a seek past the end of a file cut short
            raise
        raise _damaged(path, e) from None
    except RuntimeError as e:
        if re.search(r"can't allocate memory|cannot allocate memory|out of memory", str(e), re.IGNORECASE):
            raise MemoryError(f"loading {path}: {first_line(e)[:200]}") from None
        raise _damaged(path, e) from None
    except (KeyError, EOFError, ValueError) as e:  # torch.load on bytes it cannot read
        raise _damaged(path, e) from None


def _damaged(path, e: Exception) -> DamagedFile:
    return DamagedFile(f"{path} is not a checkpoint this project wrote (damaged, cut short or another "
                       f"format: {type(e).__name__} {first_line(e)[:120]})")


def first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]


def save_aux(model: MaskedLM, model_cfg: ModelConfig, num_layers: int, vocab_size: int,
             tokenizer_sha256: str, out_dir: str | Path, metrics: dict) -> Path:
    out_dir = Path(out_dir)
    path = out_dir / AUX_FILE
    payload = {
        "format_version": 1,
        "model_config": dataclasses.asdict(model_cfg),
        "num_layers": num_layers,
        "vocab_size": vocab_size,
        "tokenizer_sha256": tokenizer_sha256,
        "state_dict": model.state_dict(),
        "metrics": {k: v for k, v in metrics.items() if k != "tokens_per_s"},  # the file's bytes: inputs only
    }
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)
    atomic_write_json(out_dir / AUX_META, {"sha256": sha256_file(path), "vocab_size": vocab_size,
                                           "tokenizer_sha256": tokenizer_sha256, "num_layers": num_layers,
                                           "hidden_size": model_cfg.hidden_size, "steps": metrics.get("steps"),
                                           "metrics": metrics})
    return path


def read_aux_meta(path: str | Path) -> dict:
    """The small JSON beside aux.pt (vocabulary, tokenizer hash), read without loading weights."""
    from common.storage import location
    path = location(path)
    meta = path.with_name(AUX_META)
    if not path.is_file():
        if (path / AUX_FILE).is_file():
            raise FileNotFoundError(f"auxiliary model {path} is a folder: pass the model file in it, {path / AUX_FILE}")
        raise FileNotFoundError(f"auxiliary model {path} does not exist (run `make aux`)")
    if not meta.is_file():
        raise FileNotFoundError(f"auxiliary model {path} has no {AUX_META} beside it")
    return read_json(meta, ("sha256", "tokenizer_sha256"), "`make aux` (python -m auxiliary) writes it again")


def local_aux(path) -> Path:
    """The aux model file on this machine: `path` itself, or for one on object storage a local copy of it and
    its aux.json, downloaded once per machine and checked against aux.json's sha256 (`common.storage`)."""
    from common.storage import cache_folder, is_remote, local_copy, location
    remote = location(path)
    if not is_remote(remote):
        return Path(path)
    meta_remote = remote.with_name(AUX_META)
    if not remote.is_file() or not meta_remote.is_file():
        raise FileNotFoundError(f"auxiliary model {remote} or its {AUX_META} does not exist (run `make aux` with "
                                f"--out {remote.parent})")
    text = meta_remote.read_text()
    local = cache_folder(remote.parent, "aux")
    local_copy(remote, local / remote.name, remote.stat().st_size, parse_json(text, meta_remote, ("sha256",))["sha256"])
    if not (local / AUX_META).is_file() or (local / AUX_META).read_text() != text:
        with atomic_path(local / AUX_META) as tmp:
            Path(tmp).write_text(text)
    return local / remote.name


def check_sizes(what: str, vocab_size: int, max_seq_len: int, config, hint: str = "") -> None:
    """`what` ("shards in DIR have", "corpus DIR has": the trainer's data, the generator's input) fits the
    manifest config `config`: its sequence length, and its vocabulary unless an hf: aux model brings its own
    tokenizer (whose size the manifest does not set)."""
    if not config.aux.source and vocab_size != config.tokenizer.vocab_size:
        raise IncompatibleInputs(f"{what} vocabulary {vocab_size} but the manifest config has tokenizer.vocab_size = "
                                 f"{config.tokenizer.vocab_size}{hint}")
    if max_seq_len != config.corpus.max_seq_len:
        raise IncompatibleInputs(f"{what} sequence length {max_seq_len} but the manifest config has "
                                 f"corpus.max_seq_len = {config.corpus.max_seq_len}{hint}")


def check_aux_matches_tokenizer(aux_meta: dict, aux_path, vocab_size: int, tokenizer_sha256: str, tok_path) -> None:
    if aux_meta["vocab_size"] != vocab_size:
        raise IncompatibleInputs(f"auxiliary model {aux_path} has a vocabulary of {aux_meta['vocab_size']} tokens "
                                 f"but the tokenizer {tok_path} has {vocab_size}")
    if aux_meta["tokenizer_sha256"] != tokenizer_sha256:
        raise IncompatibleInputs(f"auxiliary model {aux_path} was trained with tokenizer sha256 "
                                 f"{aux_meta['tokenizer_sha256'][:12]} but {tok_path} has {tokenizer_sha256[:12]}")


def save_hf_aux(source: Path, hf_id_of: list[int], reserved: Reserved, tokenizer_sha256: str, out_dir: str | Path,
                model_sha256: str) -> Path:
    """An hf: aux model's record in place of weights: where it is, the hash of its files (so the record's own
    sha256, which names the aux model in the generation key, changes when they do) and our id order."""
    out_dir = Path(out_dir)
    path = out_dir / AUX_FILE
    payload = {"format_version": 2, "kind": "hf", "source": str(source), "model_sha256": model_sha256,
               "hf_id_of": hf_id_of, "reserved": reserved.head, "reserved_tail": reserved.tail,
               "vocab_size": len(hf_id_of), "tokenizer_sha256": tokenizer_sha256}
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)
    atomic_write_json(out_dir / AUX_META, {"sha256": sha256_file(path), "kind": "hf", "source": str(source),
                                           "vocab_size": len(hf_id_of), "reserved": reserved.head,
                                           "reserved_tail": reserved.tail,
                                           "tokenizer_sha256": tokenizer_sha256, "model_sha256": model_sha256,
                                           "num_layers": None, "hidden_size": None, "steps": 0, "metrics": {}})
    return path


def load_aux(path: str | Path, map_location="cpu") -> tuple[MaskedLM, dict]:
    """Load the frozen auxiliary MLM (eval mode, no grad). Checks the file's sha256."""
    path = Path(path)
    meta = read_aux_meta(path)
    digest = sha256_file(path)
    if digest != meta["sha256"]:
        raise IncompatibleInputs(f"auxiliary model {path} has sha256 {digest[:12]}, {AUX_META} says {meta['sha256'][:12]} "
                                 f"(a publish cut short, or the file replaced); `make aux` publishes both again")
    payload = safe_load(path, map_location)
    if payload.get("kind") == "hf":
        from common import hf
        source = Path(payload["source"])
        if not hf.model_unchanged(source, payload["model_sha256"]):
            raise IncompatibleInputs(f"the aux model in {source} changed since {path} recorded it; run `make aux` again")
        model = hf.HFMaskedLM(source, payload["hf_id_of"])
        model.to(map_location).eval().requires_grad_(False)
        return model, {**meta, "sha256": digest}
    model = MaskedLM(ModelConfig(**payload["model_config"]), payload["vocab_size"], payload["num_layers"])
    model.load_state_dict(payload["state_dict"])
    model.to(map_location).eval().requires_grad_(False)
    return model, {**meta, "sha256": digest}


# --- trainer checkpoints -------------------------------------------------------

_CKPT = re.compile(r"^step-(\d{8})\.pt$")


def checkpoint_path(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step:08d}.pt"


def save_checkpoint(state: dict, folder: str | Path, keep: int) -> Path:
    """Write `state` as step-XXXXXXXX.pt atomically; keep the newest `keep` checkpoints up to this step.
    One of a later step is left alone and not counted: the run resumed before it, so it did not load
    (`latest_checkpoint` skipped it); counting it would delete each readable checkpoint as it is written."""
    folder = Path(folder)
    path = checkpoint_path(folder, state["step"])
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    for old in [p for p in list_checkpoints(folder) if p <= path][:-keep]:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _CKPT.match(p.name))


def latest_checkpoint(folder: str | Path, mmap: bool = False) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads; a damaged one is skipped with a note, one holding anything but
    tensors and plain types is refused (`safe_load`). A file the file system cannot read now is tried again
    (`common.io.retried`) and then stops the caller (`CheckpointUnreadable`): resuming from an older checkpoint, or
    from none, would throw away the updates since, and a trainer starting over rewrites its metrics; one that
    is gone by then (rotated away by a run still writing the folder) is passed over. `mmap`: see `safe_load`
    (the trainer's resume: its ranks share the file's pages, about 5 GiB at the large preset, until the weights
    are copied out)."""
    for path in reversed(list_checkpoints(folder)):
        try:
            state = retried(partial(safe_load, path, mmap=mmap), str(path), "checkpoints")
        except DamagedFile as e:
            print(f"checkpoints: ignoring unreadable checkpoint {path}: {e}")
            continue
        except OSError as e:
            if not path.exists():  # rotated away meanwhile: an older one, or none
                continue
            raise CheckpointUnreadable(f"checkpoint {path} cannot be read ({type(e).__name__}: {first_line(e)[:200]}); "
                                       f"not resuming from an older one or from the start: run again when the file "
                                       f"system reads it") from e
        if isinstance(state, dict) and "step" in state and "model" in state:
            return path, state
        print(f"checkpoints: ignoring {path}: not a trainer checkpoint (no 'step' and 'model')")
    return None
