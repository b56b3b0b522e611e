"""Small file helpers: atomic writes and content hashes.

Every file a stage publishes is written to a temporary name in the same folder
and renamed into place, so a crash never leaves a partial file under a final name;
a folder likewise is built under a temporary sibling and swapped in (`publish_folder`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
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


def append_record(path: str | Path, record: dict) -> None:
    """Append one JSON line to a progress file and make it durable (a killed job's work is not lost)."""
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: str | Path, key: str) -> dict:
    """The records of a progress file by `record[key]`, the last one winning; a torn last line (a kill
    mid-write) is ignored."""
    records = {}
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            records[record[key]] = record
    return records


def atomic_write_json(path: str | Path, obj) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def remove_stale_tmp(folder: str | Path) -> int:
    """Delete temporaries a killed writer left behind; returns how many."""
    count = 0
    for p in Path(folder).glob(".*.tmp-*"):
        p.unlink(missing_ok=True)
        count += 1
    return count


def publish_folder(staging: str | Path, out: str | Path) -> None:
    """Rename the finished folder `staging` to `out` (a sibling: the same file system). An existing `out` is
    moved aside first and removed only once the new one is in place; if that rename fails, it is put back.
    The caller holds `out`'s FolderLock (the aside name, `.NAME.old`, is the same for every writer)."""
    staging, out = Path(staging), Path(out)
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)  # left by a swap that was killed
    if out.exists():
        out.rename(old)
    try:
        staging.rename(out)
    except BaseException:
        if old.exists() and not out.exists():
            old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


class FolderLocked(RuntimeError):
    """Another live process is writing the folder."""


class FolderLock:
    """One writer per folder: a `.NAME.lock` file beside it holding the owner's pid, host and command.
    A second writer stops with a message naming the owner; the lock of a process that is no longer
    running on this host is taken over (a killed writer cannot release it)."""

    def __init__(self, folder: str | Path, what: str):
        self.folder, self.what = Path(folder), what
        self.path = self.folder.with_name(f".{self.folder.name}.lock")

    def _owner(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def acquire(self) -> "FolderLock":
        import socket
        import time
        host = socket.gethostname()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(50):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if not owner:  # being written this instant, or torn by a kill
                    time.sleep(0.05)
                    if not self._owner() and self.path.exists():
                        self.path.unlink(missing_ok=True)
                    continue
                if owner.get("host") == host and (owner.get("pid") == os.getpid() or not _alive(owner.get("pid", 0))):
                    if owner.get("pid") != os.getpid():
                        print(f"{self.what}: taking over the lock of process {owner.get('pid')} ({owner.get('what')}), "
                              f"which is no longer running")
                    self.path.unlink(missing_ok=True)
                    continue
                raise FolderLocked(f"{self.folder} is being written by {owner.get('what')} (pid {owner.get('pid')} on "
                                   f"{owner.get('host')}, since {owner.get('since')}); wait for it or stop it "
                                   f"(its lock: {self.path})") from None
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": host, "what": self.what,
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
            return self
        raise FolderLocked(f"could not take the lock {self.path}")

    def release(self) -> None:
        if self._owner().get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0
