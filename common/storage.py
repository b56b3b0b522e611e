"""Where the stages' data lives: a local folder, or object storage (`s3://bucket/prefix`, and whatever else
`pyarrow.fs` resolves from a URI: `gs://`, `hdfs://`, `abfs://`).

`location(value)` turns a folder or file argument into a `pathlib.Path` (local: the default, unchanged) or an
`ObjectPath`, which answers the few questions the stages ask of a path (`/`, `is_file`, `stat`, `read_text`,
`iterdir`, ...) through `pyarrow.fs`. Credentials, region and endpoint come from the client's usual sources
(`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`, `~/.aws/credentials`, instance roles), never from a manifest.

What object storage cannot do, and what stands in for it (docs/design.md, object storage):
- no rename: a file is written locally, then put under its final key in one upload; an object appears whole
  or not at all (a PUT, or a multipart upload's completion, is atomic), so a killed upload leaves nothing
  under the key;
- no append: a progress log is one small object per record (`common.io.append_record`);
- no memory map: inputs read at random (the corpus's flat token files, the aux model) are copied once per
  machine into a local cache, checked against their recorded size and sha256 (`local_copy`);
- Parquet shards are read in place: a footer, then only the column chunks a rank needs (ranged GETs).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

# Test hook: upload at most this many bytes per second (a kill -9 then lands mid-upload).
UPLOAD_RATE_ENV = "FAST_ELECTRA_TEST_UPLOAD_BYTES_PER_S"
CACHE_ENV = "FAST_ELECTRA_CACHE"
_FILESYSTEMS: dict[tuple[str, str], object] = {}


def location(value: "str | os.PathLike") -> "Path | ObjectPath":
    """A local path (`file://` stripped) or an `ObjectPath` for a URI with another scheme."""
    if isinstance(value, (Path, ObjectPath)):
        return value
    text = str(value)
    if "://" in text and not text.startswith("file://"):
        return ObjectPath(text)
    return Path(text.removeprefix("file://"))


def is_remote(path) -> bool:
    return isinstance(path, ObjectPath)


def _filesystem(scheme: str, bucket: str):
    """One client per bucket and process (a Ray actor or a rank builds its own: clients are not pickled)."""
    if (scheme, bucket) not in _FILESYSTEMS:
        import pyarrow.fs as pafs
        _FILESYSTEMS[(scheme, bucket)] = pafs.FileSystem.from_uri(f"{scheme}://{bucket}")[0]
    return _FILESYSTEMS[(scheme, bucket)]


class ObjectPath:
    """A key (or a prefix, for a folder) in a bucket, as a small subset of pathlib.Path. Only its URI is
    held, so it pickles to Ray actors and torchrun ranks as a string would."""

    def __init__(self, uri: str):
        scheme, _, rest = uri.partition("://")
        rest = rest.strip("/")
        if not scheme or not rest:
            raise ValueError(f"not an object storage URI: {uri!r} (expected scheme://bucket/prefix)")
        self.scheme, self.key = scheme, str(PurePosixPath(rest))

    # naming
    def __str__(self) -> str:
        return f"{self.scheme}://{self.key}"

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectPath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, part) -> "ObjectPath":
        return ObjectPath(f"{self}/{part}")

    @property
    def name(self) -> str:
        return PurePosixPath(self.key).name

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(f"{self.scheme}://{PurePosixPath(self.key).parent}")

    def with_name(self, name: str) -> "ObjectPath":
        return self.parent / name

    def resolve(self) -> "ObjectPath":
        return self

    def relative_to(self, other: "ObjectPath") -> PurePosixPath:
        return PurePosixPath(self.key).relative_to(other.key)

    # questions
    @property
    def fs(self):
        return _filesystem(self.scheme, self.key.split("/", 1)[0])

    def _info(self):
        return self.fs.get_file_info(self.key)

    def is_file(self) -> bool:
        import pyarrow.fs as pafs
        return self._info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        import pyarrow.fs as pafs
        return self._info().type == pafs.FileType.Directory

    def exists(self) -> bool:
        import pyarrow.fs as pafs
        return self._info().type != pafs.FileType.NotFound

    def stat(self) -> SimpleNamespace:
        info = self._info()
        if info.size is None:
            raise FileNotFoundError(str(self))
        return SimpleNamespace(st_size=info.size, st_mtime_ns=info.mtime_ns or 0)

    def iterdir(self):
        import pyarrow.fs as pafs
        selector = pafs.FileSelector(self.key, allow_not_found=True, recursive=False)
        for info in self.fs.get_file_info(selector):
            yield ObjectPath(f"{self.scheme}://{info.path}")

    def glob(self, pattern: str):
        import fnmatch
        return (p for p in self.iterdir() if fnmatch.fnmatch(p.name, pattern))

    # reading
    def open_input(self):
        """A random-access file: each read is a ranged GET."""
        return self.fs.open_input_file(self.key)

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.key) as f:
            return f.read()

    def read_text(self) -> str:
        return self.read_bytes().decode()

    # writing: one upload per object (atomic), never a partial object under the key
    def _put(self, fill) -> None:
        """Write the object through `fill(stream)`. Closing a stream commits what it holds (an S3 upload
        completes; so would its destructor, and Arrow offers no abort): if `fill` fails or is interrupted,
        the object it began is deleted. A kill -9 commits nothing."""
        out = self.fs.open_output_stream(self.key)
        try:
            fill(out)
        except BaseException:
            try:
                out.close()
                self.fs.delete_file(self.key)
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise
        out.close()

    def write_bytes(self, data: bytes) -> int:
        self._put(lambda out: out.write(data))
        return len(data)

    def write_text(self, text: str) -> int:
        return self.write_bytes(text.encode())

    def upload(self, local: str | Path) -> None:
        """Put the local file `local` under this key. The object exists only once the upload completes."""
        rate = float(os.environ.get(UPLOAD_RATE_ENV, "0"))

        def fill(out) -> None:
            while block := src.read(1 << 16 if rate else 8 << 20):
                out.write(block)
                if rate:
                    time.sleep(len(block) / rate)
        with open(local, "rb") as src:
            self._put(fill)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Object storage has no folders: a key's prefix exists once an object is under it."""

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok and not self.exists():
            return
        self.fs.delete_file(self.key)

    def rmtree(self) -> None:
        """Every object under this prefix."""
        self.fs.delete_dir_contents(self.key, missing_dir_ok=True)


def list_files(folder: "ObjectPath") -> dict[str, SimpleNamespace]:
    """Every object under a prefix, by its path relative to the prefix, with `st_size` and `st_mtime_ns`: one
    listing (a request per 1,000 objects) instead of a request per object."""
    import pyarrow.fs as pafs
    infos = folder.fs.get_file_info(pafs.FileSelector(folder.key, allow_not_found=True, recursive=True))
    return {i.path[len(folder.key) + 1:]: SimpleNamespace(st_size=i.size, st_mtime_ns=i.mtime_ns or 0)
            for i in infos if i.type == pafs.FileType.File}


def read_range(path: "Path | ObjectPath"):
    """A file for random reads (what Parquet readers take): local, or ranged GETs on object storage."""
    return path.open_input() if is_remote(path) else open(path, "rb")


def rmtree(path: "Path | ObjectPath") -> None:
    if is_remote(path):
        path.rmtree()
    else:
        shutil.rmtree(path)


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fast-electra")


def cache_folder(remote: "ObjectPath", what: str) -> Path:
    """This machine's local folder for `remote`'s files (one per URI)."""
    digest = hashlib.sha256(str(remote).encode()).hexdigest()[:16]
    return cache_root() / what / f"{remote.name}-{digest}"


def cache_bookkeeping(name: str) -> bool:
    """A file `local_copy` keeps beside a copy (NAME.stamp, NAME.lock) or that a download cut short left (a
    hidden temporary): not part of what was copied."""
    return name.endswith((".stamp", ".lock")) or name.startswith(".")


def local_copy(remote: "ObjectPath", local: Path, size: int, sha256: str | None = None,
               wait: bool = True) -> Path | None:
    """`local`, holding `remote`'s bytes: downloaded (to a temporary name, then renamed) and checked against
    `size` and `sha256`, then reused while a stamp beside it (`NAME.stamp`: the sha256 it was checked against,
    or without one the object's modification time, and the local file's size and time) still holds. With
    `wait` false, None at once where another process of this machine is downloading it."""
    from common.io import atomic_write_text
    stamp_path = local.with_name(local.name + ".stamp")
    source = sha256 or f"object modified {remote.stat().st_mtime_ns}"  # small files without a recorded sha256

    def stamp() -> str:
        return json.dumps([source, local.stat().st_size, local.stat().st_mtime_ns])

    local.parent.mkdir(parents=True, exist_ok=True)
    # One process of this machine downloads, the others wait for it and reuse its copy: a node's Ray actors
    # start together, and each fetched the whole corpus to a temporary of its own (8 GPUs: 8x the traffic
    # and the disk). The kernel releases the lock with its holder, a killed one included.
    with open(local.with_name(local.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return None
        if local.is_file() and stamp_path.is_file() and stamp_path.read_text() == stamp() \
                and local.stat().st_size == size:
            return local
        _download(remote, local, size, sha256)
        atomic_write_text(stamp_path, stamp())
    return local


def local_copies(items: list[tuple]) -> None:
    """`local_copy` of each (remote, local, size, sha256): first those no other process of this machine is
    downloading, then the rest, waiting for them. A node's actors start together and ask for the same corpus
    in the same order: each waited on the one process downloading the first part, then the next, so a node
    fetched its copy one object at a time (a 1 TB corpus, 1-2 hours at one stream's speed); now they fetch
    different parts at once."""
    busy = [item for item in items if local_copy(*item, wait=False) is None]
    for item in busy:
        local_copy(*item)


def _download(remote: "ObjectPath", local: Path, size: int, sha256: str | None) -> None:
    from common.io import atomic_path, sha256_file
    with atomic_path(local) as tmp:
        with remote.fs.open_input_stream(remote.key) as src, open(tmp, "wb") as out:
            while block := src.read(8 << 20):
                out.write(block)
        got = Path(tmp).stat().st_size
        if got != size or (sha256 and sha256_file(tmp) != sha256):
            raise OSError(f"{remote}: downloaded {got} bytes whose size or sha256 differ from its record "
                          f"({size} bytes); the object was replaced or damaged")
