"""Small file helpers: atomic writes and content hashes.

Every file a stage publishes is written to a temporary name in the same folder
and renamed into place, so a crash never leaves a partial file under a final name;
a folder likewise is built under a temporary sibling and swapped in (`publish_folder`).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from common.storage import cache_root, is_remote, location


# A read that fails with an OSError is tried again before its file is called damaged or the stage stops: on
# object storage or a shared filesystem a timeout or a server's failover fails one read, and damage would stop
# every rank of a job (or, for a checkpoint, send a resume to an older one)
READ_TRIES, READ_BACKOFF_S = 4, 0.5


def retried(read, what: str, stage: str):
    """`read()`, tried up to READ_TRIES times in all where it fails with an OSError (what pyarrow and torch.load
    raise for I/O, a network's or a file server's included), with doubling pauses (0.5, 1, 2 s), each failure said
    on stderr as `stage`'s; the last one raised. Other errors (a wrong schema, bytes that are no Parquet) at once."""
    for attempt in range(READ_TRIES):
        try:
            return read()
        except OSError as e:
            if attempt == READ_TRIES - 1:
                raise
            pause = READ_BACKOFF_S * 2**attempt
            print(f"{stage}: reading {what} failed ({type(e).__name__}: {str(e)[:200]}); trying again in {pause:g} s",
                  file=sys.stderr, flush=True)
            time.sleep(pause)


def sha256_file(path, chunk: int = 1 << 20) -> str:
    """sha256 of a local file or an object (`common.storage.ObjectPath`, streamed)."""
    digest = hashlib.sha256()
    with (path.fs.open_input_stream(path.key) if is_remote(path) else open(path, "rb")) as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class DamagedFile(ValueError):
    """A JSON file a stage wrote that does not read back: cut short, edited, or another program's."""


class DiskFull(OSError):
    """A write that ran out of space (or quota), naming the file it was writing and the space left there."""

    def __init__(self, code: int, message: str):
        super().__init__(code, message)

    def __str__(self) -> str:
        return self.strerror


def _out_of_space(error: BaseException, folder: Path) -> bool:
    """Whether `error`, raised while writing into `folder`, is the file system's being full: an OSError
    saying so anywhere in its chain, or another writer's error (torch.save's "unexpected pos") with less
    than 1 MiB left."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return isinstance(error, (OSError, RuntimeError)) and shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def disk_full(error: BaseException, path, folder: Path) -> DiskFull | None:
    """The DiskFull error to raise instead of `error` (raised writing `path` into `folder`), or None."""
    if isinstance(error, DiskFull) or not _out_of_space(error, folder):
        return None
    try:
        free = f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free there now"
    except OSError:
        free = "free space unknown"
    return DiskFull(errno.ENOSPC, f"no space left writing {path} ({free}); what was written before is kept: "
                                  f"make room and run the command again (a trainer with --resume) to go on")


def read_json(path, required: tuple[str, ...] = (), remedy: str = "") -> dict:
    """The JSON object in `path` (a folder path or an object), with the keys in `required`; anything else is
    a `DamagedFile` error that names the file, what is wrong with it and `remedy` (how to make it again)."""
    return parse_json(path.read_text(), path, required, remedy)


def parse_json(text: str, path, required: tuple[str, ...] = (), remedy: str = "") -> dict:
    """`read_json` of text already read from `path`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DamagedFile(f"{path} is damaged (not JSON: {e}){remedy and '; ' + remedy}") from None
    if not isinstance(value, dict):
        raise DamagedFile(f"{path} is damaged (a JSON {type(value).__name__}, not an object){remedy and '; ' + remedy}")
    missing = [k for k in required if k not in value]
    if missing:
        raise DamagedFile(f"{path} is damaged or not this project's (no {', '.join(missing)}){remedy and '; ' + remedy}")
    return value


def tmp_path_for(path: Path) -> Path:
    """Temporary sibling of `path`; its name never collides with a final name, nor with another writer's
    temporary of the same path: two threads of one process (a shard run again beside its straggling copy),
    two hosts whose processes have one pid (containers on a shared file system)."""
    return path.with_name(f".{path.name}.tmp-{_host()}-{os.getpid()}-{threading.get_ident()}")


_SWEPT: set = set()  # upload folders this process has already rid of dead writers' temporaries


@contextmanager
def atomic_path(path):
    """Yield a temporary path; on success fsync and rename it to `path`, else delete it. For an object
    (`common.storage.ObjectPath`) the temporary file is local and is uploaded to the key in one put."""
    if is_remote(path):
        tmp = cache_root() / "uploads" / f"{path.name}.tmp-{_host()}-{os.getpid()}-{threading.get_ident()}"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        if tmp.parent not in _SWEPT:  # once per process, not at every shard's upload
            remove_dead_uploads(tmp.parent)
            _SWEPT.add(tmp.parent)
        try:
            yield tmp
            path.upload(tmp)
        except Exception as e:
            if (full := disk_full(e, tmp, tmp.parent)) is not None:  # this machine's cache, not the bucket
                raise full from e
            raise
        finally:
            tmp.unlink(missing_ok=True)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path_for(path)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename itself, through a power loss
    except Exception as e:  # measured before the temporary goes: a full disk frees its bytes
        if (full := disk_full(e, path, path.parent)) is not None:
            raise full from e
        raise
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path, text: str):
    if is_remote(path):
        path.write_text(text)  # one put: atomic
        return path
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)
    return Path(path)


UPLOAD_LOG = ".uploaded.jsonl"


def upload_folder(local: Path, remote, last: str) -> tuple[int, int]:
    """Put every file under `local` (relative names kept) under `remote`, `last` (the index a reader opens
    first) after all the others. Each put is recorded in `local/.uploaded.jsonl` with the local file's size
    and time: after an interrupted upload a rerun skips a file recorded so whose object is still there with
    its size. Returns (files put, files skipped)."""
    from common.storage import list_files
    files = sorted(p for p in local.rglob("*") if p.is_file() and not p.name.startswith("."))
    recorded = read_records(local / UPLOAD_LOG, "name")
    there = list_files(remote) if recorded else {}
    put = skipped = 0
    for path in [p for p in files if p.name != last] + [p for p in files if p.name == last]:
        name, stamp = path.relative_to(local).as_posix(), file_stamp(path)
        present = there.get(name)
        if recorded.get(name, {}).get("local") == stamp and present and present.st_size == stamp[0]:
            skipped += 1
            continue
        (remote / name).upload(path)
        append_record(local / UPLOAD_LOG, {"name": name, "local": stamp})
        put += 1
    return put, skipped


def record_objects(path):
    """Where a progress log on object storage keeps its records: one object per record under `NAME.d/`
    (objects cannot be appended to)."""
    return path.with_name(path.name + ".d")


def append_record(path, record: dict, key: str | None = None) -> None:
    """Append one JSON line to a progress file and make it durable (a killed job's work is not lost). On
    object storage: the record is put as an object of its own, named by `record[key]`."""
    line = json.dumps(record, sort_keys=True) + "\n"
    if is_remote(path):
        (record_objects(path) / f"{record[key]}.json").write_text(line)
        return
    data = line.encode()
    try:
        _append(path, data)
    except OSError as e:
        if (full := disk_full(e, path, Path(path).parent)) is not None:
            raise full from e
        raise


def _append(path, data: bytes) -> None:
    with open(path, "a+b") as f:
        if f.seek(0, os.SEEK_END):  # a line torn by a kill or a full disk ends here first: the record its own line
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                data = b"\n" + data
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_records(path, key: str) -> dict:
    """The records of a progress file by `record[key]`, the last one winning; a torn line (a kill or a full
    disk mid-write, the last one or, after a rerun appended past it, any) is ignored."""
    records = {}
    if is_remote(path):
        import pyarrow.fs as pafs
        folder = record_objects(path)
        infos = folder.fs.get_file_info(pafs.FileSelector(folder.key, allow_not_found=True, recursive=True))
        names = [i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".json")]
        with ThreadPoolExecutor(max_workers=16) as pool:
            lines = list(pool.map(lambda key_: location(f"{folder.scheme}://{key_}").read_text(), names))
    else:
        lines = Path(path).read_text(errors="replace").splitlines() if Path(path).is_file() else []
    for record in parse_jsonl(lines):
        if key in record:
            records[record[key]] = record
    return records


def parse_jsonl(lines) -> list[dict]:
    """The JSON objects among `lines` (of a progress log or metrics.jsonl), a line torn by a kill or a full
    disk, or anything but an object, left out."""
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def file_stamp(path) -> list[int]:
    """What a finished file is trusted by without reading it again: its size and modification time (ns),
    local or an object (common.storage)."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def read_record(path, key: str, value: str) -> dict | None:
    """One record of a progress log (`append_record`) by its key, or None; a local log is read whole."""
    if is_remote(path):
        try:
            return json.loads((record_objects(path) / f"{value}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # not written yet; any other error is the storage's
            return None
    return read_records(path, key).get(value)


def atomic_write_json(path: str | Path, obj) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


def remove_stale_tmp(folder) -> int:
    """Delete temporaries a killed writer left behind; returns how many (none on object storage: an object
    is written in one put, never under a temporary key)."""
    if is_remote(folder):
        return 0
    count = 0
    for p in Path(folder).glob(".*.tmp-*"):
        p.unlink(missing_ok=True)
        count += 1
    return count


def _host() -> str:
    import socket
    return socket.gethostname()


def remove_dead_uploads(folder: Path) -> None:
    """The upload temporaries (`NAME.tmp-HOST-PID-THREAD`) of this host's writers no longer running: a process
    killed mid-upload leaves its file, as large as a shard, in the cache every other process shares (other
    hosts', on a shared home folder, are theirs to judge)."""
    host = _host()
    for p in folder.glob(f"*.tmp-{host}-*"):
        owner, pid, _ = p.name.rsplit("-", 2)
        if owner.endswith(f".tmp-{host}") and pid.isdigit() and not _alive(int(pid)):
            p.unlink(missing_ok=True)


def publish_folder(staging: str | Path, out: str | Path) -> None:
    """Rename the finished folder `staging` to `out` (a sibling: the same file system). An existing `out` is
    moved aside first and removed only once the new one is in place; if that rename fails, it is put back.
    The caller holds `out`'s FolderLock (the aside name, `.NAME.old`, is the same for every writer)."""
    staging, out = Path(staging), Path(out)
    for folder, _, names in os.walk(staging):  # every byte on disk before the name says the folder is complete
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(folder))
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
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def fsync_dir(folder: Path) -> None:
    """Make a folder's entries (a rename into it) durable; where a folder cannot be opened, nothing."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # a file system that does not sync folders
    finally:
        os.close(fd)


class FolderLocked(RuntimeError):
    """The folder cannot be taken for writing: another live process is writing it, or a file stands where
    it or a folder above it should be."""


def require_folder(folder: str | Path) -> None:
    """Raise FolderLocked where `folder`, or a folder above it, is a file: one line naming it before any
    work, not an OS error at the first write into it."""
    folder = Path(os.path.abspath(folder))
    blocking = next((p for p in [folder, *folder.parents] if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise FolderLocked(f"cannot write {folder}: {blocking} is a file, not a folder")


class FolderLock:
    """One writer per folder: a `.NAME.lock` file beside it holding the owner's pid, host and command.
    A second writer stops with a message naming the owner; the lock of a process that is no longer
    running on this host is taken over (a killed writer cannot release it)."""

    def __init__(self, folder, what: str):
        self.folder, self.what = location(folder), what
        if is_remote(self.folder):  # object storage has no exclusive create: the lock guards this machine's writers
            from common.storage import cache_folder
            cached = cache_folder(self.folder, "locks")
            self.path = cached.with_name(cached.name + ".lock")  # not with_suffix: a dot in the name would be cut
        else:  # the lock beside the folder's absolute path: `--out .` names a folder too
            target = Path(os.path.abspath(self.folder))
            if not target.name:
                raise FolderLocked(f"cannot write {self.folder}: a stage writes a folder of its own, not the root")
            self.path = target.with_name(f".{target.name}.lock")

    def _owner(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def acquire(self) -> "FolderLock":
        import time
        host = _host()
        if not is_remote(self.folder):
            require_folder(self.folder)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            require_folder(self.path.parent)
            raise
        for _ in range(50):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if not owner:  # being written this instant, or torn by a kill: removed once it has stayed empty
                    time.sleep(0.05)
                    with self._taking_over():
                        if not self._owner() and time.time() - _mtime(self.path, time.time()) > TORN_LOCK_S:
                            self.path.unlink(missing_ok=True)
                    continue
                if owner.get("host") == host and (owner.get("pid") == os.getpid() or not owner_running(owner)):
                    with self._taking_over():
                        if self._owner() != owner:  # another process took it over first: judge its lock anew
                            continue
                        if owner.get("pid") != os.getpid():
                            print(f"{self.what}: taking over the lock of process {owner.get('pid')} "
                                  f"({owner.get('what')}), which is no longer running")
                        self.path.unlink(missing_ok=True)
                    continue
                elsewhere = "" if owner.get("host") == host else (
                    f"; if it no longer runs there (a machine that went down), delete {self.path}")
                raise FolderLocked(f"{self.folder} is being written by {owner.get('what')} (pid {owner.get('pid')} on "
                                   f"{owner.get('host')}, since {owner.get('since')}); wait for it or stop it "
                                   f"(its lock: {self.path}){elsewhere}") from None
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "started": _started(os.getpid()), "host": host, "what": self.what,
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
            return self
        raise FolderLocked(f"could not take the lock {self.path}")

    @contextmanager
    def _taking_over(self):
        """Held while a stale lock is judged and removed: two processes that both found the same dead owner
        removed in turn its lock and then the lock the first had just made for itself, and both went on as
        the folder's one writer. An flock (released by the kernel when its holder dies; over NFS, a lock the
        server keeps) on a file beside the lock, made the first time it is needed and left there."""
        import fcntl
        with open(self.path.with_name(self.path.name + ".takeover"), "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX)
            except OSError:  # a file system without flock (Lustre mounted without it, some FUSE): unguarded
                yield
                return
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def release(self) -> None:
        if self._owner().get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


TORN_LOCK_S = 1.0  # an empty lock file older than this was torn by a kill, not being written this instant


def _mtime(path: Path, default: float) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return default


def _started(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat), or None where that is unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def owner_running(owner: dict) -> bool:
    """Whether the process a lock names still runs on this host: its pid, and the start time the lock
    recorded (a pid used again by another process, as in a restarted container, is not the owner)."""
    pid = owner.get("pid", 0)
    if not _alive(pid):
        return False
    recorded, now = owner.get("started"), _started(pid)
    return recorded is None or now is None or recorded == now


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0
