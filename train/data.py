"""Reading the generator's shards in manifest order (docs/design.md, trainer contract).

Global batch b at step s is rows [s*b, (s+1)*b) of the stream; rank r of W takes
its contiguous slice, and reads, decompresses and checks only the Parquet row groups
that hold it. Every shard's size is checked against the manifest at start; every page
it reads against its CRC32 (written by the generator), with the row count and stream
positions of each row group, before a row of it is used.
"""
from __future__ import annotations

import bisect
import dataclasses
import io
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from common.batching import attention_mask, pad_rows
from common.checkpoint import IncompatibleInputs, check_sizes
from common.config import RunConfig, config_to_dict, generation_settings
from common.corpus import CORPUS_META, REBUILD
from common.io import FolderLock, _alive, owner_running, read_json, read_record, retried, sha256_file
from common.shards import (FORMAT_VERSION, MANIFEST_FILE, PLAN_FILE, PROGRESS_FILE, SHARD_SCHEMA, data_fingerprint,
                           list_column, open_parquet, stream_fingerprint)
from common.storage import is_remote, list_files, location


REGENERATE = "`make generate-epochs` (python -m generate) on this folder checks its shards and writes it again"


class DataError(ValueError):
    """The shards are missing, damaged, or do not fit the trainer's config."""


def replaced_rate(manifest: dict) -> float:  # bench/train.py and experiments/ablate_tiny.py
    """Fraction of training tokens labelled replaced, from the manifest's per-epoch counts."""
    replaced = sum(e["replaced_fraction"] * e["masked_positions"] for e in manifest["epochs"])
    tokens = sum(e["tokens"] for e in manifest["epochs"])
    return min(max(replaced / max(tokens, 1), 1e-4), 1 - 1e-4)


def load_data_manifest(data_dir, config: RunConfig) -> tuple[dict, str]:
    """Read manifest.json, check it against the config; returns (manifest, its data fingerprint)."""
    path = location(data_dir) / MANIFEST_FILE
    if not path.is_file():
        raise DataError(f"{path} does not exist: generate the folder (`make generate-epochs DATA={data_dir}`, or "
                        f"`python -m generate --out {data_dir}`; an unfinished generation has no manifest)")
    manifest = read_json(path, ("vocab_size", "max_seq_len", "schema", "epochs", "valid"), REGENERATE)
    if problem := shard_entries_problem(manifest):
        raise DataError(f"{path}: {problem}; {REGENERATE}")
    check_data(manifest, data_dir, config)
    return manifest, data_fingerprint(manifest)


def shard_entries_problem(manifest: dict) -> str | None:
    """What is wrong with a manifest's lists of shards (each a path, a row count, its bytes and sha256), if
    anything: the first entry that is not one (a hand-edited or foreign manifest)."""
    epochs = manifest["epochs"] if isinstance(manifest["epochs"], list) else None
    if epochs is None or not all(isinstance(e, dict) and isinstance(e.get("shards"), list) for e in epochs):
        return "'epochs' is not a list of epochs, each with its list of shards"
    if not isinstance(manifest["valid"], dict) or not isinstance(manifest["valid"].get("shards"), list):
        return "'valid' has no list of shards"
    places = [(f"epoch {k}", e["shards"]) for k, e in enumerate(epochs)] + [("valid", manifest["valid"]["shards"])]
    for where, shards in places:
        for i, entry in enumerate(shards):
            wrong = [] if isinstance(entry, dict) else ["is no object"]
            if not wrong:
                wrong = [f"'{key}' {entry.get(key)!r}" for key, kind in
                         (("path", str), ("rows", int), ("bytes", int), ("sha256", str))
                         if not isinstance(entry.get(key), kind) or isinstance(entry.get(key), bool)]
                if isinstance(entry.get("rows"), int) and entry["rows"] < 0:
                    wrong.append(f"'rows' {entry['rows']}")
            if wrong:
                return f"shard {i} of {where}: {', '.join(wrong)}"
    return None


def check_data(manifest: dict, data_dir, config: RunConfig) -> None:
    """The data (a manifest, or the plan of a folder being generated) fits the trainer's config."""
    check_sizes(f"shards in {data_dir} have", manifest["vocab_size"], manifest["max_seq_len"], config)
    corpus_meta = location(config.corpus_dir) / CORPUS_META  # the corpus whose tokenizer reads this run's model later
    if corpus_meta.is_file() and manifest.get("tokenizer_sha256"):
        ours = read_json(corpus_meta, (), REBUILD).get("tokenizer_sha256")
        if ours and ours != manifest["tokenizer_sha256"]:
            raise IncompatibleInputs(f"shards in {data_dir} were made with tokenizer {manifest['tokenizer_sha256'][:12]}, "
                                     f"but this run's corpus {config.corpus_dir} has tokenizer {ours[:12]}: fine-tuning "
                                     f"and export would read the model with the wrong ids (regenerate the shards, or "
                                     f"point work_dir / corpus.source at the corpus they were made from)")
    schema = [{"name": f.name, "type": str(f.type)} for f in SHARD_SCHEMA]
    if manifest["schema"] != schema:
        raise IncompatibleInputs(f"shards in {data_dir} have schema {manifest['schema']}, the trainer reads {schema}")


class Follower:
    """Shard records of the generator's progress log (`common.shards.PROGRESS_FILE`), waited for when asked:
    the trainer follows a generation still under way (`train --follow`). A local log is read from where the
    last read stopped; on object storage each record is its own object, fetched by name. `timeout`: seconds
    a shard may be waited for before the run stops with an error naming the generator (0: never wait)."""

    POLL_S = 0.5
    SAY_AFTER_S = 10.0

    def __init__(self, data_dir, timeout: float = 0.0, planned: int = 0, log=print, generator_pid: int = 0):
        self.data_dir, self.timeout, self.planned, self.log = location(data_dir), timeout, planned, log
        self.generator_pid = generator_pid  # `make train`: the generator it started; its exit ends the wait
        self.log_path = self.data_dir / PROGRESS_FILE
        self.records: dict[str, dict] = {}
        self._offset = 0
        self.waited_s, self.waits = 0.0, 0  # time and times the trainer waited for a shard
        # set by a trainer that stops (a signal, --deadline, an error) while its read of the next step waits here:
        # the wait ends at once instead of holding the stop up to `timeout`
        self.cancelled = threading.Event()

    def _refresh(self) -> None:
        if is_remote(self.log_path):
            return
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, 2)
                if f.tell() < self._offset:  # a new log (the folder was regenerated): read it again
                    self._offset, self.records = 0, {}
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self._offset += len(complete)
        for line in complete.decode().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.records[record["path"]] = record

    def _lookup(self, path: str) -> dict | None:
        if path not in self.records:
            if is_remote(self.log_path):
                if (record := read_record(self.log_path, "path", path)) is not None:
                    self.records[path] = record
            else:
                self._refresh()
        return self.records.get(path)

    def record(self, path: str) -> dict:
        """Shard `path`'s record, once the generator has written the shard."""
        if (record := self._lookup(path)) is not None:
            return record
        if not self.timeout:
            raise DataError(f"{self.data_dir / path} has no record in {self.log_path}: the folder was not made by "
                            f"`make generate-epochs`, or its log was removed; run it again")
        # The first wait is said, then only a wait longer than SAY_AFTER_S (the trainer catching up with a
        # generator that keeps pace would print two lines per shard); the total goes in the run's last lines.
        t0, said = time.time(), False
        while (record := self._lookup(path)) is None:
            if not said and (not self.waits or time.time() - t0 > self.SAY_AFTER_S):
                self.log(f"train: waiting for the generator: {path} is not written yet ({len(self.records)} of "
                         f"{self.planned or '?'} shards so far); stopping if it is not there in {self.timeout:.0f}s")
                said = True
            if self.generator_pid and not running(self.generator_pid) and self._lookup(path) is None:
                raise DataError(f"the generator (pid {self.generator_pid}) exited before writing {self.data_dir / path}; "
                                f"see its output, fix what it says, then run the command again (both resume)")
            if time.time() - t0 > self.timeout:
                raise DataError(f"{self.data_dir / path} was not written within {self.timeout:.0f}s of being "
                                f"needed (train --follow); {self.generator()}. Run `make generate-epochs` (it "
                                f"resumes where it stopped), then train again with --resume")
            if self.cancelled.wait(self.POLL_S):
                raise DataError(f"the trainer stopped while waiting for {self.data_dir / path}")
        self.waited_s += time.time() - t0
        self.waits += 1
        if said:
            self.log(f"train: {path} written after {time.time() - t0:.1f}s; going on")
        return record

    def generator(self) -> str:
        """Who writes the folder, from its lock (common.io.FolderLock), and whether it still runs."""
        lock = FolderLock(self.data_dir, "")
        owner = lock._owner()
        if not owner:
            return f"no generator holds the folder's lock ({lock.path}): none is running on this machine"
        state = "still running" if owner_running(owner) else "no longer running"
        return (f"its generator, {owner.get('what')} (pid {owner.get('pid')} on {owner.get('host')}, since "
                f"{owner.get('since')}), is {state}")


def running(pid: int) -> bool:
    """Whether process `pid` runs (an exited child its parent has not reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        return _alive(pid)


def planned_manifest(data_dir, config: RunConfig, timeout: float, log=print, generator_pid: int = 0) -> dict:
    """What plan.json says the folder will hold, shaped as the manifest's shard lists (no sizes nor hashes:
    those come with each shard's record). Waits up to `timeout` for plan.json (a generator starting up)."""
    path, t0 = location(data_dir) / PLAN_FILE, time.time()
    if not path.is_file():
        log(f"train: waiting for the generator to start writing {data_dir} ({PLAN_FILE})")
    while not path.is_file():
        if generator_pid and not running(generator_pid) and not path.is_file():
            raise DataError(f"the generator (pid {generator_pid}) exited before starting {data_dir}; see its output")
        if time.time() - t0 > timeout:
            raise DataError(f"{path} did not appear within {timeout:.0f}s (train --follow): start `make "
                            f"generate-epochs` for {data_dir}, or train on a finished folder")
        time.sleep(Follower.POLL_S)
    plan = read_json(path, (), REGENERATE)
    if plan.get("format_version") != FORMAT_VERSION or "shards" not in plan:
        raise DataError(f"{path} was written by an older generator and lists no shards; let it finish and train "
                        f"without --follow, or generate the folder again")
    manifest = {**plan, "epochs": [{"shards": [{"path": p, "rows": r} for p, r in shards]}
                                   for shards in plan["shards"]["epochs"]],
                "valid": {"shards": [{"path": p, "rows": r} for p, r in plan["shards"]["valid"]]}}
    check_data(manifest, data_dir, config)
    return manifest


def expected_key(config: RunConfig, total_rows: int | None = None) -> str | None:
    """The generation key of this config with the corpus and aux model at its paths: what the generator that
    `make train` starts writes. None where either is not there (shards made elsewhere, trusted by their plan).
    `total_rows`: the stream's length instead of this config's (a folder generated for a longer run)."""
    from common.checkpoint import AUX_FILE, read_aux_meta
    from common.plan import generation_key, stream_plan
    corpus_path = location(config.corpus_dir) / CORPUS_META
    try:
        corpus, aux = read_json(corpus_path, ("train",), REBUILD), read_aux_meta(location(config.aux_dir) / AUX_FILE)
    except FileNotFoundError:
        return None
    total_rows = total_rows or stream_plan(corpus["train"]["rows"], config).total_rows
    return generation_key(config.seed, config.generate, corpus, aux["sha256"], total_rows)


def generation_difference(made_with: dict, config: RunConfig, most: int = 4) -> str:
    """The seed and [generate] settings that differ between the config a folder was generated with (its
    manifest's `config`) and `config`, in words ("" when none do). Not the generation key: with
    `generate.epochs = 0` that also follows the stream's length from [train], which a sweep varies."""
    ours = generation_settings(config_to_dict(config)["generate"])
    pairs = [("seed", made_with.get("seed"), config.seed)]
    pairs += [(f"generate.{k}", v, ours.get(k)) for k, v in sorted(generation_settings(made_with.get("generate", {})).items())]
    differ = [f"{key} {theirs!r}, here {mine!r}" for key, theirs, mine in pairs if theirs is not None and theirs != mine]
    return "; ".join(differ[:most]) + (f"; {len(differ) - most} more" if len(differ) > most else "")


def open_data(data_dir, config: RunConfig, follow: float = 0.0, log=print, generator_pid: int = 0,
              finished: bool | None = None, world: int = 1) -> dict:
    """The trainer's view of a shard folder: the training and validation streams, the replaced-token prior and
    the data fingerprint. A finished folder is read by its manifest; with `follow` (a timeout in seconds) a
    folder still being generated is read by its plan, each shard once its record is written. Both give the
    same prior (the replaced fraction of the shards of the first global batch, from their records) and the
    same fingerprint (`common.shards.stream_fingerprint`), so a followed run is the run on the finished folder.
    `finished`: whether the folder is read as finished, as the ranks agreed (`train.trainer.open_streams`);
    None: whether its manifest is there now. `world`: the ranks that will share each batch (a note where the
    shards' row groups are larger than a rank's share: every rank then reads rows of the others)."""
    if finished is None:
        finished = (location(data_dir) / MANIFEST_FILE).is_file()
    if finished or not follow:
        manifest, fingerprint = load_data_manifest(data_dir, config)
        follower = Follower(data_dir, 0.0)
    else:
        manifest = planned_manifest(data_dir, config, follow, log, generator_pid)
        planned = len(manifest["valid"]["shards"]) + sum(len(e["shards"]) for e in manifest["epochs"])
        follower = Follower(data_dir, follow, planned, log, generator_pid)
    theirs = manifest.get("generation_key")
    if follow and (ours := expected_key(config)) and theirs != ours:
        # the same generation but for a stream of another length (epochs = 0 follows train.max_steps): read as
        # the finished folder would be, its length checked with the trainer's stream
        if theirs == expected_key(config, manifest.get("total_rows")):
            log(f"train: note: {data_dir} is generated for a stream of {manifest['total_rows']:,} rows, not this "
                f"run's length; its rows keep that stream's temperatures")
        else:
            raise DataError(f"{data_dir} holds shards of another generation (key {(theirs or '?')[:12]}; "
                            f"this config, corpus and aux model make {ours[:12]}): the generator will not overwrite "
                            f"them. Train on another folder (DATA=..., --data), or remove this one and run again")
    if not follow and (differ := generation_difference(manifest.get("config", {}), config)):
        # shards are meant to be reused across runs, so not an error; but the run's resolved_manifest.toml
        # records this manifest's [generate], not what made the data
        log(f"train: note: the shards in {data_dir} were made with other settings than this manifest's "
            f"({differ}); the run reads them as they are")
    # the generation's own settings (a followed folder's plan has none: its key matched this config's)
    made = manifest.get("config", {}).get("generate") or dataclasses.asdict(config.generate)
    group, share = made.get("rows_per_row_group") or made.get("rows_per_shard"), config.train.batch_size // world
    if world > 1 and group and share and group > share:
        log(f"train: note: the shards' row groups hold {group:,} rows, more than a rank's {share:,} of a batch: "
            f"each of the {world} ranks reads and decompresses rows of the others (up to "
            f"{min(world, -(-group // share))}x its own); shards made with [generate] rows_per_row_group dividing "
            f"{share:,} are read a rank's share each (base and large: 64)")
    train_shards = [s for e in manifest["epochs"] for s in e["shards"]]
    first, rows = [], 0
    for shard in train_shards:  # the shards holding the first global batch
        if rows >= max(config.train.batch_size, 1):
            break
        # a finished folder's manifest has the counts (older ones: the progress log)
        first.append(shard if "replaced" in shard else follower.record(shard["path"]))
        rows += shard["rows"]
    replaced, tokens = sum(r["replaced"] for r in first), sum(r["tokens"] for r in first)
    prior = min(max(replaced / max(tokens, 1), 1e-4), 1 - 1e-4)
    if not finished and follow:
        listed = [(s["path"], s["rows"]) for s in train_shards] + [(s["path"], s["rows"]) for s in manifest["valid"]["shards"]]
        fingerprint = stream_fingerprint(manifest["generation_key"], listed, first[0].get("device", "?"))
    watch = follower if not finished and follow else None
    return {"manifest": manifest, "fingerprint": fingerprint, "prior": prior, "following": watch is not None,
            "train": ShardStream(data_dir, train_shards, watch), "valid": ShardStream(data_dir, manifest["valid"]["shards"], watch)}


def remote_parquet(path, counter) -> tuple:
    """An object's Parquet file for ranged reads, and its footer, fetched with two GETs of exactly its size (the
    reader's own first read is a speculative 64 KB at the end: for a small shard, all of it, on every rank)."""
    import pyarrow.parquet as pq
    file = CountedReads(path.open_input(), counter)
    size = file.native.size()
    file.seek(size - 8)
    tail = file.read(8)
    length = int.from_bytes(tail[:4], "little")
    if tail[4:] != b"PAR1" or length + 12 > size:
        raise OSError(f"{path}: not a Parquet file (no footer)")
    file.seek(size - 8 - length)
    footer = pq.read_metadata(pa.BufferReader(b"PAR1" + file.read(length) + tail))
    return pa.PythonFile(file, mode="r"), footer


class CountedReads(io.RawIOBase):
    """A remote file's reads, counted (`ShardStream.bytes_fetched`): each is one ranged GET."""

    def __init__(self, native, counter):
        super().__init__()
        self.native, self.counter = native, counter

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.native.seek(offset, whence)

    def tell(self) -> int:
        return self.native.tell()

    def read(self, size: int = -1) -> bytes:
        data = self.native.read() if size is None or size < 0 else self.native.read(size)
        self.counter(len(data))
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self.native.close()
        super().close()


@dataclass
class Shard:
    start: int  # stream index of its first row
    rows: int
    path: object  # pathlib.Path or common.storage.ObjectPath
    bytes: int | None  # None: not written yet (a followed generation); known from its record
    sha256: str | None
    name: str = ""  # its path in the folder (the key of its record)


class ShardStream:
    """Random access to rows [start, stop) of a stream of shards, read a row group at a time (the few
    last ones cached). `bytes_read` / `bytes_decompressed`: what this stream has read from disk (column
    chunks and footers) and decompressed, for the per-rank reading benchmark."""

    CACHED_ROW_GROUPS = 4

    def __init__(self, data_dir, shard_records: list[dict], follower: Follower | None = None):
        data_dir = location(data_dir)
        self.shards, position, self.follower = [], 0, follower
        for record in shard_records:
            self.shards.append(Shard(position, record["rows"], data_dir / record["path"],
                                     record.get("bytes"), record.get("sha256"), record["path"]))
            position += record["rows"]
        self.num_rows = position
        if follower is None:
            listed = list_files(data_dir) if is_remote(data_dir) else {}
            size = (lambda s: getattr(listed.get(s.name), "st_size", None)) if is_remote(data_dir) else \
                (lambda s: s.path.stat().st_size if s.path.is_file() else None)
            problems = [f"{s.path} is missing" if got is None else f"{s.path} has {got} bytes, the manifest says {s.bytes}"
                        for s in self.shards if (got := size(s)) != s.bytes]
            if problems:
                raise DataError("shards do not match the manifest: " + "; ".join(problems[:5]))
        self._starts = [s.start for s in self.shards]
        self._files: OrderedDict[int, tuple] = OrderedDict()  # shard -> (ParquetFile, row group starts)
        self._cache: OrderedDict[tuple, dict] = OrderedDict()
        self.bytes_read, self.bytes_decompressed = 0, 0
        self.bytes_fetched = 0  # object storage: bytes of the ranged GETs made (CountedReads)
        # train.verify_shards on a followed generation: (rank, world, batch size); of the ranks that read a shard,
        # one hashes it as it arrives (`hashed_by`)
        self.verify_arrivals: tuple[int, int, int] | None = None

    def _count(self, n: int) -> None:
        self.bytes_fetched += n

    def _arrived(self, k: int) -> None:
        """A followed generation: wait for shard k's record, then check the file's size against it."""
        shard = self.shards[k]
        record = self.follower.record(shard.name)
        shard.bytes, shard.sha256 = record["bytes"], record["sha256"]
        remedy = "run `make generate-epochs` (it redoes missing and damaged shards), then train with --resume"
        if not shard.path.is_file():
            raise DataError(f"{shard.path} is missing, though the generator's log records it ({shard.bytes} bytes): "
                            f"{remedy}")
        if (got := shard.path.stat().st_size) != shard.bytes:
            raise DataError(f"{shard.path} has {got} bytes, its record in the generator's log says {shard.bytes}: "
                            f"{remedy}")
        if self.verify_arrivals and hashed_by(shard.start, shard.rows, k, *self.verify_arrivals[1:]) == \
                self.verify_arrivals[0] and (digest := sha256_file(shard.path)) != shard.sha256:
            raise DataError(f"{shard.path} has sha256 {digest[:12]}, its record says {shard.sha256[:12]}")

    def verify(self, rank: int = 0, world: int = 1, threads: int = 4) -> list[str]:
        """sha256 of every `world`-th shard from `rank` on, against the manifest, in threads (hashing
        releases the GIL); returns the problems found (`train.verify_shards`)."""
        mine = list(range(rank, len(self.shards), world))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            digests = list(pool.map(lambda k: sha256_file(self.shards[k].path), mine))
        return [f"{self.shards[k].path} has sha256 {digest[:12]}, the manifest says {self.shards[k].sha256[:12]}"
                for k, digest in zip(mine, digests) if digest != self.shards[k].sha256]

    def _file(self, k: int) -> tuple:
        """Shard k's open file and the first row of each of its row groups (its footer read once)."""
        if k in self._files:
            self._files.move_to_end(k)
            return self._files[k]
        shard = self.shards[k]
        if shard.bytes is None:
            self._arrived(k)
        def open_shard():
            source, footer = remote_parquet(shard.path, self._count) if is_remote(shard.path) else (None, None)
            return open_parquet(shard.path, SHARD_SCHEMA, source, footer)
        try:
            file = retried(open_shard, shard.path, "train")
        except Exception as e:  # noqa: BLE001 - any footer or schema unreadable after the tries is damage
            raise DataError(f"{shard.path} is damaged: {type(e).__name__}: {e}; run `make generate-epochs` "
                            f"(it redoes damaged shards), then train with --resume") from None
        meta = file.metadata
        counts = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        if sum(counts) != shard.rows:
            raise DataError(f"{shard.path} holds {sum(counts)} rows, the manifest says {shard.rows}")
        self.bytes_read += meta.serialized_size + 8  # the footer and its length and magic
        self._files[k] = (file, np.concatenate([[0], np.cumsum(counts)]))
        while len(self._files) > 2:
            self._files.popitem(last=False)
        return self._files[k]

    def _row_group(self, k: int, g: int) -> dict:
        key = (k, g)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        shard = self.shards[k]
        starts = self._file(k)[1]  # the row groups' first rows (the shard opened, or a DataError)

        def read():
            file, _ = self._file(k)
            try:
                return file.read_row_group(g)
            except Exception:
                self._files.pop(k, None)  # opened again for the next try: a reader that failed may not read again
                raise
        try:
            table = retried(read, f"{shard.path} row group {g}", "train")
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - a page whose CRC32 or encoding is wrong, after the tries
            raise DataError(f"{shard.path}: row group {g} (rows {shard.start + starts[g]}..{shard.start + starts[g + 1] - 1} "
                            f"of the stream) is damaged: {type(e).__name__}: {e}; run `make generate-epochs` (it "
                            f"redoes damaged shards), then train with --resume") from None
        file = self._file(k)[0]
        group = file.metadata.row_group(g)
        self.bytes_read += sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        self.bytes_decompressed += group.total_byte_size
        data = {"input_ids": list_column(table, "input_ids"), "labels": list_column(table, "labels"),
                "temperature": table.column("temperature").to_numpy(),
                "stream_index": table.column("stream_index").to_numpy()}
        expected = shard.start + starts[g] + np.arange(table.num_rows)
        if table.num_rows != starts[g + 1] - starts[g] or not np.array_equal(data["stream_index"], expected):
            raise DataError(f"{shard.path}: row group {g}: rows or stream positions differ from the manifest")
        self._cache[key] = data
        while len(self._cache) > self.CACHED_ROW_GROUPS:
            self._cache.popitem(last=False)
        return data

    def rows(self, start: int, stop: int) -> dict:
        """Rows with stream index in [start, stop), in order."""
        assert 0 <= start <= stop <= self.num_rows, (start, stop, self.num_rows)
        out = {"input_ids": [], "labels": [], "temperature": [], "stream_index": []}
        position = start
        while position < stop:
            k = bisect.bisect_right(self._starts, position) - 1
            shard = self.shards[k]
            _, starts = self._file(k)
            g = int(np.searchsorted(starts, position - shard.start, side="right")) - 1
            data = self._row_group(k, g)
            first = shard.start + int(starts[g])
            lo, hi = position - first, min(stop, shard.start + int(starts[g + 1])) - first
            for key in out:
                out[key].extend(data[key][lo:hi])
            position = first + hi
        out["temperature"] = np.asarray(out["temperature"], dtype=np.float32)
        out["stream_index"] = np.asarray(out["stream_index"], dtype=np.int64)
        return out


def training_stream(data_dir, manifest: dict) -> ShardStream:
    return ShardStream(data_dir, [s for e in manifest["epochs"] for s in e["shards"]])


def validation_stream(data_dir, manifest: dict) -> ShardStream:
    return ShardStream(data_dir, manifest["valid"]["shards"])


def to_tensors(rows: dict) -> dict:
    """Padded tensors in compact dtypes (what crosses to the device is 6 bytes a token, not 13): input_ids
    (B, L) int32, labels (B, L) uint8 (0/1, made float where the loss is computed), attention_mask (B, L) bool;
    and `padded`, whether any row is shorter than the longest (known here, from the lengths)."""
    lengths = [len(r) for r in rows["input_ids"]]
    ids = pad_rows(rows["input_ids"], dtype=torch.int32)
    return {"input_ids": ids, "labels": pad_rows(rows["labels"], 0, torch.uint8),
            "attention_mask": attention_mask(lengths, ids.shape[1]), "padded": min(lengths) < ids.shape[1]}


def hashed_by(start: int, rows: int, k: int, world: int, batch_size: int) -> int:
    """The rank that hashes shard `k` (stream rows [start, start + rows)) as it arrives, among the ranks that read
    it (`rank_slice`): every shard read is hashed once, whether a rank's share of a batch spans many shards or a
    shard many batches. Every rank computes the same."""
    per_rank = batch_size // world
    first, last = start % batch_size, (start + rows - 1) % batch_size  # positions in the global batch
    if rows >= batch_size:
        readers = list(range(world))
    elif first <= last:
        readers = list(range(first // per_rank, last // per_rank + 1))
    else:  # the shard crosses into the next step's batch
        readers = sorted(set(range(first // per_rank, world)) | set(range(0, last // per_rank + 1)))
    return readers[k % len(readers)]


def rank_slice(step: int, batch_size: int, rank: int, world: int) -> tuple[int, int]:
    """Stream rows [start, stop) that `rank` reads at `step` (contiguous slice of the global batch)."""
    per_rank = batch_size // world
    start = step * batch_size + rank * per_rank
    return start, start + per_rank
