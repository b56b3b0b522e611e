"""Reading a packed corpus (built by `python -m corpus`, `corpus/build.py`).

A corpus folder holds, per work unit U of the source (`corpus/build.py`):
    tokenizer.model, tokenizer.json      SentencePiece BPE model and its sha256
    train/part-UUUUU.parquet             CORPUS_SCHEMA rows of the unit's training documents, in order
    train/part-UUUUU.tokens.npy          the same rows flat: int32 tokens and int64 row offsets, for
    train/part-UUUUU.offsets.npy         random access by position (what the generator's actors read)
    valid/part-UUUUU.*                   the same for the held-out documents
    documents/part-UUUUU.parquet         doc_id, name, split and length of every kept document
    train.term_counts.npy                int64 count of every token id in the train split (paper 5.1)
    corpus.json                          counts, and per part: rows, first row, bytes, sha256 (written last)
    resolved_manifest.toml
A split's row i is row i - row_start of the part whose range holds it.
"""
from __future__ import annotations

import bisect
import os
import resource
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from common.io import atomic_path, parse_json, read_json
from common.sources import CorpusError

CORPUS_META = "corpus.json"
REBUILD = "`make corpus` (python -m corpus) builds it again"
TERM_COUNTS_FILE = "train.term_counts.npy"


class SplitRows:
    """Rows of one split: `rows[i]` is row i as an int32 array, read on demand from the part that holds it
    with two positional reads (its two offsets, then its tokens). Nothing grows with the corpus but three
    numbers a part (where its rows start, where its files' values start): a part's files are opened when a
    row of it is first read, and at most `open_parts` parts stay open (the least recently read closed first).
    Memory maps of every part held two file descriptors and two maps per part: at 1 TB (about 15,000 parts a
    split) past Ray's 65,536 files and Linux's 65,530 maps per process. A split of more parts than may stay
    open reads rows of closed parts by opening them again (slower, the more so on a network file system;
    docs/benchmarks.md), said once on stderr. Sizes are checked here; each
    file's header when it is opened. Safe to read from several threads (a generator actor's tasks in flight);
    not picklable (each process opens its own)."""

    def __init__(self, corpus_dir: str | Path, split: str, open_parts: int = 0):
        whole = load_corpus_meta(corpus_dir)
        meta = whole[split]
        # every row read is checked against these: a damaged part is one error naming it, not an allocation of
        # terabytes or an index error in the model's embedding (on a GPU, a device-side assert)
        self.max_len, self.vocab = int(whole["max_seq_len"]), int(whole["vocab_size"])
        self.corpus_dir, self.parts = Path(corpus_dir), meta["parts"]
        for part in self.parts:
            for kind in ("tokens", "offsets"):
                record = part["flat"][kind]
                path = self.corpus_dir / record["path"]
                if not path.is_file() or path.stat().st_size != record["bytes"]:
                    raise CorpusError(f"{path} is missing or has another size than corpus.json says; rebuild the corpus")
        self.row_starts = np.asarray([p["row_start"] for p in self.parts] + [meta["rows"]], dtype=np.int64)
        self._starts = self.row_starts.tolist()  # bisect on a list: a numpy search per row costs more than a read
        self.open_parts, self._by_limit = open_parts or _open_parts_allowed(), not open_parts
        self._open: OrderedDict[int, tuple] = OrderedDict()  # part -> (tokens (fd, start), offsets (fd, start))
        self._data_starts: dict[int, tuple[int, int]] = {}  # part -> where its two files' values start
        self._lock = threading.Lock()
        self._reopens_said = False

    def __len__(self) -> int:
        return int(self.row_starts[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        k = bisect.bisect_right(self._starts, i) - 1
        j = i - self._starts[k]
        with self._lock:  # a part closed by another thread is never read here
            (tokens, t0), (offsets, o0) = self._part(k)
            begin, stop = np.frombuffer(os.pread(offsets, 16, o0 + 8 * j), dtype="<i8")
            if not 0 <= begin <= stop <= begin + self.max_len:
                raise CorpusError(f"{self._path(k, 'offsets')} is damaged: row {j} of it spans tokens {begin}..{stop} "
                                  f"(rows hold at most {self.max_len}); rebuild the corpus")
            row = np.empty(int(stop - begin), dtype=np.int32)
            if os.preadv(tokens, [row], t0 + 4 * int(begin)) != row.nbytes:
                raise CorpusError(f"{self._path(k, 'tokens')} ends before row {j} of it; rebuild the corpus")
        if row.size and int(row.view(np.uint32).max()) >= self.vocab:  # a negative id too, read unsigned
            bad = int(row[(row < 0) | (row >= self.vocab)][0])
            raise CorpusError(f"{self._path(k, 'tokens')} is damaged: row {j} of it holds token id {bad}, outside the "
                              f"vocabulary of {self.vocab}; rebuild the corpus")
        return row

    def _path(self, k: int, kind: str) -> Path:
        return self.corpus_dir / self.parts[k]["flat"][kind]["path"]

    def _part(self, k: int) -> tuple:
        if k in self._open:
            self._open.move_to_end(k)
            return self._open[k]
        while len(self._open) >= self.open_parts:
            for fd, _ in self._open.popitem(last=False)[1]:
                os.close(fd)
            if not self._reopens_said:
                self._reopens_said = True
                remedy = ""
                if self._by_limit:
                    remedy = (f"; a file limit (ulimit -Hn) of {8 * len(self.parts):,} or more, "
                              f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]:,} here, reads without"
                              if 8 * len(self.parts) <= MAX_FILE_LIMIT else
                              "; a corpus built with a larger corpus.unit_mb has fewer parts")
                print(f"note: {self.corpus_dir} has {len(self.parts):,} parts in a split, more than the "
                      f"{self.open_parts:,} this process keeps open: rows of closed parts are read by opening them "
                      f"again, slower{remedy}", file=sys.stderr, flush=True)
        known, fds, starts = self._data_starts.get(k), [], []
        try:
            for n, (kind, dtype, count) in enumerate((("tokens", "<i4", None),
                                                       ("offsets", "<i8", self.parts[k]["rows"] + 1))):
                path = self._path(k, kind)
                try:
                    fds.append(os.open(path, os.O_RDONLY))
                except OSError as e:
                    raise CorpusError(f"{path} cannot be opened ({e.strerror}); rebuild the corpus") from None
                # a header is parsed once: at 1 TB the parts outnumber the open ones, and a part is opened again
                starts.append(known[n] if known else _npy_data_start(path, fds[-1], dtype, count))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._data_starts[k] = tuple(starts)
        self._open[k] = tuple(zip(fds, starts))
        return self._open[k]

    def close(self) -> None:
        with self._lock:
            while self._open:
                for fd, _ in self._open.popitem()[1]:
                    os.close(fd)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass


def npy_header(f) -> tuple[tuple, np.dtype]:
    """The shape and dtype in the header of the .npy file open as `f`, which is left where its values start."""
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(f)
    return shape, dtype


def _npy_data_start(path: Path, fd: int, dtype: str, count: int | None) -> int:
    """Where the values of the 1-d .npy file open as `fd` start, its header checked (dtype; `count` values)."""
    with open(fd, "rb", closefd=False) as f:
        try:
            shape, found = npy_header(f)
        except ValueError as e:
            raise CorpusError(f"{path} is not a .npy file ({e}); rebuild the corpus") from None
        if found != np.dtype(dtype) or len(shape) != 1 or (count is not None and shape[0] != count):
            raise CorpusError(f"{path} holds {shape} values of {found}, corpus.json says "
                              f"{count if count is not None else 'a 1-d array'} of {np.dtype(dtype)}; rebuild the corpus")
        return f.tell()


MAX_FILE_LIMIT = 1 << 20  # the highest soft file limit asked for (Node.js caps its own raise there too)


def _open_parts_allowed() -> int:
    """Parts a split may keep open: an eighth of this process's file limit (two files a part, a generator
    actor's two splits, and room for everything else), the soft limit first raised to the hard one (up to
    Docker's default hard limit, 2^20: 131,072 parts, 8 TB of text at unit_mb 64)."""
    return max(8, file_limit() // 8)


def file_limit() -> int:
    """This process's limit of open files, the soft limit first raised to the hard one (up to
    MAX_FILE_LIMIT)."""
    wanted = MAX_FILE_LIMIT
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = lambda n: n == resource.RLIM_INFINITY
    if not unlimited(soft) and soft < wanted and (unlimited(hard) or soft < hard):
        raised = wanted if unlimited(hard) else min(hard, wanted)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    return wanted if unlimited(soft) else soft


def npy_chunks(path: str | Path, chunk: int = 1 << 22):
    """The 1-d array in an .npy file, `chunk` values at a time, read with plain reads: bounded memory
    whatever the file's size (a memory map would keep every page it touched resident)."""
    with open(path, "rb") as f:
        shape, dtype = npy_header(f)
        remaining = int(np.prod(shape))
        while remaining:
            count = min(chunk, remaining)
            values = np.fromfile(f, dtype=dtype, count=count)
            if len(values) != count:
                raise CorpusError(f"{path} ends before its {int(np.prod(shape))} values; rebuild the corpus")
            remaining -= count
            yield values


class NpyAppender:
    """A 1-d .npy file written as its values come (`npy_chunks` reads it back): values go to a raw temporary as
    they are appended, and `close` publishes, atomically, np.save's header followed by them (the bytes np.save
    writes for the whole array), so a file of any length is written in the memory of one append."""

    def __init__(self, path: str | Path, dtype):
        self.path, self.dtype, self.count = Path(path), np.dtype(dtype), 0
        self.raw_path = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}-raw")  # what remove_stale_tmp takes
        self.raw = open(self.raw_path, "wb")

    def append(self, values) -> None:
        values = np.ascontiguousarray(values, dtype=self.dtype)
        self.raw.write(values.tobytes())
        self.count += len(values)

    def close(self) -> Path:
        import shutil
        self.raw.close()
        try:
            with atomic_path(self.path) as tmp, open(tmp, "wb") as f:
                header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                          "shape": (self.count,)}
                np.lib.format.write_array_header_1_0(f, header)
                with open(self.raw_path, "rb") as data:
                    shutil.copyfileobj(data, f, 1 << 16)
        finally:
            self.raw_path.unlink(missing_ok=True)
        return self.path

    def abort(self) -> None:
        self.raw.close()
        self.raw_path.unlink(missing_ok=True)


def count_terms(token_files, vocab_size: int) -> np.ndarray:
    """Occurrences of every id in the token files, int64 (vocab_size,), read a chunk at a time."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in token_files:
        for values in npy_chunks(path):
            counts += np.bincount(values, minlength=vocab_size)[:vocab_size]
    return counts


def term_counts(corpus_dir: str | Path) -> np.ndarray:
    """Paper section 5.1, term frequency: token counts of the train split, computed once and stored beside
    the corpus (atomically). A stored file is trusted only if it has one count per id and its counts add
    up to the split's tokens."""
    corpus_dir = Path(corpus_dir)
    meta = load_corpus_meta(corpus_dir)
    path = corpus_dir / TERM_COUNTS_FILE
    if (counts := _stored_counts(corpus_dir, meta)) is not None:
        return counts
    counts = count_terms([corpus_dir / p["flat"]["tokens"]["path"] for p in meta["train"]["parts"]], meta["vocab_size"])
    if int(counts.sum()) != meta["train"]["tokens"]:  # ids past the vocabulary were cut off by count_terms
        raise CorpusError(f"{corpus_dir}: train tokens hold ids outside the vocabulary; rebuild the corpus")
    try:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, counts)
    except OSError as e:  # a read-only corpus: use the counts without storing them
        print(f"corpus: could not store {path} ({e}); term counts are recomputed on each use")
    return counts


def _stored_counts(corpus_dir: Path, meta: dict) -> np.ndarray | None:
    """The term counts stored in `corpus_dir`, if they are this corpus's: a count per id, adding up to the
    training split's tokens."""
    path = corpus_dir / TERM_COUNTS_FILE
    if path.is_file():
        counts = np.load(path)
        if counts.shape == (meta["vocab_size"],) and int(counts.sum()) == meta["train"]["tokens"]:
            return counts
    return None


CORPUS_FORMAT = 3  # corpus.json's `corpus_format`: parts per work unit
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")


def local_corpus(corpus_dir, splits: tuple[str, ...] = ("train", "valid")) -> Path:
    """A corpus folder on this machine: `corpus_dir` itself, or for one on object storage a local copy of
    what the stages read at random (corpus.json, the tokenizer, its stored term counts, every part's flat
    tokens and offsets, each checked against corpus.json's size and sha256), downloaded once per machine
    (`common.storage`). `splits`: those whose parts are copied; none for what reads no row (the generator's
    driver, fine-tuning, a tokenizer's ids), in a folder of its own: nothing there grows with the corpus."""
    from common.storage import cache_bookkeeping, cache_folder, is_remote, local_copies, local_copy, location
    remote = location(corpus_dir)
    if not is_remote(remote):
        return Path(corpus_dir)
    local = cache_folder(remote, "corpora" if splits else "corpus-meta")
    if not (remote / CORPUS_META).is_file():
        raise CorpusError(f"no corpus at {remote} ({CORPUS_META} missing): build one with "
                          f"`python -m corpus --out {remote}`")
    text = (remote / CORPUS_META).read_text()
    meta = parse_json(text, remote / CORPUS_META, ("train", "valid"), REBUILD)
    for name in TOKENIZER_FILES:
        if (remote / name).is_file():
            local_copy(remote / name, local / name, (remote / name).stat().st_size)
    from common.hf import TOKENIZER_DIR  # an hf: aux model's tokenizer files (tokenizer.json holds their hash)
    names = set()
    for path in (remote / TOKENIZER_DIR).iterdir():
        local_copy(path, local / TOKENIZER_DIR / path.name, path.stat().st_size)
        names.add(path.name)
    if (local / TOKENIZER_DIR).is_dir():  # a file of a corpus built before at the same prefix: not this one's
        for stale in [p for p in (local / TOKENIZER_DIR).iterdir() if p.is_file() and p.name not in names
                      and not cache_bookkeeping(p.name)]:
            stale.unlink()
    if (remote / TERM_COUNTS_FILE).is_file():  # a count per id: the TF curricula's actors count no row
        local_copy(remote / TERM_COUNTS_FILE, local / TERM_COUNTS_FILE, (remote / TERM_COUNTS_FILE).stat().st_size)
    else:  # none there: a copy's own would hide that (`stored_term_counts` stores them there)
        (local / TERM_COUNTS_FILE).unlink(missing_ok=True)
    records = [record for split in splits for part in meta.get(split, {}).get("parts", [])
               for record in part["flat"].values()]
    local_copies([(remote / r["path"], local / r["path"], r["bytes"], r["sha256"]) for r in records])
    if not (local / CORPUS_META).is_file() or (local / CORPUS_META).read_text() != text:
        with atomic_path(local / CORPUS_META) as tmp:  # last: a copy with corpus.json is whole
            Path(tmp).write_text(text)
    return local


def check_parts(corpus_dir) -> None:
    """Every part file corpus.json lists is there at its size (what the rows are read from): a local folder
    through `SplitRows`'s own check, one on object storage by one listing, nothing downloaded."""
    from common.storage import is_remote, list_files, location
    folder = location(corpus_dir)
    if not is_remote(folder):
        for split in ("train", "valid"):
            SplitRows(folder, split)
        return
    meta, listed = load_corpus_meta(folder), list_files(folder)
    for split in ("train", "valid"):
        for part in meta[split]["parts"]:
            for record in part["flat"].values():
                found = listed.get(record["path"])
                if found is None or found.st_size != record["bytes"]:
                    raise CorpusError(f"{folder / record['path']} is missing or has another size than corpus.json "
                                      f"says; rebuild the corpus")


def stored_term_counts(corpus_dir) -> None:
    """`term_counts` computed once and stored beside the corpus, one on object storage included (there from
    this machine's copy of its rows, then uploaded): each generation actor reads a count per id."""
    from common.storage import is_remote, location
    remote = location(corpus_dir)
    if not is_remote(remote):
        term_counts(remote)
        return
    copy = local_corpus(remote, splits=())
    if _stored_counts(copy, load_corpus_meta(copy)) is not None:
        return
    full = local_corpus(remote)
    term_counts(full)
    (remote / TERM_COUNTS_FILE).upload(full / TERM_COUNTS_FILE)


def load_corpus_meta(corpus_dir) -> dict:
    from common.storage import location
    path = location(corpus_dir) / CORPUS_META
    if not path.is_file():
        raise CorpusError(f"no corpus at {corpus_dir} ({CORPUS_META} missing): run `make corpus` first")
    meta = read_json(path, (), REBUILD)
    if meta.get("corpus_format") != CORPUS_FORMAT:
        raise CorpusError(f"corpus {corpus_dir} was built by an older version (format "
                          f"{meta.get('corpus_format', 2)}, this one reads {CORPUS_FORMAT}); rebuild it with `make corpus`")
    return meta


def load_split(corpus_dir: str | Path, split: str) -> list[np.ndarray]:
    """All rows of one split in a list, for small corpora and tests (the stages use `SplitRows`)."""
    rows = SplitRows(corpus_dir, split)
    return [rows[i] for i in range(len(rows))]
