"""An existing Hugging Face masked LM as the auxiliary model (paper section 3: the auxiliary model is
"an existing language model, which can either be retrieved from a public repository or from a previous
training round"): a local directory as `save_pretrained` or a hub download leaves it (`config.json`,
weights, tokenizer files), named `hf:PATH` in `[aux] source`. Loaded offline with transformers' Auto
classes; transformers is an optional extra (`pip install -e '.[hf]'`), imported only here, only then.

Its tokenizer becomes the whole chain's, renumbered into our id space the way our SentencePiece
tokenizer is (common/tokenizer.py): ids 0-4 are its [PAD] [UNK] [CLS] [SEP] [MASK] (RoBERTa's
<pad> <unk> <s> </s> <mask>), then every other entry by descending frequency in the corpus sample
(compact shards: the frequent pieces get the smallest ids), then, last, a reserved block of its other
special tokens and unused entries ([unusedN]). Replacements are never sampled from the specials nor
from that block (`Reserved`, common/distributions.py), and the aux
model's logit rows past the tokenizer's length never reach the sampler: `HFMaskedLM` gathers the
columns of our ids only, at masked positions only (the head runs on (masked positions, hidden), never
on batch x length x vocabulary).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from common.io import atomic_write_json, sha256_file
from common.vocab import Reserved

PREFIX = "hf:"
TOKENIZER_DIR = "hf_tokenizer"  # the tokenizer's own files, copied into the corpus folder
UNUSED = re.compile(r"^(\[unused\d+\]|<unused\d+>)$")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".h5", ".msgpack", ".ckpt", ".onnx")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spm.model", "sentencepiece.bpe.model", "tokenizer.model")


# `make export` (export/) writes our models as directories of model_type "fast-electra" with remote code: these
# files, the encoder being common/model.py itself. Such a directory is loaded with trust_remote_code only when
# its code is byte for byte this repository's (`own_remote_code`): no code from elsewhere ever runs.
OWN_MODEL_TYPE = "fast-electra"
# the masked LMs whose head `HFMaskedLM` runs as the model itself does (tests/test_hf.py builds each)
SUPPORTED_FAMILIES = ("BERT", "ELECTRA (its generator)", "RoBERTa", "DeBERTa-v2 / v3", "fast-electra exports")
REMOTE_DIR = Path(__file__).resolve().parent / "hf_remote"
REMOTE_CODE = {"configuration_fast_electra.py": REMOTE_DIR / "configuration_fast_electra.py",
               "modeling_fast_electra.py": REMOTE_DIR / "modeling_fast_electra.py",
               "fast_electra_encoder.py": Path(__file__).resolve().parent / "model.py"}


class HFError(ValueError):
    """A Hugging Face directory that cannot serve as the auxiliary model (said with its path)."""


def hf_dir(source: str) -> Path | None:
    """`hf:PATH` -> PATH; anything else (our own aux model) -> None."""
    return Path(source[len(PREFIX):]).expanduser() if source.startswith(PREFIX) else None


def transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is looked up on the hub, ever
    try:
        import transformers as module
    except ImportError:
        raise HFError("an hf: auxiliary model needs the optional extra: pip install -e '.[hf]' "
                      "(transformers, tokenizers, safetensors)") from None
    module.utils.logging.set_verbosity_error()
    return module


def own_remote_code(path: Path) -> bool:
    """True for a directory `make export` wrote (model_type "fast-electra") whose remote code is this
    repository's, byte for byte; such a directory with other code is refused; False for any other model."""
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    if model_type != OWN_MODEL_TYPE:
        return False
    for name, ours in REMOTE_CODE.items():
        if not (path / name).is_file() or sha256_file(path / name) != sha256_file(ours):
            raise HFError(f"{path} is a fast-electra export whose {name} is not this repository's {ours}: refusing "
                          f"to run its code; export the model again with this checkout (make export)")
    # trust_remote_code runs whatever module an auto_map names, so checking the files above is not enough:
    # every class reference must be into one of them (not another .py in the folder, not a "repo--module")
    entry_modules = {Path(name).stem for name in REMOTE_CODE if name != "fast_electra_encoder.py"}
    for name in ("config.json", "tokenizer_config.json"):
        refs = _class_references(path / name)
        foreign = [ref for ref in refs if ref.rpartition(".")[0] not in entry_modules]
        if foreign:
            raise HFError(f"{path / name} maps Auto classes to code that is not this repository's ({foreign[0]}): "
                          f"refusing to run it; export the model again with this checkout (make export)")
    return True


def _class_references(path: Path) -> list[str]:
    """The class references ("module.Class") of a JSON file's `auto_map`: a dict of one reference or a
    [slow, fast] pair per Auto class, or (tokenizer_config.json's legacy form) one such pair."""
    try:
        auto_map = json.loads(path.read_text()).get("auto_map") or {}
    except FileNotFoundError:
        return []
    except ValueError:
        raise HFError(f"{path} is not valid JSON") from None
    values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    refs = []
    for value in values:
        refs += [str(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None]
    return refs


def load_config(path: Path):
    """AutoConfig of a local model directory (our own exports' remote configuration included)."""
    return transformers().AutoConfig.from_pretrained(str(path), local_files_only=True,
                                                     trust_remote_code=own_remote_code(path))


def load_hf_tokenizer(path: Path):
    if not path.is_dir():
        raise HFError(f"{path} is not a directory (hf: takes a local folder as save_pretrained writes it)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        # transformers 5 would build an empty tokenizer of the model's type (its special tokens alone)
        raise HFError(f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    trust = own_remote_code(path)
    try:
        tok = transformers().AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust)
    except (OSError, ValueError, TypeError) as e:
        raise HFError(f"{path} holds no tokenizer transformers can load ({str(e).splitlines()[0][:200]})") from None
    return tok


def special_hf_ids(tok, path: Path) -> list[int]:
    """The tokenizer's [PAD] [UNK] [CLS] [SEP] [MASK] (bos / eos where it has no cls / sep), in our order."""
    found = {"pad": tok.pad_token_id, "unk": tok.unk_token_id,
             "cls": tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id,
             "sep": tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id,
             "mask": tok.mask_token_id}
    missing = [name for name, idx in found.items() if idx is None]
    if missing:
        raise HFError(f"the tokenizer in {path} has no {' / '.join(missing)} token: a masked LM's tokenizer needs "
                      f"pad, unk, cls (or bos), sep (or eos) and mask")
    if len(set(found.values())) != 5:
        raise HFError(f"the tokenizer in {path} gives two of pad / unk / cls / sep / mask the same id: {found}")
    return list(found.values())


def reserved_hf_ids(tok, specials: list[int]) -> list[int]:
    """Every other special token and unused entry: never masked into, never sampled."""
    vocab = tok.get_vocab()
    others = set(tok.all_special_ids) | {idx for piece, idx in vocab.items() if UNUSED.match(piece)}
    return sorted(others - set(specials))


def files_sha256(folder: Path, names=None) -> str:
    """One hash over the named files of a folder (all its files when `names` is None), names included."""
    paths = sorted(p for p in folder.iterdir() if p.is_file() and (names is None or p.name in names))
    return hashlib.sha256(json.dumps([[p.name, sha256_file(p)] for p in paths]).encode()).hexdigest()


def model_files(folder: Path) -> set[str]:
    """config.json and the weight files transformers loads from `folder`, in its order: model.safetensors,
    its sharded form (model.safetensors.index.json and the shards it names), then pytorch_model.bin and its
    sharded form. What the aux model's hash covers (`model_sha256`): new weights, a new generation key."""
    names = {"config.json"}
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (folder / single).is_file():
            return names | {single}
        index = folder / f"{single}.index.json"
        if index.is_file():
            try:
                shards = set(json.loads(index.read_text())["weight_map"].values())
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise HFError(f"{index} is not a weight index transformers can read ({e})") from None
            return names | {index.name} | shards
    return names


LEGACY_MODEL_FILES = ("config.json", "model.safetensors", "pytorch_model.bin")  # what was hashed before 2026-11-26


def model_unchanged(folder: Path, recorded: str) -> bool:
    """The model files are those an aux record (`model_sha256`) was made of: by `model_files`, or, for a
    single-file model, by the former set (a folder holding both model.safetensors and pytorch_model.bin
    hashed both), so a record made then is not taken for a changed model."""
    files = model_files(folder)
    return files_sha256(folder, files) == recorded or (
        files <= set(LEGACY_MODEL_FILES) and files_sha256(folder, LEGACY_MODEL_FILES) == recorded)


def tokenizer_sha256(folder: Path) -> str:
    """The hash of a model directory's files other than its weights: what tokenizes the corpus (the
    corpus key checks it on every `make corpus`, so gigabytes of weights are not read for it)."""
    return files_sha256(folder, {p.name for p in folder.iterdir() if p.suffix not in WEIGHT_SUFFIXES})


def encode_text(tok, texts: list[str]) -> list[list[int]]:
    """The tokenizer's ids of corpus texts, no specials added; a special token written in the text ("[SEP]",
    "<s>", "[MASK]") is spelled out as text, never read as that token: rows hold specials only where the
    corpus stage puts them (a literal "[SEP]" mid-row would end a sentence where the text has none)."""
    return tok(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def build_tokenizer(source: Path, lines: list[str], out_dir: Path, meta_file: str) -> None:
    """The corpus stage's tokenizer step for an hf: aux model: copy its tokenizer into `out_dir`, count its
    pieces on the corpus sample, write our id order (`meta_file`, beside the SentencePiece one's name)."""
    tok = load_hf_tokenizer(source)
    tok.save_pretrained(str(out_dir / TOKENIZER_DIR))
    specials = special_hf_ids(tok, source)
    reserved = reserved_hf_ids(tok, specials)
    size = len(tok)
    counts = np.zeros(size, dtype=np.int64)
    for start in range(0, len(lines), 1024):
        for ids in encode_text(tok, lines[start:start + 1024]):
            counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=size)[:size]
    # specials first, reserved last, each placed by hand in its own order; the rest by count, ties by their id.
    # (The reserved block last, not right after the specials: bert-base's 994 [unusedN] there would start the
    # frequent pieces at id 999, past the one-byte ids BYTE_STREAM_SPLIT stores best.)
    keys = counts.astype(np.float64)
    keys[specials + reserved] = -np.inf
    rest = np.argsort(-keys, kind="stable")[:size - len(specials) - len(reserved)].tolist()
    hf_of = specials + rest + reserved
    assert sorted(hf_of) == list(range(size))
    files = files_sha256(out_dir / TOKENIZER_DIR)
    atomic_write_json(out_dir / meta_file, {
        "kind": "hf", "source": str(source), "vocab_size": size, "reserved": len(specials),
        "reserved_tail": len(reserved), "hf_id_of": hf_of,
        "files_sha256": files, "sha256": hashlib.sha256(json.dumps({"files": files, "order": hf_of}).encode()).hexdigest(),
        "special": dict(zip(("pad", "unk", "cls", "sep", "mask"), specials))})


class HFTokenizer:
    """The same interface as common.tokenizer.Tokenizer over a Hugging Face tokenizer in our id order."""

    def __init__(self, folder: Path, meta: dict):
        self.path = Path(folder) / TOKENIZER_DIR
        from common.storage import cache_bookkeeping  # a corpus on object storage is read from a local copy
        names = {p.name for p in self.path.iterdir() if not cache_bookkeeping(p.name)}
        if files_sha256(self.path, names) != meta["files_sha256"]:
            raise HFError(f"the tokenizer files in {self.path} changed since the corpus was built; rebuild it")
        self.tok = load_hf_tokenizer(self.path)
        self.hf_of = np.asarray(meta["hf_id_of"], dtype=np.int64)  # our id -> its id
        self.ours_of32 = np.full(len(self.tok), -1, dtype=np.int32)
        self.ours_of32[self.hf_of] = np.arange(len(self.hf_of), dtype=np.int32)
        self.sha256, self.reserved, self.source = meta["sha256"], Reserved.of(meta), meta["source"]

    @property
    def vocab_size(self) -> int:
        return len(self.hf_of)

    def piece(self, idx: int) -> str:
        return self.tok.convert_ids_to_tokens(int(self.hf_of[idx]))

    def encode_native(self, texts: list[str]) -> list[list[int]]:
        return encode_text(self.tok, texts)

    def to_ours(self, pieces: list[list[int]]) -> np.ndarray:
        flat = np.fromiter((i for ids in pieces for i in ids), dtype=np.int64)
        return self.ours_of32[flat]

    def encode(self, text: str) -> list[int]:
        return self.to_ours([self.encode_native([text])[0]]).tolist()

    def encode_batch(self, texts: list[str], num_threads: int | None = None) -> list[list[int]]:
        return [self.ours_of32[np.asarray(ids, dtype=np.int64)].tolist() for ids in self.encode_native(texts)]

    def decode(self, ids) -> str:
        return self.tok.decode(self.hf_of[np.asarray(ids, dtype=np.int64)].tolist())


def max_positions(config) -> int:
    """Tokens a row may hold: RoBERTa's position table counts its padding offset (514 = 512 + 2). A model
    with no position table (a `make export` of ours: relative positions only) has no limit."""
    n = int(getattr(config, "max_position_embeddings", 0) or 0)
    if not n:
        return sys.maxsize
    if config.model_type in ("roberta", "xlm-roberta", "camembert"):
        n -= int(config.pad_token_id) + 1
    return n


def load_masked_lm(path: Path):
    """AutoModelForMaskedLM from a local folder, refusing one without a trained masked-LM head."""
    tf = transformers()
    if not (path / "config.json").is_file():
        raise HFError(f"{path} has no config.json: not a Hugging Face model directory")
    # a tensor whose shape is not the config's is reported (mismatched_keys), not raised: transformers' own
    # error says "look at the above report", a report the silenced logging never shows
    options = dict(local_files_only=True, output_loading_info=True, ignore_mismatched_sizes=True,
                   trust_remote_code=own_remote_code(path))
    try:
        model, info = tf.AutoModelForMaskedLM.from_pretrained(str(path), **options)
        if (model.config.model_type == "deberta-v2" and getattr(model.config, "legacy", False)
                and any(k.startswith("lm_predictions.") for k in info["unexpected_keys"])):
            # the original DeBERTa releases' head layout (lm_predictions.*), which transformers reads only
            # with legacy = False; a config without the key defaults to the cls.* layout and drops the head
            model, info = tf.AutoModelForMaskedLM.from_pretrained(str(path), legacy=False, **options)
    except (OSError, ValueError, KeyError) as e:
        raise HFError(f"{path} holds no masked LM transformers can load ({str(e).splitlines()[0][:200]})") from None
    except Exception as e:  # noqa: BLE001 - e.g. safetensors' own error for a damaged weights file
        if type(e).__module__.split(".")[0] not in ("safetensors", "torch", "transformers"):
            raise
        raise HFError(f"{path}: its weights do not load ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200] if str(e) else '?'})") from None
    mismatched = sorted(info.get("mismatched_keys") or [])  # (name, shape in the weights, shape of the config)
    if mismatched:
        name, saved, expected = mismatched[0]
        raise HFError(f"{path / 'config.json'} does not describe the weights in {path}: {name} is "
                      f"{list(saved)} there, the config makes it {list(expected)}"
                      f"{f' (and {len(mismatched) - 1} more)' if len(mismatched) > 1 else ''}; "
                      f"the config.json is another model's (vocab_size?)")
    base = model.base_model_prefix
    missing = sorted(info["missing_keys"])
    head = [k for k in missing if not k.startswith(base + ".")]
    if head:
        raise HFError(f"{path} has no masked-LM head ({model.config.architectures or '?'}; missing {head[:3]}): "
                      f"the auxiliary model must predict tokens, e.g. a *ForMaskedLM directory")
    if missing:
        # transformers leaves out of missing_keys what a model may lack (tied and non-persistent tensors): what
        # is left would be random values, e.g. the layers of a config.json with more layers than the weights
        raise HFError(f"{path}: its weights lack {len(missing)} tensor(s) of the model its config.json describes "
                      f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): the weights are cut short "
                      f"or the config.json is another model's (num_hidden_layers?); refusing random values")
    # weights saved in half precision load as such (transformers keeps the config's dtype): the aux model runs in
    # fp32, under bf16 autocast on a GPU, as our own does (half-precision matmuls on a CPU: 5x slower, other draws)
    return model.float()


class HFMaskedLM(nn.Module):
    """Our MaskedLM's interface over a Hugging Face masked LM: (ids, attention mask, masked flags) in our
    ids -> logits (masked positions, our vocabulary), the head applied to the masked rows only."""

    def __init__(self, path: Path, hf_of: np.ndarray, input_names=("input_ids", "attention_mask")):
        super().__init__()
        self.model = load_masked_lm(path)
        self.head = [child for name, child in self.model.named_children() if name != self.model.base_model_prefix]
        # DeBERTa's lm_predictions head takes the word embeddings it is tied to as an argument
        self.head_takes_embeddings = ["word_embeddings" in inspect.signature(m.forward).parameters for m in self.head]
        self.token_types = "token_type_ids" in input_names and getattr(self.model.config, "type_vocab_size", 0) > 0
        width = self._check_head(path)
        rows = min(width, self.model.get_input_embeddings().weight.shape[0])
        if len(hf_of) and int(np.max(hf_of)) >= rows:  # an index error deep in the generator else
            raise HFError(f"{path}: its tokenizer has ids up to {int(np.max(hf_of))}, but the model's vocabulary has "
                          f"{rows} entries: the tokenizer is not this model's")
        self.register_buffer("hf_of", torch.as_tensor(hf_of, dtype=torch.long), persistent=False)
        self.max_positions = max_positions(self.model.config)

    def _check_head(self, path: Path) -> int:
        """The base model then `_head` (what `forward` runs) against the model's own `model(...).logits` on a
        probe row: equal within rounding, or the family is refused (its head is not its other children run
        in order: DistilBERT's holds its loss module, XLM's is called otherwise). Returns the logits' width."""
        config, weights = self.model.config, self.model.get_input_embeddings().weight
        ids = torch.randint(0, weights.shape[0], (1, 8), generator=torch.Generator().manual_seed(0))
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.token_types:
            kwargs["token_type_ids"] = torch.zeros_like(ids)
        training = self.model.training
        self.model.eval()  # no dropout: the two paths see the same values
        try:
            with torch.no_grad():
                theirs = self.model(**kwargs).logits[0].float()
                ours = self._head(self.model.base_model(**kwargs)[0][0]).float()
        except Exception as e:  # noqa: BLE001 - any failure of the head path: a family this class does not know
            problem = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else '?'}"
        else:
            # fp32 differs by rounding (the head on 8 rows, not on a batch of one); half precision by its own eps
            tolerance = max(1e-4, 64 * torch.finfo(weights.dtype).eps) * max(1.0, float(theirs.abs().max()))
            if ours.shape == theirs.shape and float((ours - theirs).abs().max()) <= tolerance:
                return ours.shape[-1]
            problem = (f"its head's logits differ from the model's own: shape {list(ours.shape)} vs "
                       f"{list(theirs.shape)}" + (f", max |difference| {float((ours - theirs).abs().max()):.3g}"
                                                   if ours.shape == theirs.shape else ""))
        finally:
            self.model.train(training)
        raise HFError(f"{path}: model_type {config.model_type!r} ({', '.join(config.architectures or ['?'])}) is not "
                      f"supported as an auxiliary model ({problem}); supported: {', '.join(SUPPORTED_FAMILIES)}")

    def forward(self, input_ids, attention_mask, masked_positions) -> torch.Tensor:
        return self.logits(self.masked_hidden(input_ids, attention_mask, masked_positions))

    def masked_hidden(self, input_ids, attention_mask, masked_positions, drop=None) -> torch.Tensor:
        """The base model's output at the masked positions (`common.model.MaskedLM.masked_hidden`)."""
        if drop is not None:
            raise ValueError("per-row dropout (appendix C) needs our own aux model, not a Hugging Face one")
        kwargs = {"input_ids": self.hf_of[input_ids],  # a mask of None: no row padded, as Hugging Face reads it
                  "attention_mask": None if attention_mask is None else attention_mask.long()}
        if self.token_types:
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)
        return self.model.base_model(**kwargs)[0][masked_positions]

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """bert / deberta-v2: cls (or lm_predictions); roberta: lm_head; electra: predictions, lm_head."""
        for module, takes_embeddings in zip(self.head, self.head_takes_embeddings):
            hidden = module(hidden, self.model.get_input_embeddings()) if takes_embeddings else module(hidden)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head(hidden)[:, self.hf_of]  # our columns only: padded rows past the tokenizer's length drop out
