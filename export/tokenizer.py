"""The tokenizer files of an export: ids that are the model's ids, read by `AutoTokenizer`.

Our SentencePiece tokenizer (common/tokenizer.py) becomes a `tokenizers` BPE whose vocabulary maps
each piece to OUR id (SentencePiece's renumbered by frequency), so `AutoTokenizer(text)["input_ids"]`
is `[CLS] + Tokenizer.encode(text) + [SEP]` with no id table in between. What SentencePiece does and
how it is reproduced:

- normalizer "identity" with its defaults: leading and trailing spaces removed, runs of spaces
  collapsed to one (spaces only: a tab or a newline stays a character), a dummy "▁" prefix, spaces
  written as "▁" -> a `normalizers.Sequence` of the same four steps;
- BPE encoding: repeatedly merge the adjacent pair whose concatenation is the piece of highest
  score, leftmost first -> one merge rule per way of writing a piece as two pieces, ranked by the
  piece's score (every split of a piece shares its rank band, so whichever split is adjacent merges
  when SentencePiece would merge it);
- pieces never contain "▁" after their first character (SentencePiece trains with
  split_by_whitespace), so splitting at "▁" first (`Metaspace`) changes nothing and lets the BPE
  cache work per word;
- characters outside the vocabulary -> their UTF-8 bytes as <0xXX> pieces (byte_fallback);
- [MASK], a user-defined symbol, is found anywhere in the normalized text (a space before it is a
  "▁" piece of its own) -> an added token matched after normalization; a text of "[MASK]" alone is
  the one difference (SentencePiece: "▁" "[MASK]"; this: "[MASK]"). [CLS] [SEP] [PAD] [UNK] are
  control symbols SentencePiece spells out when written in the text; transformers reads its special
  tokens in any text, so there they are those tokens (the model card says both).

A tokenizer built from an `hf:` aux model (common/hf.py) is that model's own: its saved files are
copied (unchanged but for tokenizer_config.json's model_max_length, the rows the model was trained
on) and the exported embedding rows are put back in its native id order instead.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from common.tokenizer import CLS_ID, SEP_ID, SPECIAL_IDS, SPECIAL_PIECES

# sentencepiece_model.proto: ModelPiece.Type and TrainerSpec.ModelType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BPE_MODEL = 2
SPACE = "\u2581"  # SentencePiece's meta symbol for a space


class TokenizerExportError(ValueError):
    """A tokenizer that cannot be exported exactly (said with its path)."""


def read_model_proto(path: Path):
    from sentencepiece import sentencepiece_model_pb2  # protobuf: a dependency of ray, installed with the project
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def check_reproducible(proto, path: Path) -> None:
    """Refuse settings the conversion does not reproduce (common/tokenizer.py trains none of them)."""
    norm, trainer = proto.normalizer_spec, proto.trainer_spec
    wanted = {"model_type": (trainer.model_type, BPE_MODEL), "byte_fallback": (trainer.byte_fallback, True),
              "normalizer": (norm.name, "identity"), "add_dummy_prefix": (norm.add_dummy_prefix, True),
              "remove_extra_whitespaces": (norm.remove_extra_whitespaces, True),
              "escape_whitespaces": (norm.escape_whitespaces, True),
              "treat_whitespace_as_suffix": (trainer.treat_whitespace_as_suffix, False),
              "split_by_whitespace": (trainer.split_by_whitespace, True)}
    wrong = [f"{name} = {have!r} (need {need!r})" for name, (have, need) in wanted.items() if have != need]
    if wrong or norm.precompiled_charsmap:
        raise TokenizerExportError(f"SentencePiece model {path}: cannot be reproduced as a fast tokenizer: "
                                   + ", ".join(wrong or ["a precompiled normalization map"]))


def vocab_and_merges(proto, ours_of: np.ndarray) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """piece -> our id for every piece; merge rules ranked by the merged piece's score (highest first)."""
    pieces = proto.pieces
    vocab = {p.piece: int(ours_of[i]) for i, p in enumerate(pieces)}
    normal = {p.piece for p in pieces if p.type == NORMAL}
    order = sorted((i for i, p in enumerate(pieces) if p.type == NORMAL and len(p.piece) > 1),
                   key=lambda i: (-pieces[i].score, i))
    merges = []
    for i in order:
        piece = pieces[i].piece
        merges += [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal]
    return vocab, merges


def sentencepiece_fast_tokenizer(model_path: Path, sp_of: np.ndarray, max_length: int):
    """A `PreTrainedTokenizerFast` over our SentencePiece model, in our ids, adding [CLS] ... [SEP]."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    proto = read_model_proto(model_path)
    check_reproducible(proto, model_path)
    ours_of = np.empty_like(sp_of)
    ours_of[sp_of] = np.arange(sp_of.size)
    vocab, merges = vocab_and_merges(proto, ours_of)
    for piece, idx in zip(SPECIAL_PIECES, SPECIAL_IDS):
        assert vocab[piece] == idx, (piece, vocab[piece])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="[UNK]", byte_fallback=True, fuse_unk=False))
    tok.normalizer = normalizers.Sequence([
        normalizers.Replace(Regex(r"\A +| +\z"), ""),  # remove_extra_whitespaces: the text's ends (^ / $ match
                                                   # at every line in Oniguruma) ...
        normalizers.Replace(Regex(" {2,}"), " "),    # ... and runs of spaces inside
        # add_dummy_prefix (an empty text stays empty). Not Prepend: [MASK] is matched in the normalized text
        # (below) as its content normalized, which must stay "[MASK]", so a text that is "[MASK]" alone is left
        # as it is (SentencePiece gives "▁" "[MASK]" there, this the [MASK] token alone: the one difference)
        normalizers.Replace(Regex(r"\A(?!\[MASK\]\z|\z)"), SPACE),
        normalizers.Replace(" ", SPACE),             # escape_whitespaces
    ])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", CLS_ID), ("[SEP]", SEP_ID)])
    # [MASK] is a user-defined symbol of SentencePiece: found in the text after its normalization, so the space
    # before it is a "▁" piece and the text after it gets no "▁" of its own; an added token that is not
    # normalized splits the text first, and each part would be normalized (given a dummy prefix) alone
    mask = AddedToken("[MASK]", normalized=True, special=True)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token=mask, model_max_length=max_length,
                                   model_input_names=["input_ids", "attention_mask"])


def set_model_max_length(path: Path, max_length: int) -> None:
    """`model_max_length` in a copied tokenizer_config.json made the rows the model was trained on: the
    source's (512 for a BERT) would let `truncation=True` pass rows longer than the export ever saw."""
    if not path.is_file():  # save_pretrained (common/hf.py build_tokenizer) always writes one
        return
    try:
        config = json.loads(path.read_text())
    except ValueError:
        raise TokenizerExportError(f"{path} is not valid JSON; rebuild the corpus's tokenizer (make corpus)") from None
    config["model_max_length"] = max_length
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def write_tokenizer(tokenizer, out_dir: Path, max_length: int) -> dict:
    """Tokenizer files for `out_dir`: ours converted, an hf: one's copied. Returns what the card says."""
    from common.hf import REMOTE_CODE, WEIGHT_SUFFIXES, HFTokenizer
    from common.storage import cache_bookkeeping
    if isinstance(tokenizer, HFTokenizer):  # its own files (HFTokenizer checked their hash), model_max_length aside
        # the files HFTokenizer hashed: not the stamps, locks and hidden temporaries a corpus read from object
        # storage keeps beside its local copy
        files = sorted(p for p in tokenizer.path.iterdir() if p.is_file() and not cache_bookkeeping(p.name))
        # Refused, not skipped: the tokenizer's hash covers every one of its files, so without one the export
        # would not carry the tokenizer the model was trained with; a .py would run under trust_remote_code.
        model_files = {"config.json", "README.md", *REMOTE_CODE}
        clash = [p.name for p in files if p.name in model_files or p.suffix in (".py", *WEIGHT_SUFFIXES)
                 or (out_dir / p.name).exists()]
        if clash:
            raise TokenizerExportError(f"the tokenizer files in {tokenizer.path} include {', '.join(clash)}, which "
                                       f"{out_dir} holds as the model's own (config, weights, code or card): refusing "
                                       f"to copy them over it; rebuild the corpus's tokenizer (make corpus)")
        for path in files:
            shutil.copyfile(path, out_dir / path.name)
        set_model_max_length(out_dir / "tokenizer_config.json", max_length)
        native = tokenizer.tok
        return {"kind": "hf", "source": tokenizer.source, "size": len(native),
                "pad_id": native.pad_token_id, "class": type(native).__name__}
    fast = sentencepiece_fast_tokenizer(tokenizer.path, tokenizer.sp_of, max_length)
    fast.save_pretrained(str(out_dir))
    return {"kind": "sentencepiece", "source": str(tokenizer.path), "size": tokenizer.vocab_size, "pad_id": 0,
            "class": "PreTrainedTokenizerFast"}
