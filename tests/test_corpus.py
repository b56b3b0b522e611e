"""The corpus stage: streaming readers, cleaning, exact deduplication, packing within documents, the
Ray build (same bytes for any worker count, resumable after kill -9), and clear errors."""
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.corpus import SplitRows, load_corpus_meta, load_split
from common.shards import CORPUS_SCHEMA, read_parquet
from common.sources import (CorpusError, LeftOut, Piece, read_unit, source_files, strip_gutenberg, work_units,
                            write_units)
from common.tokenizer import CLS_ID, SEP_ID, Tokenizer
from corpus.build import SLOW_ENV, build_corpus, corpus_is_current, pack_document
from tests.conftest import ROOT, dump_toml, tiny_config, write_text_corpus

quiet = dict(log=lambda *_: None)


def digest(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_strip_gutenberg_header_and_licence():
    text = ("The Project Gutenberg EBook of Hamlet\nlicence blah\n"
            "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nHAMLET\nTo be.\n"
            "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nMore licence\n")
    assert strip_gutenberg(text) == "HAMLET\nTo be."
    old = "Header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nBody text\nEnd of Project Gutenberg's x\n"
    assert strip_gutenberg(old) == "Body text"


def test_pack_document_never_exceeds_and_drops_short_tail():
    rows = pack_document(np.arange(10, 40, dtype=np.int32), max_seq_len=12, min_seq_len=6)
    assert [len(r) for r in rows] == [12, 12, 12]  # 30 tokens = 10 + 10 + 10
    assert all(r[0] == CLS_ID and r[-1] == SEP_ID and r.dtype == np.int32 for r in rows)
    assert np.concatenate([r[1:-1] for r in rows]).tolist() == list(range(10, 40))
    rows = pack_document(np.arange(10, 33, dtype=np.int32), max_seq_len=12, min_seq_len=6)
    assert [len(r) for r in rows] == [12, 12]  # a 3-token tail (5 with specials) is dropped


def test_every_format_is_read_as_a_stream_and_large_jsonl_is_cut_at_line_starts(tmp_path):
    src = tmp_path / "src"
    (src / "deep").mkdir(parents=True)
    (src / "a.txt").write_text("plain text one")
    with gzip.open(src / "deep" / "b.txt.gz", "wt") as f:
        f.write("gzipped text two")
    lines = [json.dumps({"text": f"line {i} " + "x" * (i % 7)}) for i in range(200)]
    (src / "c.jsonl").write_text("\n".join(lines) + "\n")
    with gzip.open(src / "d.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "gz json"}) + "\n\n" + json.dumps({"text": "gz json 2"}) + "\n")
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(50)]}), src / "e.parquet", row_group_size=7)
    (src / "ignored.csv").write_text("not, a, corpus")
    files = source_files(str(src), tmp_path / "cache")
    assert [f.name for f in files] == ["a.txt", "c.jsonl", "d.jsonl.gz", "deep/b.txt.gz", "e.parquet"]
    units = list(work_units(files, unit_bytes=500))  # c.jsonl (~3 KB) in byte ranges, e.parquet by row groups
    assert len(units) > 5 and any(p.start > 0 for u in units for p in u.pieces if p.file.name == "c.jsonl")
    texts = [d.text for u in units for d in read_unit(u, "text")]
    expected = (["plain text one"] + [json.loads(l)["text"].strip() for l in lines] + ["gz json", "gz json 2"]
                + ["gzipped text two"] + [f"row {i}" for i in range(50)])
    assert texts == expected  # every line exactly once, in order, whatever the cut


@pytest.mark.parametrize("content,message", [
    (b"\x7fELF\x02\x01\x01\x00\x00" + bytes(range(256)) * 40, r"bad\.txt is not text"),
    ("\x01\x02\x03\x04 control characters \x05\x06\x07\x08".encode(), r"bad\.txt is not text"),
])
def test_a_binary_file_is_refused_naming_it(tmp_path, content, message):
    write_text_corpus(tmp_path / "raw", num_docs=3)
    (tmp_path / "raw" / "bad.txt").write_bytes(content)
    config = tiny_config(tmp_path)
    with pytest.raises(CorpusError, match=message):
        build_corpus(config, config.corpus_dir, **quiet)
    assert not config.corpus_dir.exists() and not any(p.name.startswith(".corpus") for p in tmp_path.iterdir())


@pytest.mark.parametrize("line,message", [
    ('{"text": "fine"', r"c\.jsonl:3 is not valid JSON"),
    ('{"body": "x"}', r"c\.jsonl:3 has no 'text' field"),
    ('{"text": null}', r"c\.jsonl:3: 'text' is NoneType, not a string"),
])
def test_a_malformed_jsonl_line_is_refused_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n' + line + "\n")
    units = list(work_units(source_files(str(path), tmp_path), unit_bytes=10))  # the bad line in a later range
    assert len(units) > 1
    with pytest.raises(CorpusError, match=message):
        [d for u in units for d in read_unit(u, "text")]


def test_a_plain_jsonl_is_read_once_and_bad_lines_in_later_ranges_are_named_by_line(tmp_path, monkeypatch):
    """A plain .jsonl's good lines cost no line count (it read the file from byte 0 for every line: a
    16 GB file would never finish); a bad line, skipped, is named by its line in the whole file."""
    import common.sources as sources
    counted = []
    real = sources._line_number
    monkeypatch.setattr(sources, "_line_number", lambda path, offset: counted.append(offset) or real(path, offset))
    path = tmp_path / "c.jsonl"
    lines = [f'{{"text": "document {i}"}}' for i in range(3000)]
    lines[2500], lines[2900] = '{"text": 1}', "{broken"
    path.write_text("\n".join(lines) + "\n")
    units = list(work_units(source_files(str(path), tmp_path), unit_bytes=20_000))
    assert len(units) > 3
    skipped = []
    docs = [d for u in units for d in read_unit(u, "text", skipped)]
    assert len(docs) == 2998 and docs[-1].text == "document 2999"
    assert [str(e).split(" ")[0] for e in skipped] == [f"{path}:2501:", f"{path}:2901"]
    assert len(counted) <= 2  # once per range that holds a bad line, not once per line


def test_bad_lines_in_every_range_of_a_plain_jsonl_are_numbered_reading_it_about_once(tmp_path):
    """Skipping bad lines spread through a large plain .jsonl: each range's line count starts where the one
    before it ended (it read the file from byte 0 for every range that held one: 22x the file's bytes for
    45 units, quadratic in the units)."""
    path = tmp_path / "c.jsonl"
    lines = [f'{{"text": "document {i}"}}' if i % 97 else '{"text": null}' for i in range(20_000)]
    path.write_text("\n".join(lines) + "\n")
    units = list(work_units(source_files(str(path), tmp_path), unit_bytes=path.stat().st_size // 40))
    assert len(units) >= 40
    rchar = lambda: int(next(line for line in Path("/proc/self/io").read_text().splitlines()  # noqa: E731
                             if line.startswith("rchar")).split()[1])
    skipped, before = [], rchar()
    docs = [d for u in units for d in read_unit(u, "text", skipped)]
    read = rchar() - before
    assert len(docs) == 20_000 - len(skipped) and len(skipped) == len(range(0, 20_000, 97))
    assert [int(str(e).split(":")[1]) for e in skipped] == [i + 1 for i in range(0, 20_000, 97)]
    assert read < 3 * path.stat().st_size, read / path.stat().st_size  # the units, and the count once


def test_copies_that_differ_in_line_ends_or_outer_whitespace_hash_alike_in_every_format(tmp_path):
    """The hash is of cleaned text in every format: such copies are duplicates, never split between the
    training and held-out sides."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from common.sources import document_hash
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.txt").write_text("To be, or not to be:\nthat is the question.\n")
    (raw / "b.jsonl").write_text(json.dumps({"text": "To be, or not to be:\r\nthat is the question.\r\n"}) + "\n"
                                 + json.dumps({"text": "\ufeff  To be, or not to be:\nthat is the question."}) + "\n")
    pq.write_table(pa.table({"text": ["\nTo be, or not to be:\rthat is the question.  "]}), raw / "c.parquet")
    units = work_units(source_files(str(raw), tmp_path), unit_bytes=1 << 20)
    docs = [d for u in units for d in read_unit(u, "text")]
    assert len(docs) == 4 and {d.text for d in docs} == {"To be, or not to be:\nthat is the question."}
    assert len({document_hash(d.text, 7) for d in docs}) == 1

def _large_jsonl(path: Path, seed: int = 3) -> list[str]:
    """About 1 MB of gzip (path.gz) or zstd (path.zst) in two members or frames (zero bytes between gzip's
    members, as gzip allows; a skippable frame between zstd's, the second frame with its checksum and size), blank
    lines, a line of 300 KB (several GZIP_GRID blocks of compressed bytes), one of 1.5 MB that a few KB decode to
    (more text than one inflating call gives, many zstd blocks) and a last line without a newline; returns its
    lines."""
    import random
    rng = random.Random(seed)
    word = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))  # noqa: E731
    texts = [" ".join(word() for _ in range(rng.randint(1, 300))) for _ in range(1500)]
    texts[700] = " ".join(word() for _ in range(50_000))
    texts[1200] = "ab " * 500_000
    lines = [json.dumps({"text": t}) + ("\n\n" if i % 97 == 0 else "\n") for i, t in enumerate(texts)]
    lines[-1] = lines[-1].rstrip("\n")
    raw = "".join(lines).encode()
    half = len(raw) // 2
    if path.name.endswith(".zst"):
        import zstandard
        skippable = (0x184D2A5A).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"hello"
        path.write_bytes(zstandard.ZstdCompressor(level=3).compress(raw[:half]) + skippable
                         + zstandard.ZstdCompressor(level=3, write_checksum=True).compress(raw[half:]))
    else:
        path.write_bytes(gzip.compress(raw[:half], mtime=0) + b"\0\0\0" + gzip.compress(raw[half:], mtime=0))
    return raw.decode().split("\n")


@pytest.mark.parametrize("suffix", ["gz", "zst"])
def test_a_large_compressed_jsonl_is_read_in_ranges_each_a_unit_and_every_line_once(tmp_path, suffix):
    """A .jsonl.gz or .jsonl.zst larger than a unit was one unit, read by one worker however large (a corpus of a
    few large files used a few cores): now up to MAX_GZIP_PIECES ranges of its compressed bytes, as many as its
    share of TARGET_UNITS, each its own unit, each read by decoding the file from its start and keeping the lines
    that begin in its range. Read that way, the documents (names by line number, texts) are the whole file's read
    as one unit, with any file around it."""
    from common import sources
    from corpus.build import build_key, key_blob
    raw = tmp_path / "raw"
    raw.mkdir()
    name = f"b.jsonl.{suffix}"
    lines = _large_jsonl(raw / name)
    (raw / "a.txt").write_text("before")
    (raw / "c.txt").write_text("after")
    size = (raw / name).stat().st_size
    assert size > 8 * sources.GZIP_GRID
    files = source_files(str(raw), tmp_path)
    whole = list(work_units(files, unit_bytes=1 << 30))
    units = list(work_units(files, unit_bytes=-(-size // 6)))  # 6 ranges, whatever the size
    pieces = [list(u.pieces) for u in units]
    assert len(whole) == 1 and [len(p) for p in pieces] == [1, 1, 1, 1, 1, 1, 1, 1]  # a.txt, 6 ranges, c.txt
    assert [p[0].file.name for p in pieces] == ["a.txt"] + [name] * 6 + ["c.txt"]
    ranges = [(p[0].start, p[0].stop) for p in pieces[1:-1]]
    assert ranges[0][0] == 0 and ranges[-1][1] == size and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(start % sources.GZIP_GRID == 0 for start, _ in ranges)
    read = lambda units: [(d.name, d.text) for u in units for d in read_unit(u, "text")]  # noqa: E731
    expected = [("a.txt", "before")] + [(f"{name}:{n}", json.loads(line)["text"].strip())
                                        for n, line in enumerate(lines, 1) if line] + [("c.txt", "after")]
    assert read(units) == read(whole) == expected
    by_range = [[d.name for d in read_unit(u, "text")] for u in units[1:-1]]
    assert all(by_range) and f"{name}:701" in sum(by_range, [])  # the 300 KB line, read in one range
    with pytest.raises(TypeError, match="not an iterator"):  # read again after its total: a SourceList or a list
        list(work_units(iter(list(files)), unit_bytes=size // 5))
    # cut only as far as the corpus needs units: as one of 100 such files, 3 ranges (256 units in all); of 1,000, none
    (big,) = [f for f in files if f.name == name]
    assert len(sources.compressed_ranges(big, -(-size // 6), 100 * size)) == 4  # 3 ranges: their starts and the end
    assert sources.compressed_ranges(big, -(-size // 6), 1000 * size) == [0, size]
    assert sources.split_marker(big) == f"jsonl.{suffix} ranges v1"
    # the key names the file's ranges (its units differ from a build's before them); a file of one unit's is as
    # it was, so corpora built before stay current
    config = tiny_config(tmp_path)
    config.corpus.unit_mb = -(-size // 6) / 2**20
    listed = [[f.name, f.size, f.mtime_ns] for f in files]
    assert build_key(config, files) != hashlib.sha256(json.dumps({**key_blob(config), "files": listed},
                                                                 sort_keys=True).encode()).hexdigest()
    config.corpus.unit_mb = 1024
    assert build_key(config, files) == hashlib.sha256(json.dumps({**key_blob(config), "files": listed},
                                                                 sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("suffix", ["gz", "zst"])
def test_a_compressed_jsonl_cut_short_fails_in_its_last_range_naming_it_and_its_other_ranges_read(tmp_path, suffix):
    """Decoding a range stops where its last line ends: only the last range reaches the gzip trailer (the
    whole file's CRC and length, checked there) or the zstd frame's checksum, or finds the file cut short."""
    from common.sources import SourceUnreadable
    path = tmp_path / f"b.jsonl.{suffix}"
    _large_jsonl(path)
    path.write_bytes(path.read_bytes()[:-100])
    units = list(work_units(source_files(str(path), tmp_path), unit_bytes=-(-path.stat().st_size // 4)))
    assert len(units) == 4
    assert all([d for d in read_unit(u, "text")] for u in units[:-1])
    with pytest.raises(SourceUnreadable, match=rf"{path} cannot be read: Compressed file ended"):
        list(read_unit(units[-1], "text"))


def test_a_damaged_jsonl_gz_fails_as_gzip_open_failed_on_it(tmp_path):
    """The ranges' reader inflates with zlib itself: each damage is still classed as gzip.open's was, a file that
    cannot be read (its header or trailer wrong: a build keeps its work for a rerun) or damaged deflate data."""
    import zlib
    from common.sources import SourceUnreadable
    raw = gzip.compress(b"".join(json.dumps({"text": f"doc {i} " * 20}).encode() + b"\n" for i in range(300)), mtime=0)
    flip = lambda data, i: data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]  # noqa: E731
    cases = {"crc": flip(raw, -8), "length": flip(raw, -2), "trailing bytes": raw + b"xyz",
             "one trailing byte": raw + b"x", "zeros in front": b"\0\0" + raw, "cut short": raw[:-10],
             "not gzip": b"hello", "method": flip(raw, 2), "deflate data": flip(raw, 40)}
    path = tmp_path / "x.jsonl.gz"
    for case, data in cases.items():
        path.write_bytes(data)
        try:
            list(gzip.open(path, "rb"))
            expected = None
        except (OSError, EOFError):
            expected = SourceUnreadable
        except zlib.error:
            expected = CorpusError
        with pytest.raises(CorpusError) as raised:  # SourceUnreadable is a CorpusError
            [d for u in work_units(source_files(str(path), tmp_path), 1 << 30) for d in read_unit(u, "text")]
        assert expected is not None and type(raised.value) is expected and str(path) in str(raised.value), case
    path.write_bytes(raw + b"\0\0" + raw)  # two members, zero bytes between them: read as gzip reads them
    assert len([d for u in work_units(source_files(str(path), tmp_path), 1 << 30) for d in read_unit(u, "text")]) == 600
    # where zlib is stricter than gzip.open (which ignored both): a header's own CRC wrong, reserved flags set
    header_crc = raw[:3] + bytes([raw[3] | 0x02]) + raw[4:10] + b"\0\0" + raw[10:]  # FHCRC on, CRC16 0 (wrong)
    reserved = raw[:3] + bytes([raw[3] | 0x80]) + raw[4:]
    for case, data in (("header crc", header_crc), ("reserved flags", reserved)):
        path.write_bytes(data)
        assert len(list(gzip.open(path, "rb"))) == 300, case
        with pytest.raises(CorpusError, match=rf"{path} is damaged \(its gzip data"):
            [d for u in work_units(source_files(str(path), tmp_path), 1 << 30) for d in read_unit(u, "text")]


def test_zstd_sources_are_read_as_their_plain_text_and_their_damage_is_named(tmp_path):
    """.jsonl.zst (the Pile's and SlimPajama's format) and .txt.zst were left out with a note: now read as streams
    decoded a block at a time, each the documents of its plain text; two frames one after the other read as one
    file; a file cut short cannot be read (as a gzip file cut short), damaged data is damaged; both name the file.
    A stretch that compresses ten-thousandfold comes a block (128 KiB) at a time, not all at once."""
    from common.sources import SourceUnreadable

    def zst(data: bytes) -> bytes:
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as out:
            out.write(data)
        return sink.getvalue().to_pybytes()

    def docs(path):
        return [(d.name, d.text) for u in work_units(source_files(str(path), tmp_path), 1 << 30)
                for d in read_unit(u, "text")]
    jsonl = "".join(json.dumps({"text": f"document {i} " + "words " * i}) + "\n" for i in range(1, 300)).encode()
    text = "".join(f"line {i} of a book\n" for i in range(1, 2000)).encode()
    for name, data in (("a.jsonl", jsonl), ("b.txt", text)):
        (tmp_path / name).write_bytes(data)
        (tmp_path / f"{name}.zst").write_bytes(zst(data))
        plain, packed = docs(tmp_path / name), docs(tmp_path / f"{name}.zst")
        assert [t for _, t in packed] == [t for _, t in plain] and len(plain) in (1, 299)
        # named as a gzip file's documents are: by line number, or the file for a text file's one document
        names = [f"{name}.zst:{i}" for i in range(1, 300)] if len(plain) > 1 else [f"{name}.zst"]
        assert [n for n, _ in packed] == names
    half = len(jsonl) // 2
    (tmp_path / "two.jsonl.zst").write_bytes(zst(jsonl[:half]) + zst(jsonl[half:]))
    assert [t for _, t in docs(tmp_path / "two.jsonl.zst")] == [t for _, t in docs(tmp_path / "a.jsonl")]
    whole = zst(jsonl)
    cut, damaged = tmp_path / "cut.jsonl.zst", tmp_path / "damaged.jsonl.zst"
    cut.write_bytes(whole[:-50])
    with pytest.raises(SourceUnreadable, match=rf"{cut} cannot be read"):
        docs(cut)
    said = []
    for offset in range(0, len(whole), max(1, len(whole) // 40)):  # a byte flipped: never a bare library error
        damaged.write_bytes(whole[:offset] + bytes([whole[offset] ^ 0xFF]) + whole[offset + 1:])
        try:
            docs(damaged)
        except CorpusError as e:  # zstd's frames carry no checksum here: some damage only shows as bad JSON
            assert str(e).startswith(str(damaged)), e
            said.append(str(e))
    assert any(f"{damaged} is damaged (its zstd data" in m for m in said), said
    # a frame of `zstd --long=31` (a 2 GiB window; the decoder takes 128 MiB): intact, so not called damaged
    wide = tmp_path / "wide.jsonl.zst"
    wide.write_bytes(b"\x28\xb5\x2f\xfd" + bytes([0x00, (31 - 10) << 3]) + bytes([0x09, 0x00, 0x00]) + b"a")
    with pytest.raises(CorpusError, match=rf"{wide} was compressed with a window larger .*zstd -dc --long=31"):
        docs(wide)
    from common.sources import SourceFile, _ranged_lines, _zstd_blocks
    # a chunk without text (an empty frame, a stream writer's flush) just before a range's start: the range's
    # first line is still its own (it was lost: the empty chunk read as a line's middle)
    chunks = [(0, b"a\n"), (5, b""), (10, b"b\n"), (20, b"c\n")]
    source = SourceFile("x.jsonl.zst", "x.jsonl.zst", "jsonl", 30, 0)
    assert [[line for _, _, line in _ranged_lines(Piece(source, a, b), iter(chunks))] for a, b in ((0, 10), (10, 30))] \
        == [[b"a\n"], [b"b\n", b"c\n"]]
    import zstandard
    empty = tmp_path / "empty-frame.jsonl.zst"
    empty.write_bytes(zst(jsonl[:half]) + zstandard.ZstdCompressor().compress(b"") + zst(jsonl[half:]))
    assert all(text for _, text in _zstd_blocks(str(empty))) and \
        [t for _, t in docs(empty)] == [t for _, t in docs(tmp_path / "a.jsonl")]
    samples = [json.dumps({"text": f"document {i} " + "words " * (i % 17)}).encode() for i in range(2000)]
    dictionary = zstandard.train_dictionary(4096, samples)
    (tmp_path / "dictionary.jsonl.zst").write_bytes(zstandard.ZstdCompressor(dict_data=dictionary).compress(jsonl))
    with pytest.raises(CorpusError, match=rf"dictionary.jsonl.zst was compressed with a zstd dictionary \(id "
                                          rf"{dictionary.dict_id()}\), which this reader does not take"):
        docs(tmp_path / "dictionary.jsonl.zst")
    dense = tmp_path / "dense.txt.zst"
    dense.write_bytes(zst(b"a" * (16 << 20)))
    assert dense.stat().st_size < (16 << 20) // 10_000
    texts = [text for _, text in _zstd_blocks(str(dense))]
    assert max(map(len, texts)) == 128 << 10 and b"".join(texts) == b"a" * (16 << 20)


@pytest.mark.slow
def test_a_corpus_of_a_large_jsonl_gz_and_jsonl_zst_builds_from_their_ranges_alike_on_one_and_two_workers(tmp_path):
    """The build reads each range in a unit of its own (written to and read back from the staging folder's
    units file) and keeps every document once; two Ray workers, each decoding the files in its own process,
    cut them where this process does: the same bytes."""
    from common.sources import compressed_ranges
    raw = tmp_path / "raw"
    raw.mkdir()
    lines = _large_jsonl(raw / "a.jsonl.gz") + _large_jsonl(raw / "b.jsonl.zst", seed=4)
    config = tiny_config(tmp_path)
    config.corpus.source = str(raw)
    config.corpus.unit_mb = -(-max(p.stat().st_size for p in raw.iterdir()) // 3) / 2**20  # the larger in 3 ranges
    build_corpus(config, tmp_path / "one", workers=1, **quiet)
    build_corpus(config, tmp_path / "two", workers=2, **quiet)
    meta = load_corpus_meta(tmp_path / "one")
    files = source_files(str(raw), tmp_path)
    ranges = [len(compressed_ranges(f, int(config.corpus.unit_mb * 2**20), sum(f.size for f in files))) - 1
              for f in files]
    assert min(ranges) >= 2 and meta["units"] == sum(ranges)
    # every line once, and dropped once: the 1.5 MB line both files hold
    assert meta["documents"]["read"] == sum(1 for line in lines if line) and meta["documents"]["duplicates"] == 1
    assert digest(tmp_path / "one") == digest(tmp_path / "two")


def test_a_large_txt_gz_is_read_in_documents_of_its_lines(tmp_path, monkeypatch):
    """Past TEXT_DOCUMENT_BYTES a compressed text file is cut at line starts into documents (named by their
    offset, like a large plain file's ranges) instead of read whole; a small one stays one document."""
    import common.sources as sources
    monkeypatch.setattr(sources, "TEXT_DOCUMENT_BYTES", 1000)
    lines = [f"line {i} of a compressed text file\n" for i in range(200)]
    with gzip.open(tmp_path / "big.txt.gz", "wt") as f:
        f.write("".join(lines))
    with gzip.open(tmp_path / "small.txt.gz", "wt") as f:
        f.write("".join(lines[:10]))
    docs = [d for u in work_units(source_files(str(tmp_path / "big.txt.gz"), tmp_path), 1 << 20)
            for d in read_unit(u, "text")]
    assert len(docs) == 7 and docs[0].name == "big.txt.gz:0" and docs[1].name.startswith("big.txt.gz:10")
    assert [line.strip() for d in docs for line in d.text.splitlines()] == [line.strip() for line in lines]
    (small,) = [d for u in work_units(source_files(str(tmp_path / "small.txt.gz"), tmp_path), 1 << 20)
                for d in read_unit(u, "text")]
    assert small.name == "small.txt.gz" and small.text == "".join(lines[:10]).strip()
    (tmp_path / "plain.txt").write_text("".join(lines))  # a plain file within one unit: one document, as before
    (plain,) = [d for u in work_units(source_files(str(tmp_path / "plain.txt"), tmp_path), 1 << 20)
                for d in read_unit(u, "text")]
    assert plain.name == "plain.txt" and plain.text == "".join(lines).strip()
    # a Project Gutenberg book: its header cut from the first document only, nothing past the END marker read
    book = ["*** START OF THE PROJECT GUTENBERG EBOOK X ***\n", *lines, "*** END OF THE PROJECT GUTENBERG EBOOK X ***\n",
            *[f"licence clause {i} of the Project Gutenberg terms\n" for i in range(200)]]
    with gzip.open(tmp_path / "book.txt.gz", "wt") as f:
        f.write("".join(book))
    docs = [d for u in work_units(source_files(str(tmp_path / "book.txt.gz"), tmp_path), 1 << 20)
            for d in read_unit(u, "text")]
    assert [line.strip() for d in docs for line in d.text.splitlines()] == [line.strip() for line in lines]


def test_only_a_gutenberg_etext_is_cut_at_its_markers_whole_compressed_or_in_ranges(tmp_path, monkeypatch):
    """A crawl or a dump of many books quoting a book's last line ("End of the Project Gutenberg EBook of X") is
    text: everything after such a line was dropped (in a large compressed file, the rest of the file: a build of
    18 MB kept 5% of it). Only a file whose beginning holds an e-text's header is cut at the markers."""
    import common.sources as sources
    monkeypatch.setattr(sources, "TEXT_DOCUMENT_BYTES", 1000)
    monkeypatch.setattr(sources, "GUTENBERG_HEAD_CHARS", 1000)  # an e-text's header: at its top (65,536 here)
    lines = [f"line {i} of a crawl\n" for i in range(300)]
    lines[100] = "End of the Project Gutenberg EBook of Hamlet, quoted on a web page\n"
    lines[200] = "*** START OF THE PROJECT GUTENBERG EBOOK X *** quoted too\n"
    assert strip_gutenberg("".join(lines)) == "".join(lines).strip()
    with gzip.open(tmp_path / "crawl.txt.gz", "wt") as f:
        f.write("".join(lines))
    (tmp_path / "crawl.txt").write_text("".join(lines))
    for name, unit in (("crawl.txt.gz", 1 << 20), ("crawl.txt", 2000)):  # the plain one in ranges of 2,000 bytes
        units = list(work_units(source_files(str(tmp_path / name), tmp_path), unit))
        docs = [d for u in units for d in read_unit(u, "text")]
        assert len(docs) > 2 and [line.strip() for d in docs for line in d.text.splitlines()] == [
            line.strip() for line in lines], name
    # an e-text read in ranges: the header cut from the first range only, each range's text kept
    book = ["*** START OF THE PROJECT GUTENBERG EBOOK X ***\n", *[f"line {i} of the work\n" for i in range(300)]]
    (tmp_path / "book.txt").write_text("".join(book))
    docs = [d for u in work_units(source_files(str(tmp_path / "book.txt"), tmp_path), 2000)
            for d in read_unit(u, "text")]
    assert len(docs) > 2 and [line for d in docs for line in d.text.splitlines()] == [x.strip() for x in book[1:]]


@pytest.mark.parametrize("suffix", ["gz", "zst"])
def test_a_large_compressed_txt_is_read_in_ranges_as_the_documents_of_a_whole_read(tmp_path, monkeypatch, suffix):
    """A .txt.gz or .txt.zst larger than a unit was one unit, read by one worker however large (a sentence a line,
    gigabytes of it): now ranges of its compressed bytes like a compressed .jsonl's, each reader cutting the file's
    documents from its start as a whole read cuts them (lines of megabytes at a space) and keeping those whose
    first byte its range decodes to. The documents (names, texts) are a whole read's: a Gutenberg book's header
    cut from the first, nothing past its END marker in any range."""
    import random
    import common.sources as sources
    monkeypatch.setattr(sources, "TEXT_DOCUMENT_BYTES", 20_000)
    monkeypatch.setattr(sources, "LONG_LINE_BYTES", 5_000)
    rng = random.Random(5)
    word = lambda: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))  # noqa: E731
    lines = [" ".join(word() for _ in range(rng.randint(1, 2000 if i % 50 == 0 else 30))) + "\n" for i in range(4000)]
    book = "".join(["*** START OF THE PROJECT GUTENBERG EBOOK X ***\n", *lines,
                    "*** END OF THE PROJECT GUTENBERG EBOOK X ***\n",
                    *[f"licence clause {i}: {word()} {word()} {word()}\n" for i in range(16_000)]]).encode()
    path = tmp_path / f"book.txt.{suffix}"
    if suffix == "zst":
        import zstandard
        half = len(book) // 2
        path.write_bytes(zstandard.ZstdCompressor().compress(book[:half]) + zstandard.ZstdCompressor().compress(b"")
                         + zstandard.ZstdCompressor().compress(book[half:]))  # an empty frame between them
    else:
        path.write_bytes(gzip.compress(book, mtime=0))
    files = source_files(str(path), tmp_path)
    read = lambda unit: [(d.name, d.text) for d in read_unit(unit, "text")]  # noqa: E731
    (whole,) = work_units(files, 1 << 30)
    expected = read(whole)
    assert len(expected) > 20 and "START OF THE" not in expected[0][1] and expected[0][0] == f"book.txt.{suffix}:0"
    assert [w for _, text in expected for w in text.split()] == [w for line in lines for w in line.split()]
    units = list(work_units(files, -(-path.stat().st_size // 6)))
    by_range = [read(u) for u in units]
    assert len(units) == 6 and sum(by_range, []) == expected
    assert all(by_range[:3]) and not by_range[-1]  # the licence, past the END marker, holds the last range
    assert sources.split_marker(units[0].pieces[0].file) == f"txt.{suffix} ranges v1"
    # a range of a document's bytes at least: fewer than two documents' worth of compressed bytes stay one unit
    monkeypatch.setattr(sources, "TEXT_DOCUMENT_BYTES", path.stat().st_size // 2 + 1)
    assert len(list(work_units(files, -(-path.stat().st_size // 6)))) == 1


def test_a_text_of_one_long_line_is_cut_at_spaces_plain_or_compressed(tmp_path, monkeypatch):
    """A corpus file of one line (text8's layout): plain, its byte ranges start after a space instead of
    the whole line falling to the first range; compressed, its documents end at a space. Every word once."""
    import common.sources as sources
    monkeypatch.setattr(sources, "LONG_LINE_BYTES", 500)
    monkeypatch.setattr(sources, "TEXT_DOCUMENT_BYTES", 3000)
    words = [f"word{i}" for i in range(4000)]
    (tmp_path / "one.txt").write_text(" ".join(words))
    with gzip.open(tmp_path / "one.txt.gz", "wt") as f:
        f.write(" ".join(words))
    for name, unit_bytes in (("one.txt", 4000), ("one.txt.gz", 1 << 30)):
        docs = [d for u in work_units(source_files(str(tmp_path / name), tmp_path), unit_bytes)
                for d in read_unit(u, "text")]
        assert len(docs) > 5 and max(len(d.text) for d in docs) < 4600, (name, [len(d.text) for d in docs])
        assert [w for d in docs for w in d.text.split()] == words, name
    cjk = "".join(chr(0x4E00 + i % 500) for i in range(3000))  # no white space: cut at a character's start
    (tmp_path / "cjk.txt").write_text(cjk)
    with gzip.open(tmp_path / "cjk.txt.gz", "wt") as f:
        f.write(cjk)
    for name, unit_bytes in (("cjk.txt", 1000), ("cjk.txt.gz", 1 << 30)):
        docs = [d for u in work_units(source_files(str(tmp_path / name), tmp_path), unit_bytes)
                for d in read_unit(u, "text")]
        assert len(docs) > 2 and "".join(d.text for d in docs) == cjk, name
    lines = [" ".join(words[i:i + 10]) for i in range(0, 4000, 10)]  # short lines: cut at line starts as before
    (tmp_path / "lines.txt").write_text("\n".join(lines))
    docs = [d for u in work_units(source_files(str(tmp_path / "lines.txt"), tmp_path), 4000)
            for d in read_unit(u, "text")]
    assert [line for d in docs for line in d.text.split("\n")] == lines

# the peak is VmHWM, not getrusage's ru_maxrss: Linux keeps that across exec, and this process read at least the
# test process's RSS at the fork (the 4x texts it had just made: 639 against 397 MB for a read of 200 MB or less)
# documents of 2 MiB, not 8: a compressed .txt's ranges are a document's bytes at least, so the 1x file too is read
# in ranges, the path the 4x file takes (read whole, its peak sat about 9 MB lower, glibc's first 8 MB blocks mapped)
READ_TEXT_GZ = """
import sys
import common.sources
common.sources.TEXT_DOCUMENT_BYTES = 2 << 20
from common.sources import read_unit, source_files, work_units
units = work_units(source_files(sys.argv[1], sys.argv[2]), 8 << 20)
chars = sum(len(d.text) for u in units for d in read_unit(u, "text"))
print(chars, next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lines.txt.gz", "one-line.txt.gz", "one-line.txt", "one-row-group.parquet"])
def test_reading_a_text_file_of_4x_the_text_peaks_at_the_memory_of_1x(tmp_path, env_with_repo, kind):
    """Peak RSS of reading one text file of about 160 MB against one of 40 MB: flat. A .txt.gz was read
    whole (311 against 472 MB before, the same 311 MB now); a file of one line fell whole to one document; a
    Parquet file's row group, which a unit never splits, was read with its whole column chunk (pyarrow's
    pre-buffering), a buffered stream now."""
    rng = np.random.default_rng(0)
    words = np.array(["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs", "far", "away"])
    block = ("\n".join(" ".join(row) for row in words[rng.integers(0, 12, (100_000, 10))]) + "\n").encode()
    if kind.startswith("one-line"):
        block = block.replace(b"\n", b" ")
    peaks = []
    for scale in (1, 4):
        path = tmp_path / f"text{scale}-{kind}"
        if kind.endswith(".parquet"):  # documents of 100 lines, all in one row group (pandas' default: 1M rows)
            lines = block.decode().splitlines()
            texts = ["\n".join(lines[i:i + 100]) for i in range(0, len(lines), 100)] * (8 * scale)
            pq.write_table(pa.table({"text": texts}), path, row_group_size=len(texts), compression="zstd")
            assert pq.ParquetFile(path).metadata.num_row_groups == 1
        else:
            with (gzip.open(path, "wb", compresslevel=1) if kind.endswith(".gz") else open(path, "wb")) as f:
                for _ in range(8 * scale):
                    f.write(block)
        result = subprocess.run([sys.executable, "-c", READ_TEXT_GZ, str(path), str(tmp_path)], cwd=ROOT,
                                env=env_with_repo, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        chars, peak = map(int, result.stdout.split())
        assert chars > scale * 30_000_000
        peaks.append(peak)
    assert peaks[1] / peaks[0] <= 1.2, peaks

def test_legacy_encodings_and_a_stray_byte_decode_as_the_text_they_are():
    from common.sources import decode
    assert decode("It\u2019s \u201cquoted\u201d \u2014 done".encode("cp1252") * 50, "f") == \
        "It\u2019s \u201cquoted\u201d \u2014 done" * 50  # Latin-1 read these as control characters: refused
    assert decode("Caf\u00e9 cr\u00e8me, na\u00efve".encode("latin-1"), "f") == "Caf\u00e9 cr\u00e8me, na\u00efve"
    assert decode("Caf\u00e9 cr\u00e8me, na\u00efve ".encode() + b"\xff" + " \u00e0 la carte".encode(), "f") == \
        "Caf\u00e9 cr\u00e8me, na\u00efve \ufffd \u00e0 la carte"  # not the whole file as Latin-1 mojibake
    assert decode(b"\x81" + b" old \xe9t\xe9" * 2000, "f") == "\x81" + " old \u00e9t\u00e9" * 2000  # cp1252 lacks 0x81

def test_upper_case_gzip_names_are_read_as_gzip(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    with gzip.open(raw / "DATA.JSONL.GZ", "wt") as f:
        f.write('{"text": "from the jsonl"}\n')
    with gzip.open(raw / "NOTES.TXT.GZ", "wt") as f:
        f.write("from the text file\n")
    units = work_units(source_files(str(raw), tmp_path), unit_bytes=10)
    assert sorted(d.text.strip() for u in units for d in read_unit(u, "text")) == ["from the jsonl",
                                                                                  "from the text file"]
    with pytest.raises(CorpusError, match="corpus source s3://bucket/raw: sources are read from this machine's"):
        source_files("s3://bucket/raw", tmp_path)

def test_build_corpus_rows_stay_inside_their_document(tmp_path):
    write_text_corpus(tmp_path / "raw", num_docs=5)
    config = tiny_config(tmp_path)
    build_corpus(config, config.corpus_dir, **quiet)
    meta = load_corpus_meta(config.corpus_dir)
    # the build's own files stay behind (units.jsonl: every source file's path, a few hundred bytes each)
    assert not {"units.jsonl", "progress.jsonl", "key.json", "scan"} & {p.name for p in config.corpus_dir.iterdir()}
    tok = Tokenizer(config.corpus_dir / "tokenizer.model")
    assert tok.vocab_size == 320 and meta["tokenizer_sha256"] == tok.sha256
    assert [tok.piece(i) for i in range(5)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    # ids after the specials are in frequency order: the train rows count down
    counts = np.bincount(np.concatenate(load_split(config.corpus_dir, "train")), minlength=tok.vocab_size)[5:]
    assert counts[:20].tolist() == sorted(counts[:20].tolist(), reverse=True) and counts[0] > counts[-1]
    docs = pq.read_table(config.corpus_dir / "documents").to_pylist()
    docs = {d["doc_id"]: d for d in docs}
    assert {d["split"] for d in docs.values()} == {"train", "valid"} and sorted(docs) == list(range(5))
    for split in ("train", "valid"):
        rows = load_split(config.corpus_dir, split)
        assert len(rows) == meta[split]["rows"]
        tables = [read_parquet(config.corpus_dir / p["path"], CORPUS_SCHEMA) for p in meta[split]["parts"]]
        assert tables[0].column("input_ids")[0].as_py() == rows[0].tolist()  # Parquet and memory map agree
        doc_ids = np.concatenate([t.column("doc_id").to_numpy() for t in tables])
        raw = {i: " ".join((tmp_path / "raw" / docs[i]["name"]).read_text().split()) for i in set(doc_ids.tolist())}
        for ids, doc_id in zip(rows, doc_ids):
            assert docs[doc_id]["split"] == split
            assert 8 <= len(ids) <= 32 and ids[0] == CLS_ID and ids[-1] == SEP_ID
            # the decoded body is one contiguous piece of its own document's text
            assert tok.decode(ids[1:-1]).strip() in raw[doc_id]


def test_exact_duplicates_are_dropped_and_the_first_kept(tmp_path, monkeypatch):
    """The first of each text is kept, its copies dropped; deduplicating in buckets of 2 documents (`_decide`)
    gives the same corpus, byte for byte."""
    raw = write_text_corpus(tmp_path / "raw", num_docs=4)
    text = (raw / "work_01.txt").read_text()
    (raw / "work_01_copy.txt").write_text(text)  # the same text under another name
    config = tiny_config(tmp_path)
    build_corpus(config, config.corpus_dir, **quiet)
    meta = load_corpus_meta(config.corpus_dir)
    assert meta["documents"]["duplicates"] == 1 and meta["documents"]["read"] == 5
    names = [d["name"] for d in pq.read_table(config.corpus_dir / "documents").to_pylist()]
    assert "work_01.txt" in names and "work_01_copy.txt" not in names  # the first one is kept
    import corpus.build
    monkeypatch.setattr(corpus.build, "DEDUP_BUCKET_DOCS", 2)
    build_corpus(config, tmp_path / "in-buckets", **quiet)
    assert digest(tmp_path / "in-buckets") == digest(config.corpus_dir)


@pytest.mark.parametrize("make, message", [("missing", "does not exist"), ("empty_folder", "holds no text"),
                                           ("blank_files", "holds no text")])
def test_empty_or_missing_corpus_is_refused_without_output(tmp_path, make, message):
    source = tmp_path / "raw"
    if make != "missing":
        source.mkdir()
    if make == "blank_files":
        (source / "a.txt").write_text("   \n\n")
    config = tiny_config(tmp_path)
    with pytest.raises(CorpusError, match=message):
        build_corpus(config, config.corpus_dir, **quiet)
    assert not config.corpus_dir.exists()
    assert not any(p.name.startswith(".corpus") for p in tmp_path.iterdir())


@pytest.mark.parametrize("texts, message", [
    (("five words in this file", "and five words in this"), r"tokenizer.vocab_size = 320"),
    (("", ""), "corpus source {raw} holds no text: its 2 file"),  # empty files: no division by their 0 bytes
])
def test_too_little_text_for_the_vocabulary_is_a_clear_error(tmp_path, texts, message):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text(texts[0])
    (tmp_path / "raw" / "b.jsonl" if not texts[1] else tmp_path / "raw" / "b.txt").write_text(texts[1])
    config = tiny_config(tmp_path)
    with pytest.raises(CorpusError, match=message.format(raw=tmp_path / "raw")):
        build_corpus(config, config.corpus_dir, **quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]  # no staging folder left


def _multi_file_source(tmp_path):
    """Texts in four formats, several units each (unit_mb = 0.01 in the test config)."""
    raw = write_text_corpus(tmp_path / "raw", num_docs=6)
    docs = [write_text_corpus(tmp_path / f"gen{i}", num_docs=1, seed=10 + i) / "work_00.txt" for i in range(6)]
    with gzip.open(raw / "more.jsonl.gz", "wt") as f:
        for d in docs[:3]:
            f.write(json.dumps({"text": d.read_text()}) + "\n")
    (raw / "sub").mkdir()
    (raw / "sub" / "plain.jsonl").write_text("".join(json.dumps({"text": d.read_text()}) + "\n" for d in docs[3:5]))
    with gzip.open(raw / "sub" / "one.txt.gz", "wt") as f:
        f.write(docs[5].read_text())
    return raw


@pytest.mark.slow
def test_one_and_two_workers_give_the_same_bytes_and_a_rerun_is_current(tmp_path):
    """1 worker runs the units in this process, 2 on Ray workers: the same files, byte for byte."""
    _multi_file_source(tmp_path)
    config = tiny_config(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    build_corpus(config, one, workers=1, **quiet)
    build_corpus(config, two, workers=2, **quiet)
    meta = load_corpus_meta(one)
    assert meta["units"] > 3 and len(meta["train"]["parts"]) > 3 and meta["documents"]["read"] == 12
    assert digest(one) == digest(two)
    assert corpus_is_current(config, one, config.corpus.source)
    rows = SplitRows(one, "train")
    assert len(rows) == meta["train"]["rows"] and np.array_equal(rows[len(rows) - 1], load_split(one, "train")[-1])


def test_a_corpus_of_one_unit_builds_in_this_process_whatever_the_workers_asked(tmp_path, monkeypatch):
    """A worker per unit at most: a corpus of one unit (the default's) has one worker's work, and Ray's start-up
    would cost more than the build. Here Ray cannot start; the build with 2 workers asked gives the 1-worker bytes."""
    import common.parallel

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started for a corpus of one unit")
    _multi_file_source(tmp_path)
    config = tiny_config(tmp_path, corpus={"unit_mb": 64.0})
    build_corpus(config, tmp_path / "one", workers=1, **quiet)
    monkeypatch.setattr(common.parallel, "start_ray", no_ray)
    said = []
    build_corpus(config, tmp_path / "two", workers=2, log=said.append)
    assert load_corpus_meta(tmp_path / "two")["units"] == 1 and "in 1 units on 1 worker(s)" in said[0], said
    assert digest(tmp_path / "one") == digest(tmp_path / "two")


@pytest.mark.slow
def test_kill_9_during_the_build_then_a_rerun_gives_the_same_bytes(tmp_path, env_with_repo):
    _multi_file_source(tmp_path)
    config = tiny_config(tmp_path)
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(config))
    build_corpus(config, tmp_path / "reference", workers=1, **quiet)  # in this process: no Ray to start
    cmd = [sys.executable, "-m", "corpus", "--manifest", str(manifest), "--workers", "2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env_with_repo, SLOW_ENV: "1.5"}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staging = tmp_path / ".corpus.staging"
    deadline = time.time() + 120
    while time.time() < deadline and not ((staging / "progress.jsonl").is_file() and
                                          len((staging / "progress.jsonl").read_text().splitlines()) >= 2):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not config.corpus_dir.exists() and staging.is_dir()  # nothing published, the work kept
    parts = sorted((staging / "train").glob("*.npy"))
    parts[0].write_bytes(b"damaged")  # a part the rerun must redo
    rerun = subprocess.run(cmd, cwd=ROOT, env=env_with_repo, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "already done" in rerun.stdout and not staging.exists()
    assert "hashed" not in rerun.stdout  # the parts recorded before the kill are trusted by their stamps
    assert digest(config.corpus_dir) == digest(tmp_path / "reference")


@pytest.mark.slow
def test_a_source_file_changed_during_the_build_stops_it_with_one_line_and_a_rerun_starts_over(tmp_path,
                                                                                                env_with_repo):
    """The packing pass reads the documents the scan counted: a file appended to in between (its documents
    shifted against the driver's masks) stops the build naming it, not an IndexError or stale masks."""
    raw = _multi_file_source(tmp_path)
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(tiny_config(tmp_path)))
    cmd = [sys.executable, "-m", "corpus", "--manifest", str(manifest), "--workers", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env_with_repo, SLOW_ENV: "1.0"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    progress = tmp_path / ".corpus.staging" / "progress.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (progress.is_file() and progress.read_text().strip()):
        time.sleep(0.1)
    for path in sorted(p for p in raw.rglob("*") if p.is_file()):  # every unit after the first packed one
        with open(path, "ab") as f:
            f.write(b"\n" if path.suffix != ".gz" else gzip.compress(b"\n"))
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 2, err[-3000:]
    assert "changed while the corpus was being built" in err and "Traceback" not in err, err[-3000:]
    rerun = subprocess.run(cmd, cwd=ROOT, env=env_with_repo, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and "(0 already done)" in rerun.stdout, rerun.stdout[-3000:]

def _flip_keeping_stat(path, offset):
    """One byte of `path` changed in place, its size and modification time as they were (the build key holds)."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_source_file_that_fails_to_read_keeps_the_work_and_the_same_command_continues(tmp_path):
    """A read error may pass (a network file system): the scans already done stay in the staging folder, and
    once the file reads again (same name, size and time) the rerun scans only the rest, to the same bytes."""
    raw = _multi_file_source(tmp_path)
    gz = raw / "zz.txt.gz"  # the last unit's: the units before it are scanned when it fails
    with gzip.open(gz, "wt") as f:
        f.write((write_text_corpus(tmp_path / "last", num_docs=1, seed=30) / "work_00.txt").read_text())
    config = tiny_config(tmp_path)
    build_corpus(config, tmp_path / "reference", **quiet)
    _flip_keeping_stat(gz, -8)  # the gzip trailer's CRC: the whole file is read, then refused
    with pytest.raises(CorpusError,
                       match=r"zz\.txt\.gz cannot be read.*incorrect data check.*kept in .*\.corpus\.staging"):
        build_corpus(config, config.corpus_dir, **quiet)
    staging = tmp_path / ".corpus.staging"
    scanned = len(list((staging / "scan").glob("*.json")))
    assert scanned > 0 and not config.corpus_dir.exists()
    _flip_keeping_stat(gz, -8)
    logs = []
    build_corpus(config, config.corpus_dir, log=logs.append)
    units = load_corpus_meta(config.corpus_dir)["units"]
    assert f"corpus: scanning {units - scanned} of {units} units" in "\n".join(logs)
    assert digest(config.corpus_dir) == digest(tmp_path / "reference")


def test_a_build_that_fails_writing_its_index_keeps_every_part(tmp_path, monkeypatch):
    """The disk fills (or the build is killed) while corpus.json is written, the last file of a build: the
    rerun packs nothing again and gives the same bytes."""
    import errno
    import corpus.build as build
    _multi_file_source(tmp_path)
    config = tiny_config(tmp_path)
    build_corpus(config, tmp_path / "reference", **quiet)
    write_json = build.atomic_write_json

    def disk_full_at_the_index(path, obj):
        if path.name == "corpus.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write_json(path, obj)
    monkeypatch.setattr(build, "atomic_write_json", disk_full_at_the_index)
    with pytest.raises(OSError, match=r"no space left writing .*corpus\.json"):
        build_corpus(config, config.corpus_dir, **quiet)
    monkeypatch.undo()
    logs = []
    build_corpus(config, config.corpus_dir, log=logs.append)
    units = load_corpus_meta(config.corpus_dir)["units"]
    assert f"corpus: packing 0 of {units} units ({units} already done)" in "\n".join(logs)
    assert digest(config.corpus_dir) == digest(tmp_path / "reference")


def test_a_staging_folder_whose_key_was_cut_short_is_started_again(tmp_path):
    write_text_corpus(tmp_path / "raw", num_docs=4)
    config = tiny_config(tmp_path)
    (tmp_path / ".corpus.staging").mkdir()
    (tmp_path / ".corpus.staging" / "key.json").write_text('{"key": "ab')  # killed mid-write by an old version
    build_corpus(config, config.corpus_dir, **quiet)
    assert corpus_is_current(config, config.corpus_dir, config.corpus.source)


def test_a_staging_folder_of_another_source_reader_is_started_again(tmp_path):
    """Scans staged by a version that read sources into other documents are not packed by this one."""
    from corpus.build import build_key
    write_text_corpus(tmp_path / "raw", num_docs=4)
    config = tiny_config(tmp_path)
    staging = tmp_path / ".corpus.staging"
    (staging / "scan").mkdir(parents=True)
    (staging / "scan" / "unit-00000.json").write_text('{"sample": [], "skipped": []}')  # an old version's scan
    key = build_key(config, source_files(config.corpus.source, tmp_path / "downloads"))
    (staging / "key.json").write_text(json.dumps({"key": key}))
    logs = []
    build_corpus(config, config.corpus_dir, log=logs.append)
    assert "scanning 2 of 2 units" in "\n".join(logs) and corpus_is_current(config, config.corpus_dir,
                                                                             config.corpus.source)


def test_a_failed_rebuild_leaves_the_good_corpus_alone(tmp_path):
    write_text_corpus(tmp_path / "raw", num_docs=4)
    config = tiny_config(tmp_path)
    build_corpus(config, config.corpus_dir, **quiet)
    before = digest(config.corpus_dir)
    (tmp_path / "raw" / "broken.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n')
    assert not corpus_is_current(config, config.corpus_dir, config.corpus.source)  # a new file: stale
    with pytest.raises(CorpusError, match=r"broken\.jsonl:2"):
        build_corpus(config, config.corpus_dir, **quiet)
    assert digest(config.corpus_dir) == before


def test_an_old_corpus_is_refused_with_a_rebuild_hint(tmp_path):
    (tmp_path / "corpus.json").write_text(json.dumps({"format_version": 2, "train": {}}))
    with pytest.raises(CorpusError, match="older version.*make corpus"):
        load_corpus_meta(tmp_path)


def test_the_piece_reader_starts_a_range_at_the_next_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(10)))
    (file,) = source_files(str(path), tmp_path)
    cut = path.read_text().index("doc 3") - 3  # inside line 4
    first = Piece(file, 0, cut)
    second = Piece(file, cut, -1)
    from common.sources import read_piece
    texts = [d.text for p in (first, second) for d in read_piece(p, "text")]
    assert texts == [f"doc {i}" for i in range(10)]


def test_bad_documents_can_be_skipped_and_counted_by_a_manifest_switch(tmp_path):
    write_text_corpus(tmp_path / "raw", num_docs=4)
    (tmp_path / "raw" / "bad.txt").write_bytes(b"\x00\x01binary" * 100)
    (tmp_path / "raw" / "c.jsonl").write_text('{"text": "' + "fine words " * 50 + '"}\n{"text": null}\n{"oops\n')
    config = tiny_config(tmp_path)
    config.corpus.on_bad_input = "skip"
    build_corpus(config, config.corpus_dir, **quiet)
    meta = load_corpus_meta(config.corpus_dir)
    assert meta["documents"]["skipped_bad"] == 3 and meta["documents"]["read"] == 5


def test_a_units_scan_keeps_a_few_bad_documents_messages_and_counts_them_all(tmp_path):
    """What the driver loads of every unit's scan stays small however many bad documents are skipped."""
    from corpus.build import KEPT_MESSAGES, scan_unit
    (tmp_path / "c.jsonl").write_text('{"text": "fine words"}\n' + '{"text": null}\n' * 50)
    (unit,) = work_units(source_files(str(tmp_path / "c.jsonl"), tmp_path), 1 << 20)
    scan = scan_unit(unit, str(tmp_path / "h.npy"), "text", 7, 0.2, 100, skip_bad=True)
    assert scan["skipped_count"] == 50 and len(scan["skipped"]) == KEPT_MESSAGES
    assert scan["skipped"][0] == f"{tmp_path / 'c.jsonl'}:2: 'text' is NoneType, not a string"


def test_a_part_is_written_as_it_grows_with_the_bytes_of_one_write(tmp_path):
    """PartWriter flushes every few rows (bounded memory for a unit of any size): the same rows, the
    .npy files byte for byte what np.save writes for the whole arrays, one Parquet row group a flush."""
    from corpus.build import PartWriter
    rng = np.random.default_rng(0)
    rows = [rng.integers(5, 300, size=rng.integers(3, 12)).astype(np.int32) for _ in range(10)]
    writer = PartWriter(tmp_path, "train", 3, flush_rows=4)
    for doc, start in enumerate(range(0, 10, 3)):
        writer.add(rows[start:start + 3], doc)
    record = writer.close()
    assert record["rows"] == 10 and record["tokens"] == sum(map(len, rows))
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    for kind, array in (("tokens", np.concatenate(rows)), ("offsets", offsets)):
        buffer = io.BytesIO()
        np.save(buffer, array)
        assert (tmp_path / record["flat"][kind]["path"]).read_bytes() == buffer.getvalue()
    table = read_parquet(tmp_path / record["path"], CORPUS_SCHEMA)
    assert [list(r) for r in table.column("input_ids").to_pylist()] == [r.tolist() for r in rows]
    assert table.column("row_id").to_pylist() == list(range(10))
    assert table.column("doc_id").to_pylist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert pq.ParquetFile(tmp_path / record["path"]).metadata.num_row_groups == 2  # flushed at 6 rows, then 4
    assert not list(tmp_path.rglob("*.raw")) and not list(tmp_path.rglob(".*tmp*"))


def test_a_large_plain_txt_is_cut_into_units_at_line_starts(tmp_path):
    """One .txt larger than a unit: several units, each a document of whole lines; no line lost or read twice."""
    lines = [f"line {i} " + "word " * (i % 7) for i in range(3000)]
    path = tmp_path / "big.txt"
    path.write_text("\n".join(lines) + "\n")
    units = list(work_units(source_files(str(path), tmp_path), 8192))
    assert len(units) > 5
    docs = [d for u in units for d in read_unit(u, "text")]
    assert len(docs) == len(units) and docs[1].name.startswith("big.txt:")
    assert [l.strip() for d in docs for l in d.text.splitlines()] == [l.strip() for l in lines]


def test_the_tokenizer_sample_is_bounded_in_characters_as_well_as_lines(tmp_path):
    from corpus.build import scan_unit
    write_text_corpus(tmp_path / "raw", num_docs=4, sentences=240)
    (unit,) = work_units(source_files(str(tmp_path / "raw"), tmp_path), 1 << 30)
    free = scan_unit(unit, str(tmp_path / "free.npy"), "text", 7, 0.2, 10_000)
    bounded = scan_unit(unit, str(tmp_path / "bounded.npy"), "text", 7, 0.2, 10_000, sample_bytes=5_000)
    assert sum(len(t) for *_, t in free["sample"]) > 20_000
    assert 4_000 < sum(len(t) for *_, t in bounded["sample"]) <= 5_000
    assert set(bounded["sample"]) <= set(free["sample"])
    assert np.array_equal(np.load(tmp_path / "free.npy"), np.load(tmp_path / "bounded.npy"))


def test_the_tokenizer_learns_from_sample_lines_of_wide_characters(tmp_path):
    """Sample lines are cut at MAX_PARAGRAPH_CHARS characters; SentencePiece's limit counts bytes: a CJK
    paragraph of 8,192 characters (24,576 bytes) was left out of training, and a corpus of them had nothing."""
    from common.tokenizer import train_tokenizer
    from corpus.build import MAX_PARAGRAPH_CHARS
    rng = np.random.default_rng(0)
    lines = ["".join(chr(0x4E00 + int(c)) for c in rng.integers(0, 40, MAX_PARAGRAPH_CHARS)) for _ in range(12)]
    assert min(len(line.encode()) for line in lines) == 3 * MAX_PARAGRAPH_CHARS > 16384
    tok = Tokenizer(train_tokenizer(lines, 320, tmp_path))
    pieces = {tok.piece(i) for i in range(tok.vocab_size)}
    assert sum(chr(0x4E00 + c) in pieces for c in range(40)) == 40  # each character a piece of its own

def test_parts_present_finds_a_part_a_cache_cleanup_took(tmp_path):
    """What lets `python -m corpus --out s3://...` finish an interrupted upload from the cache's build without
    building again: only while every listed part is there with its size."""
    from corpus.build import parts_present
    write_text_corpus(tmp_path / "raw", num_docs=4)
    config = tiny_config(tmp_path)
    build_corpus(config, config.corpus_dir, **quiet)
    assert parts_present(config.corpus_dir)
    next(config.corpus_dir.glob("train/*.npy")).unlink()
    assert not parts_present(config.corpus_dir)


def _corpus_files_open(corpus_dir) -> tuple[int, int]:
    """(file descriptors, memory maps) of this process on files under `corpus_dir`."""
    root = str(Path(corpus_dir).resolve())

    def target(fd: str) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile (the listing's own, another thread's)
            return ""

    fds = sum(target(fd).startswith(root) for fd in os.listdir("/proc/self/fd"))
    maps = sum(root in line for line in Path("/proc/self/maps").read_text().splitlines())
    return fds, maps


def test_split_rows_keep_a_bounded_number_of_parts_open_and_map_none(built, tmp_path):
    """A split's rows are read by position from at most `open_parts` parts open at a time (1 here), whatever the
    number of parts (memory maps held two files and two maps per part: at 1 TB past the per-process limits),
    from two threads at once (a generator actor's tasks in flight), and are the .npy files' own rows. A part
    that cannot be opened is named and leaves nothing open."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor
    corpus = shutil.copytree(built.corpus_dir, tmp_path / "corpus")  # no other reader of these files
    meta = load_corpus_meta(corpus)["train"]
    reference = []
    for part in meta["parts"]:
        tokens, offsets = (np.load(corpus / part["flat"][k]["path"]) for k in ("tokens", "offsets"))
        reference += [tokens[offsets[j]:offsets[j + 1]] for j in range(part["rows"])]
    assert len(meta["parts"]) >= 2 and len(reference) == meta["rows"]
    rows = SplitRows(corpus, "train", open_parts=1)
    order = np.random.default_rng(0).permutation(len(reference))
    most = [0, 0]

    def read(ids):
        out = []
        for i in ids:
            out.append(rows[int(i)])
            fds, maps = _corpus_files_open(corpus)
            most[:] = max(most[0], fds), max(most[1], maps)
        return out

    with ThreadPoolExecutor(2) as pool:
        halves = list(pool.map(read, (order[::2], order[1::2])))
    got = dict(zip(order[::2], halves[0])) | dict(zip(order[1::2], halves[1]))
    assert all(got[i].dtype == np.int32 and np.array_equal(got[i], reference[i]) for i in range(len(reference)))
    assert most == [2, 0], most  # 1 part's tokens and offsets, of 2 parts read in turn; no map
    rows.close()
    assert _corpus_files_open(corpus) == (0, 0)
    with pytest.raises(IndexError):
        rows[len(reference)]
    fresh = SplitRows(corpus, "train", open_parts=1)
    (corpus / meta["parts"][1]["flat"]["offsets"]["path"]).unlink()  # gone after the sizes were checked
    for _ in range(3):
        with pytest.raises(CorpusError, match=r"part-\d+\.offsets\.npy cannot be opened"):
            fresh[meta["parts"][1]["row_start"]]
    assert _corpus_files_open(corpus) == (0, 0)  # its tokens file, opened first, closed again each time


READ_ALL_ROWS = """
import json, resource, sys
import numpy as np
from common.corpus import SplitRows
corpus, soft, hard = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
rows = SplitRows(corpus, "train")
meta = json.load(open(corpus + "/corpus.json"))["train"]
reference = []
for part in meta["parts"]:
    tokens, offsets = (np.load(corpus + "/" + part["flat"][k]["path"]) for k in ("tokens", "offsets"))
    reference += [tokens[offsets[j]:offsets[j + 1]] for j in range(part["rows"])]
order = np.random.default_rng(0).permutation(len(reference))
same = all(np.array_equal(rows[int(i)], reference[i]) for i in np.concatenate([order, order]))
print(json.dumps({"open_parts": rows.open_parts, "same": same, "soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}))
"""


def test_a_split_of_more_parts_than_its_file_limit_keeps_open_reads_every_row_and_says_so_once(tmp_path,
                                                                                                env_with_repo):
    """20 parts and a file limit of 96 (soft and hard): 12 parts stay open, every row of two random passes is
    right, one note says the limit that would read without reopening. With a hard limit of 1,024 the soft one
    is raised to it and all 20 stay open: no note."""
    from common.corpus import CORPUS_FORMAT
    rng = np.random.default_rng(0)
    parts, start = [], 0
    (tmp_path / "train").mkdir()
    for k in range(20):
        offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 9, 5))]).astype(np.int64)
        paths = {kind: f"train/part-{k:05d}.{kind}.npy" for kind in ("tokens", "offsets")}
        np.save(tmp_path / paths["tokens"], rng.integers(5, 300, offsets[-1]).astype(np.int32))
        np.save(tmp_path / paths["offsets"], offsets)
        flat = {kind: {"path": path, "bytes": (tmp_path / path).stat().st_size} for kind, path in paths.items()}
        parts.append({"row_start": start, "rows": 5, "flat": flat})
        start += 5
    (tmp_path / "corpus.json").write_text(json.dumps({"corpus_format": CORPUS_FORMAT, "max_seq_len": 8,
                                                      "vocab_size": 300, "train": {"parts": parts, "rows": start}}))
    for soft, hard, open_parts, notes in ((96, 96, 12, 1), (96, 1024, 128, 0)):
        result = subprocess.run([sys.executable, "-c", READ_ALL_ROWS, str(tmp_path), str(soft), str(hard)], cwd=ROOT,
                                env=env_with_repo, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads(result.stdout) == {"open_parts": open_parts, "same": True, "soft": hard}
        said = [line for line in result.stderr.splitlines() if line.startswith("note:")]
        assert len(said) == notes, result.stderr
        assert not notes or "has 20 parts in a split, more than the 12 this process keeps open" in said[0] \
            and "(ulimit -Hn) of 160 or more, 96 here" in said[0]


def whole_corpus_rule(hashes: np.ndarray, valid_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The decision made on every hash at once (the driver's way until 2026-11-25): the first of each hash kept,
    held out by hash, the kept document of least hash held out if none is, of greatest trained on if all are."""
    from corpus.build import valid_mask
    keep = np.zeros(len(hashes), dtype=bool)
    keep[np.unique(hashes, return_index=True)[1]] = True
    valid = valid_mask(hashes, valid_fraction)
    kept = np.flatnonzero(keep)
    if not valid[kept].any():
        valid[kept[np.argmin(hashes[kept])]] = True
    if valid[kept].all():
        valid[kept[np.argmax(hashes[kept])]] = False
    return keep, valid


def test_the_decision_a_bucket_at_a_time_is_the_whole_corpus_rule(tmp_path, monkeypatch):
    """`_decide` holds one bucket of hashes at a time (not the corpus: ~10 GB at 1 TB) and gives every unit the
    keep and held-out masks of the rule applied to all hashes at once: 40 units of 0 to 1,500 documents, a
    third of them copies of earlier ones (in the same unit or another), with 1, 2, 64 and 512 buckets, each unit
    read in one chunk or in several (a chunk's copies of another chunk of its unit found as copies across units
    are), at a held-out fraction of 0.2, 0 (the least hash forced out) and 1 (the greatest forced in); the masks
    read back in chunks of other sizes."""
    from types import SimpleNamespace
    from corpus import build
    from corpus.build import UnitMasks, _decide
    monkeypatch.setattr(build, "MAX_BUCKET_BITS", 9)  # 4,096 buckets cost the test 6 s more, no more checks
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 1500, 40)
    counts[[3, 17]] = 0
    hashes = rng.integers(0, 2**64, counts.sum(), dtype=np.uint64)
    copies = rng.random(len(hashes)) < 1 / 3
    for i in np.flatnonzero(copies)[1:]:
        hashes[i] = hashes[rng.integers(0, i)]
    scan = tmp_path / "scan"
    scan.mkdir()
    units = [SimpleNamespace(index=u) for u in range(len(counts))]
    bounds = np.cumsum([0, *counts])
    for u in units:
        np.save(scan / f"unit-{u.index:05d}.npy", hashes[bounds[u.index]:bounds[u.index + 1]])
    for fraction in (0.2, 0.0, 1.0):
        keep, valid = whole_corpus_rule(hashes, fraction)
        # bucket_docs 1: capped at 512 buckets (MAX_BUCKET_BITS)
        for bucket_docs, chunk_docs in ((1 << 22, 1 << 20), (len(hashes) // 2 + 1, 100), (len(hashes) // 64, 7),
                                        (1, 1000)):
            decision = _decide(units, scan, fraction, bucket_docs=bucket_docs, chunk_docs=chunk_docs)
            for u in units:
                a, b = bounds[u.index], bounds[u.index + 1]
                masks = UnitMasks(scan, u.index, decision.starts[u.index], fraction, decision.force, chunk_docs=37)
                got_keep, got_valid = np.array([masks(i) for i in range(b - a)], dtype=bool).reshape(-1, 2).T
                assert masks.count == b - a
                assert np.array_equal(got_keep, keep[a:b]) and np.array_equal(got_valid, valid[a:b])
            assert decision.duplicates == len(hashes) - keep.sum() > 0
            assert sum(decision.held_out) == (keep & valid).sum() and sum(decision.kept) == keep.sum()
            assert sorted(p.name for p in scan.iterdir() if "bucket" in p.name) == []  # nothing left behind
    for u in units[2:]:
        np.save(scan / f"unit-{u.index:05d}.npy", np.zeros(0, np.uint64))
    np.save(scan / "unit-00000.npy", hashes[:1])
    np.save(scan / "unit-00001.npy", hashes[:1])
    with pytest.raises(CorpusError, match="has 1 distinct document"):
        _decide(units, scan, 0.2)
    np.save(scan / "unit-00000.npy", np.zeros(0, np.uint64))
    np.save(scan / "unit-00001.npy", np.zeros(0, np.uint64))
    with pytest.raises(CorpusError, match="holds no text"):
        _decide(units, scan, 0.2)


def test_the_decision_holds_a_bucket_of_the_size_asked_past_256_buckets(tmp_path, monkeypatch):
    """A bucket's pairs are the decision's peak: 256 buckets at most left 4M documents a bucket at 1 TB of 1 KB
    documents, more past it. 2^17 documents in buckets of 64 ask for 2,048 buckets: the largest holds about
    64 (the pairs files' sizes as `_first_of_each` reads them), and the kept and held-out counts are the
    whole-corpus rule's (its masks: the test above); under a file limit of 1,024, 512 buckets."""
    from types import SimpleNamespace
    from corpus import build
    monkeypatch.setattr(build, "file_limit", lambda: 1 << 20)  # whatever this machine's limit
    rng = np.random.default_rng(1)
    hashes = rng.integers(0, 2**64, 1 << 17, dtype=np.uint64)
    hashes[1::5] = hashes[::5][:len(hashes[1::5])]  # copies
    scan = tmp_path / "scan"
    scan.mkdir()
    units = [SimpleNamespace(index=u) for u in range(4)]
    for u in units:
        np.save(scan / f"unit-{u.index:05d}.npy", hashes[u.index << 15:(u.index + 1) << 15])
    sizes, first_of_each = [], build._first_of_each
    monkeypatch.setattr(build, "_first_of_each", lambda path, fraction: (sizes.append(path.stat().st_size // 16),
                                                                         first_of_each(path, fraction))[1])
    decision = build._decide(units, scan, 0.1, bucket_docs=64)
    keep, valid = whole_corpus_rule(hashes, 0.1)
    assert len(sizes) == 2048 and sum(sizes) <= len(hashes) and max(sizes) <= 2 * 64, (len(sizes), max(sizes))
    assert sum(decision.kept) == keep.sum() and sum(decision.held_out) == (keep & valid).sum()
    sizes.clear()
    monkeypatch.setattr(build, "file_limit", lambda: 1024)  # half of it for the buckets' files
    build._decide(units, scan, 0.1, bucket_docs=64)
    assert len(sizes) == 512


def test_the_held_out_split_of_all_documents_at_once_is_the_one_by_one_rule():
    """`valid_mask` (numpy, one pass) holds out exactly the documents `is_valid` does, at the boundary too."""
    import math
    from corpus.build import is_valid, valid_mask
    rng = np.random.default_rng(0)
    for fraction in (0.0, 1e-9, 0.01, 0.05, 1 / 3, 0.5, 0.999, 1.0):
        edge = math.ceil(fraction * 2.0**64)
        near = [h for h in (edge - 2, edge - 1, edge, edge + 1, 0, 2**64 - 1) if 0 <= h < 2**64]
        hashes = np.concatenate([rng.integers(0, 2**64, 5000, dtype=np.uint64, endpoint=False),
                                 np.array(near, dtype=np.uint64)])
        expected = np.array([is_valid(int(h), fraction) for h in hashes])
        assert np.array_equal(valid_mask(hashes, fraction), expected), fraction


def test_a_stray_temporary_in_the_staging_folder_is_not_published(tmp_path, monkeypatch):
    """A worker of a killed build can outlive its driver long enough to leave `.part-N.parquet.tmp-PID` in the
    staging folder the rerun then finishes (seen once in the kill -9 test above): publishing leaves it out."""
    from corpus import build
    staging = tmp_path / ".corpus.staging"
    (staging / "documents").mkdir(parents=True)
    (staging / "documents" / "part-00000.parquet").write_bytes(b"rows")
    (staging / "documents" / ".part-00002.parquet.tmp-4866").write_bytes(b"cut short")
    (staging / "key.json").write_text("{}")
    monkeypatch.setattr(build, "term_counts", lambda folder: None)  # what it reads is not this test's
    build._publish(staging, tmp_path / "corpus")
    assert [p.relative_to(tmp_path / "corpus").as_posix() for p in sorted((tmp_path / "corpus").rglob("*"))] == [
        "documents", "documents/part-00000.parquet"]


def test_damaged_gzip_or_parquet_data_is_an_error_naming_the_file_never_a_bare_library_error(tmp_path):
    """A byte flipped anywhere in a .jsonl.gz's deflate data or a Parquet file's pages: zlib.error and
    pyarrow's ArrowInvalid escaped as tracebacks without the file's name (and through Ray as a task's trace)."""
    import random
    from common.sources import SourceUnreadable
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    texts = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(200)]
    gz, parquet = tmp_path / "c.jsonl.gz", tmp_path / "d.parquet"
    raw_gz = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode(), mtime=0)
    pq.write_table(pa.table({"text": texts}), parquet, compression="zstd")
    raw_parquet = parquet.read_bytes()
    outcomes = []
    for path, raw in ((gz, raw_gz), (parquet, raw_parquet)):
        for offset in range(20, len(raw) - 20, max(1, len(raw) // 60)):
            damaged = bytearray(raw)
            damaged[offset] ^= 0xFF
            path.write_bytes(bytes(damaged))
            try:
                [d for u in work_units(source_files(str(path), tmp_path), unit_bytes=1 << 30) for d in read_unit(u, "text")]
            except (CorpusError, SourceUnreadable) as e:
                assert str(path) in str(e), e
                outcomes.append(str(e))
        path.unlink()
    assert any(f"{gz} is damaged (its gzip data" in o for o in outcomes), outcomes[:5]
    assert any(f"{parquet} is damaged" in o or f"{parquet} cannot be read" in o for o in outcomes), outcomes[-5:]


def test_a_lone_surrogate_in_jsonl_text_becomes_the_replacement_character(tmp_path):
    """JSON's "\\ud83d" alone (half an emoji) has no UTF-8: the tokenizer failed on it, blaming the vocabulary
    size, or a part's packing failed after the whole scan."""
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a cut emoji \\ud83d here"}\n{"text": "a whole one \\ud83d\\ude00 here"}\n')
    docs = [d.text for u in work_units(source_files(str(path), tmp_path), unit_bytes=1 << 30) for d in read_unit(u, "text")]
    assert docs == ["a cut emoji \ufffd here", "a whole one \U0001F600 here"]
    assert all(d.encode("utf-8") for d in docs)


def test_a_long_listing_is_sorted_on_disk_read_again_and_keyed_as_the_whole_list(tmp_path, monkeypatch):
    """Past LISTING_RUN files a listing is sorted in runs on disk and merged (past LISTING_FAN_IN runs, the runs
    so far into one): in the names' order (`a-b.txt` before `a/...` before `a0.txt`: '-' < '/' < '0'), read as
    often as asked, keyed as the JSON of the whole list was (corpora built before stay current), its runs gone
    with it."""
    import gc
    from common import sources
    from corpus.build import build_key, key_blob
    monkeypatch.setattr(sources, "LISTING_RUN", 7)
    monkeypatch.setattr(sources, "LISTING_FAN_IN", 3)
    raw = tmp_path / "raw"
    names = [f"{folder}/doc-{i:02d}.txt" for folder in ("b", "a", "a/deep", "c d") for i in range(12)]
    names += ["a-b.txt", "a0.txt", "a.txt", "z.jsonl"]
    for i, name in enumerate(names):
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        (raw / name).write_text(f"document {i}")
    files = source_files(str(raw), tmp_path)
    assert [f.name for f in files] == sorted(names) and len(files) == len(names) == 52
    assert [f.name for f in files] == sorted(names)  # a second read
    assert len(files.runs) <= 3 and any("merged" in run for run in files.runs)  # 8 runs of 7, merged twice
    assert files.bytes == sum(f.size for f in files)  # summed as listed: cutting and keying need not read it again
    config = tiny_config(tmp_path)
    whole = {**key_blob(config), "files": [[f.name, f.size, f.mtime_ns] for f in files]}
    assert build_key(config, files) == hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()
    folder = Path(files.runs[0]).parent
    del files
    gc.collect()
    assert not folder.exists()


def test_a_source_folder_that_cannot_be_read_is_refused_naming_it(tmp_path, monkeypatch):
    """os.walk left a folder it could not list out of the corpus without a word (its files missing from
    every later stage); the listing stops naming it. (The tests run as root, whom permissions do not stop:
    the system's refusal is made here.)"""
    raw = write_text_corpus(tmp_path / "raw", num_docs=2)
    (raw / "locked").mkdir()
    (raw / "locked" / "doc.txt").write_text("a document nobody may read")
    scandir = os.scandir

    def refusing(path):
        if isinstance(path, (str, os.PathLike)) and Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    with pytest.raises(CorpusError, match=r"corpus source folder .*raw/locked cannot be read: .*Permission denied"):
        source_files(str(raw), tmp_path)


def listing_peaks(folder: str) -> tuple[float, float]:
    """tracemalloc's peak for 4,000 files over 1,000, bounded and with every file held (the test below), in
    a process of its own: tracemalloc counts every thread's allocations, and a thread an earlier test left in
    the test process (a reader finishing its read) once made the control 0.22 instead of ~3.9."""
    import tracemalloc
    from common import sources
    from corpus.build import build_key
    tmp_path = Path(folder)
    config = tiny_config(tmp_path)
    sources.LISTING_FAN_IN = 4  # the runs' read buffers (~10 KB each) outweigh runs of 125
    for n in (1000, 4000):
        folder = tmp_path / f"raw-{n}"
        for i in range(n):
            if i % 250 == 0:
                (folder / f"d{i // 250:02d}").mkdir(parents=True)
            (folder / f"d{i // 250:02d}" / f"doc-{i:05d}.txt").write_text(f"document {i}")

    def peak(n, held=False):
        sources.LISTING_RUN = 1 << 30 if held else 125
        tracemalloc.start()
        try:
            files = source_files(str(tmp_path / f"raw-{n}"), tmp_path)
            build_key(config, files)
            if held:
                (unit,) = work_units(files, 1 << 30)
            else:
                (ref,) = write_units(files, 1 << 30, tmp_path / "units.jsonl")
                unit = ref.load()
            assert len(files) == n == sum(1 for _ in unit.pieces)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    peak(1000)  # once before: a first call's own allocations (caches, imports) are not the listing's
    return peak(4000) / peak(1000), peak(4000, held=True) / peak(1000, held=True)


def test_the_drivers_listing_of_4x_the_files_peaks_at_the_memory_of_1x(tmp_path, env_with_repo):
    """What the corpus driver does with 4,000 small files against 1,000 (`source_files`, `build_key`,
    `write_units`: one unit of them all), and a worker's read of that unit's pieces, runs of 125:
    tracemalloc's peak stays flat. The control, every file and the unit's pieces held (as the driver did:
    4-6 GB for 10M files), rises with the files."""
    result = subprocess.run([sys.executable, "-c", "import json, sys; from tests.test_corpus import listing_peaks; "
                             "print(json.dumps(listing_peaks(sys.argv[1])))", str(tmp_path)], cwd=ROOT,
                            env=env_with_repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    bounded, held = json.loads(result.stdout.splitlines()[-1])
    print(f"driver listing 4x/1x: {bounded:.3f}, every file held {held:.3f}")
    assert bounded <= 1.2 and held >= 2.5, (bounded, held)


def test_listing_folders_of_dead_processes_are_removed(tmp_path, monkeypatch):
    """A killed build leaves its listing's runs in TMPDIR (~150 bytes a source file); the next listing on
    the machine removes those of its processes that are gone, not a living one's, nor another machine's
    (a TMPDIR shared with it: a pid that is no process here may be a live build there)."""
    import socket
    import tempfile
    from common import sources
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here = f"{sources.LISTING_PREFIX}{socket.gethostname()}-"
    dead = tmp_path / "tmp" / f"{here}{gone.stdout.strip()}-abc"
    living = tmp_path / "tmp" / f"{here}{os.getppid()}-def"
    elsewhere = tmp_path / "tmp" / f"{sources.LISTING_PREFIX}other-node-7-{gone.stdout.strip()}-ghi"
    for folder in (dead, living, elsewhere):
        folder.mkdir()
        (folder / "run-000000.jsonl").write_text("[]\n")
    write_text_corpus(tmp_path / "raw", num_docs=2)
    files = source_files(str(tmp_path / "raw"), tmp_path)
    assert not dead.exists() and living.exists() and elsewhere.exists() and len(files) == 2
    assert Path(files.runs[0]).parent.parent == tmp_path / "tmp"


def test_a_source_folder_is_read_through_its_links_and_what_it_leaves_out_is_said(tmp_path):
    """A folder of links into shared storage (rglob did not enter linked folders: those files were left out
    without a word), a link back up the tree read once, and files of other kinds named in the build's note."""
    elsewhere = tmp_path / "shared" / "books"
    write_text_corpus(elsewhere, num_docs=2, seed=3)
    raw = write_text_corpus(tmp_path / "raw", num_docs=3)
    (raw / "linked").symlink_to(elsewhere, target_is_directory=True)
    (raw / "back").symlink_to(raw, target_is_directory=True)
    (raw / "more.jsonl.bz2").write_bytes(b"BZh91AY&SY")
    (raw / "gone.txt").symlink_to(tmp_path / "nothing.txt")
    (raw / "loop.txt").symlink_to(raw / "loop.txt")  # ELOOP where the walk asks what it is
    ignored = LeftOut()
    names = [f.name for f in source_files(str(raw), tmp_path, ignored)]
    assert names == sorted(names) and len(names) == 5 and sum(n.startswith("linked/") for n in names) == 2
    left_out = ["gone.txt (a link to nothing)", "loop.txt (a link to nothing)", "more.jsonl.bz2"]
    assert ignored.count == 3 and ignored.names == left_out
    said = []
    config = tiny_config(tmp_path)
    build_corpus(config, config.corpus_dir, log=said.append)
    assert any("3 file(s) in" in line and f"are left out: {', '.join(left_out)}" in line for line in said), said


def test_one_units_hashes_and_masks_are_written_and_read_a_chunk_at_a_time(tmp_path):
    """One gzip file is one work unit however large: its scan writes the documents' hashes as it reads and a
    pack reads its keep and held-out masks back a chunk at a time, so what either holds is a chunk's, not the
    file's (the whole arrays were 8 bytes a document and more, 8 GB for a file of 1G short documents; the
    whole job: `make bench-scale`, `corpus_documents_rss_4x_vs_1x`). Measured by tracemalloc's peak over 4x the
    documents against 1x, chunks of 2,048 documents; the bytes are those of np.save of the whole array."""
    import tracemalloc
    from types import SimpleNamespace
    from corpus.build import UnitMasks, _decide, scan_unit, valid_mask
    from common.corpus import NpyAppender
    peaks = {}
    for times in (1, 4):
        folder = tmp_path / f"{times}x"
        (folder / "scan").mkdir(parents=True)
        with gzip.open(folder / "docs.jsonl.gz", "wt") as f:
            for i in range(20_000 * times):
                f.write(json.dumps({"text": f"document {i % (7_000 * times)}, a few words long"}) + "\n")
        (unit,) = work_units(source_files(str(folder / "docs.jsonl.gz"), tmp_path), 1 << 30)
        hashes_path = folder / "scan" / "unit-00000.npy"
        tracemalloc.start()
        scan = scan_unit(unit, str(hashes_path), "text", 7, 0.1, 50, chunk_docs=2048)
        scan_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        hashes = np.load(hashes_path)
        assert len(hashes) == scan["documents"] == 20_000 * times
        decision = _decide([SimpleNamespace(index=0)], folder / "scan", 0.1, chunk_docs=2048)
        flags = np.zeros((len(range(0, len(hashes), 3)), 2), bool)
        tracemalloc.start()
        masks = UnitMasks(folder / "scan", 0, 0, 0.1, decision.force, chunk_docs=2048)
        for k, i in enumerate(range(0, len(hashes), 3)):  # a pack's walk through its documents
            flags[k] = masks(i)
        masks_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        keep = np.zeros(len(hashes), bool)
        keep[np.unique(hashes, return_index=True)[1]] = True  # the first of each text: 7,000 x times of them
        assert keep.sum() == 7_000 * times and decision.kept == [7_000 * times]
        assert np.array_equal(flags, np.stack([keep[::3], valid_mask(hashes, 0.1)[::3]], axis=1))
        peaks[times] = (scan_peak, masks_peak)
    assert peaks[4][0] / peaks[1][0] < 1.2, peaks  # before: hashes of every document in memory, 3.5x
    assert peaks[4][1] / peaks[1][1] < 1.2, peaks  # before: the unit's keep, hashes and held-out masks whole
    values = np.arange(5000, dtype=np.uint64) * 7919
    out = NpyAppender(tmp_path / "a.npy", np.uint64)
    for start in range(0, 5000, 1500):
        out.append(values[start:start + 1500])
    out.close()
    buffer = io.BytesIO()
    np.save(buffer, values)
    assert (tmp_path / "a.npy").read_bytes() == buffer.getvalue() and not list(tmp_path.glob(".*tmp*"))


def test_a_ray_worker_that_does_not_see_the_staging_folder_stops_the_pass_with_one_line(tmp_path):
    """On a cluster every node reads and writes the build's staging folder (an object-storage --out stages it in
    the driver's cache): a worker that does not see it says so, naming its node and the folder, at its first
    unit, not with a FileNotFoundError after the whole scan pass."""
    import ray
    from common.parallel import NodeProblem
    from corpus.build import _run_on_ray, scan_unit
    write_text_corpus(tmp_path / "raw", num_docs=3)
    staging = tmp_path / ".corpus.staging"  # as the driver's machine has it; this worker sees no key.json there
    (staging / "scan").mkdir(parents=True)
    units = write_units(source_files(str(tmp_path / "raw"), tmp_path), 1 << 10, staging / "units.jsonl")
    jobs = [(u, (str(staging / "scan" / f"unit-{u.index:05d}.npy"), "text", 7, 0.2, 10)) for u in units]
    results = []
    try:
        with pytest.raises(NodeProblem, match=r"staging folder .*\.corpus\.staging is not there as seen from Ray node "):
            _run_on_ray(scan_unit, jobs, 2, None, "corpus scan", lambda result: None, staging)
        assert not list((staging / "scan").iterdir())  # no unit scanned
        (staging / "key.json").write_text("{}")
        _run_on_ray(scan_unit, jobs, 2, None, "corpus scan", results.append, staging)  # the same Ray, seen now
    finally:
        ray.shutdown()
    assert sorted(r["unit"] for r in results) == [u.index for u in units]


def test_a_file_name_that_is_not_utf8_is_recorded_and_the_source_spelled_either_way_is_current(tmp_path,
                                                                                             monkeypatch):
    """A Latin-1 name (Python keeps its bytes as surrogates) stopped the pack pass with a traceback naming no
    file, and every rerun the same; a source given with a trailing slash, or relative, rebuilt a current corpus."""
    import pyarrow.parquet as pq
    raw = write_text_corpus(tmp_path / "raw", num_docs=4)
    os.rename(raw / "work_03.txt", os.fsencode(raw) + b"/caf\xe9_03.txt")
    config = tiny_config(tmp_path)
    out = build_corpus(config, tmp_path / "corpus", workers=1, log=lambda *_: None)
    names = [n for f in sorted((out / "documents").glob("*.parquet")) for n in pq.read_table(f).column("name").to_pylist()]
    assert "caf\\xe9_03.txt" in names
    monkeypatch.chdir(tmp_path)
    for spelling in (str(raw), f"{raw}/", "raw", "./raw/"):
        assert corpus_is_current(config, out, spelling), spelling
    other = shutil.copytree(raw, tmp_path / "other", copy_function=shutil.copy2)  # the same names, sizes, times
    assert not corpus_is_current(config, out, str(other))
