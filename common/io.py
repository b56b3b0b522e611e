"""Small file helpers: atomic writes and content hashes.

Every file a stage publishes is written to a temporary name in the same folder
and renamed into place, so a crash never leaves a partial file under a final name.
"""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def tmp_path_for(path: Path) -> Path:
    """Temporary sibling of `path`; its name never collides with a final name."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path; on success fsync and rename it to `path`, else delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)
    return Path(path)


def atomic_write_json(path: str | Path, obj) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def remove_stale_tmp(folder: str | Path) -> int:
    """Delete temporaries a killed writer left behind; returns how many."""
    count = 0
    for p in Path(folder).glob(".*.tmp-*"):
        p.unlink(missing_ok=True)
        count += 1
    return count
