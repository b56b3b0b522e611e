"""Corpus building: cleaning, deduplication, packing within documents, clear errors."""
import json

import numpy as np
import pytest

from common.corpus import SplitRows, load_split
from corpus.build import build_corpus, pack_document
from common.shards import CORPUS_SCHEMA, read_parquet
from common.sources import CorpusError, Document, deduplicate, read_jsonl, strip_gutenberg
from common.tokenizer import CLS_ID, SEP_ID, Tokenizer
from tests.conftest import tiny_config, write_text_corpus


def test_strip_gutenberg_header_and_licence():
    text = ("The Project Gutenberg EBook of Hamlet\nlicence blah\n"
            "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nHAMLET\nTo be.\n"
            "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nMore licence\n")
    assert strip_gutenberg(text) == "HAMLET\nTo be."
    old = "Header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nBody text\nEnd of Project Gutenberg's x\n"
    assert strip_gutenberg(old) == "Body text"


def test_deduplicate_drops_exact_and_contained_editions():
    lines = [f"this is a rather long line of verse number {i}" for i in range(50)]
    docs = [Document("a", "\n".join(lines)), Document("b", "\n".join(lines)),
            Document("c", "\n".join(lines[:40] + ["a different and fairly long closing line"])),
            Document("d", "\n".join(l.replace("verse", "prose") for l in lines))]
    kept, dropped = deduplicate(docs)
    assert [d.name for d in kept] == ["a", "d"] and dropped == ["b", "c"]


def test_pack_document_never_exceeds_and_drops_short_tail():
    rows = pack_document(list(range(10, 40)), max_seq_len=12, min_seq_len=6)
    assert [len(r) for r in rows] == [12, 12, 12]  # 30 tokens = 10 + 10 + 10
    assert all(r[0] == CLS_ID and r[-1] == SEP_ID for r in rows)
    rows = pack_document(list(range(10, 33)), max_seq_len=12, min_seq_len=6)
    assert [len(r) for r in rows] == [12, 12]  # a 3-token tail (5 with specials) is dropped


def test_build_corpus_rows_stay_inside_their_document(tmp_path):
    write_text_corpus(tmp_path / "raw", num_docs=5)
    config = tiny_config(tmp_path)
    build_corpus(config, config.corpus_dir, log=lambda *_: None)
    meta = json.loads((config.corpus_dir / "corpus.json").read_text())
    tok = Tokenizer(config.corpus_dir / "tokenizer.model")
    assert tok.vocab_size == 320 and meta["tokenizer_sha256"] == tok.sha256
    assert [tok.piece(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    # ids after the specials are in frequency order: the train rows count down
    counts = np.bincount(np.concatenate(load_split(config.corpus_dir, "train")), minlength=tok.vocab_size)[5:]
    assert counts[:20].tolist() == sorted(counts[:20].tolist(), reverse=True) and counts[0] > counts[-1]
    docs = {d["doc_id"]: d for d in meta["documents"]}
    assert {d["split"] for d in docs.values()} == {"train", "valid"}
    for split in ("train", "valid"):
        table = read_parquet(config.corpus_dir / meta[split]["parts"][0]["path"], CORPUS_SCHEMA)
        assert table.schema.equals(CORPUS_SCHEMA, check_metadata=False)
        rows = load_split(config.corpus_dir, split)
        mapped = SplitRows(config.corpus_dir, split)  # what the generator's actors read
        assert len(mapped) == len(rows) and all(np.array_equal(mapped[i], r) for i, r in enumerate(rows))
        doc_ids = np.concatenate([read_parquet(config.corpus_dir / p["path"], CORPUS_SCHEMA).column("doc_id").to_numpy()
                                  for p in meta[split]["parts"]])
        raw = {i: " ".join((tmp_path / "raw" / docs[i]["name"]).read_text().split()) for i in set(doc_ids.tolist())}
        for ids, doc_id in zip(rows, doc_ids):
            assert docs[doc_id]["split"] == split
            assert 8 <= len(ids) <= 32 and ids[0] == CLS_ID and ids[-1] == SEP_ID
            # the decoded body is one contiguous piece of its own document's text
            assert tok.decode(ids[1:-1]).strip() in raw[doc_id]


@pytest.mark.parametrize("make", ["missing", "empty_folder", "blank_files"])
def test_empty_or_missing_corpus_is_refused_without_output(tmp_path, make):
    source = tmp_path / "raw"
    if make != "missing":
        source.mkdir()
    if make == "blank_files":
        (source / "a.txt").write_text("   \n\n")
    config = tiny_config(tmp_path)
    with pytest.raises(CorpusError, match="does not exist|holds no text"):
        build_corpus(config, config.corpus_dir, log=lambda *_: None)
    assert not config.corpus_dir.exists()
    assert not any(p.name.startswith(".corpus") for p in tmp_path.iterdir())


def test_jsonl_source_needs_the_text_field(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "hello"}\n{"body": "x"}\n')
    with pytest.raises(CorpusError, match=r"c.jsonl:2 has no 'text' field"):
        read_jsonl(path, "text")
