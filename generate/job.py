"""The Ray side of the generator: one actor per device, a driver loop over shard tasks.

Each actor loads the aux model once and opens the corpus (`__init__`) and then turns
tasks into shard files. The driver hands tasks to idle actors, records every
finished shard in `progress.jsonl` (so a killed run resumes where it stopped),
and shows a tqdm bar with tokens/s and ETA. An actor whose process dies is
restarted by Ray and its task retried; the output does not change because
every row's randomness is seeded from (seed, epoch, row id).
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections import Counter, deque
from statistics import median_high
from pathlib import Path

import ray
import torch
from tqdm import tqdm

from common.config import ConfigError, GenerateConfig
from common.io import DiskFull, append_record, file_stamp, read_records
from common.corpus import CORPUS_META
from common.parallel import ActorDied, NodeProblem, start_ray as common_start_ray
from common.plan import ShardTask
from common.shards import PLAN_FILE, PROGRESS_FILE
from common.storage import location
# Fault injection for tests (real process deaths, not mocks):
FAIL_ONCE_ENV = "FAST_ELECTRA_TEST_KILL_WORKER_ONCE"  # path of a marker file; the first task's process dies
SLOW_ENV = "FAST_ELECTRA_TEST_SECONDS_PER_SHARD"      # sleep before each shard, to kill a run halfway;
# "S@E": before each shard of training epochs E and later only (a generator a trainer catches up with)
FAIL_ALWAYS_ENV = "FAST_ELECTRA_TEST_KILL_WORKER_ALWAYS"  # set: every task's process dies (past Ray's restarts)
HANG_ENV = "FAST_ELECTRA_TEST_HANG_ONCE"  # path of a marker file; the first task never returns (a node lost)
MEMORY_ENV = "FAST_ELECTRA_MEMORY_BYTES"  # bytes free on every machine and GPU, in place of what they say (tests)


@ray.remote
class ShardActor:
    def __init__(self, aux_path: str, corpus_dir: str, out_dir: str, seed: int, generate: GenerateConfig):
        self.problem = node_problem(out_dir, corpus_dir, aux_path)
        if self.problem:  # said by the first task (an error here would have Ray restart the actor, then a trace)
            return
        from common.checkpoint import IncompatibleInputs
        from common.sources import CorpusError
        try:  # what the checks above cannot see: an hf: aux model's own folder, a part of the corpus
            self._start(aux_path, corpus_dir, out_dir, seed, generate)
        except (OSError, CorpusError, IncompatibleInputs) as e:
            self.problem = (f"an actor on Ray node {socket.gethostname()} cannot load its inputs: {e} (every node "
                            f"must see the driver's folders at the same paths, or use object storage)")

    def _start(self, aux_path, corpus_dir, out_dir, seed: int, cfg: GenerateConfig) -> None:
        from common.checkpoint import local_aux
        from common.corpus import SplitRows, local_corpus
        from common.corrupt import Corruptor
        from generate.worker import ShardWriter
        corpus_dir, aux_path = local_corpus(corpus_dir), local_aux(aux_path)  # this machine's copies
        torch.set_num_threads(cfg.threads_per_worker)
        device = "cuda" if ray.get_gpu_ids() else "cpu"
        # the one way a manifest makes its Corruptor, as fast-online's does (its rows are the shards' bit for bit)
        corruptor = Corruptor.from_config(aux_path, seed, cfg, corpus_dir, device)
        rows = {split: SplitRows(corpus_dir, split) for split in ("train", "valid")}  # read by position
        self.writer = ShardWriter(rows, corruptor, out_dir, cfg.zstd_level, cfg.rows_per_row_group)
        self.device, self.device_model = device, device_model(device)
        self.libraries = libraries()
        self.device_lock = threading.Lock()  # with 2 tasks in flight: one shard on the model at a time

    def ready(self) -> None:
        """Returns once the actor is up (its aux model loaded, or its problem known)."""

    def memory(self, shard_rows: int, seq_len: int, in_flight: int) -> dict | None:
        """What this actor will need at its peak beyond what it holds now (`common.memory.generation_need`),
        and what its machine and its GPU have free now that every actor has loaded its aux model; None where
        the actor cannot work (its first task says why)."""
        if self.problem:
            return None
        from common.memory import aux_shape, generation_need, host_available_bytes
        corruptor = self.writer.corruptor
        shape = aux_shape(corruptor.model, corruptor.vocab_size)
        host, device = generation_need(shape, corruptor.batch_tokens, seq_len, shard_rows * seq_len, in_flight,
                                       corruptor.mask_prob, corruptor.chunk_entries, self.device == "cuda")
        free, source = host_available_bytes()
        report = {"host": socket.gethostname(), "node": ray.get_runtime_context().get_node_id(), "shape": str(shape),
                  "device_model": self.device_model,
                  "host_need": host, "host_free": free, "host_source": source, "gpu": None, "device_need": device}
        if self.device == "cuda":
            report.update(gpu=str(ray.get_gpu_ids()[0]), device_free=float(torch.cuda.mem_get_info()[0]),
                          device_source=f"free memory of {torch.cuda.get_device_name()}")
        return report

    def run(self, task: ShardTask) -> dict:
        if self.problem:
            raise NodeProblem(self.problem)
        time.sleep(slow_seconds(os.environ.get(SLOW_ENV, ""), task))
        if hang := os.environ.get(HANG_ENV):
            try:  # the first task of all, of whichever actor creates the marker
                with open(hang, "x") as marker:
                    marker.write(f"hung pid {os.getpid()} on {task.path}\n")
            except FileExistsError:
                pass
            else:
                threading.Event().wait()  # a task whose node went away: it never returns
        marker = os.environ.get(FAIL_ONCE_ENV)
        if os.environ.get(FAIL_ALWAYS_ENV) or marker and not os.path.exists(marker):
            if marker:
                Path(marker).write_text(f"killed pid {os.getpid()} on {task.path}\n")
            os._exit(1)  # a real process death mid-task, not an exception
        record = self.writer(task, self.device_lock)
        stamp = file_stamp(self.writer.out_dir / task.path)  # in place now: a restart trusts it as it is
        return {**record, "device": self.device, "device_model": self.device_model, "libraries": self.libraries,
                "stamp": stamp}


# The driver polls its shards every POLL_S; with nothing left to start, a shard that has run STRAGGLER_TIMES the
# median shard's time (STRAGGLER_MIN_S at least) runs again on an idle actor: Ray restarts an actor whose node was
# lost only where there is room, which a cluster of busy GPUs does not have, and the driver waited for it forever.
# Shard bytes depend on the task alone and writes are atomic, so the copy that finishes second changes nothing.
POLL_S, STRAGGLER_TIMES, STRAGGLER_MIN_S = 2.0, 3.0, 10.0
NOTE_AFTER_S = 600.0  # no shard finished for this long: say what is in flight and what the cluster has free


def straggler(pending: dict, started: dict, seconds: list[float]):
    """The longest-running pending shard that has run past STRAGGLER_TIMES the median of `seconds` (and
    STRAGGLER_MIN_S), with no second copy in flight, as (future, (actor, task)); None if there is none."""
    if not seconds:
        return None
    copies = Counter(task.path for _, task in pending.values())
    limit, now = max(STRAGGLER_TIMES * median_high(seconds), STRAGGLER_MIN_S), time.time()
    late = [(started[f], f) for f, (_, task) in pending.items() if copies[task.path] == 1 and now - started[f] > limit]
    if not late:
        return None
    future = min(late, key=lambda x: x[0])[1]
    return future, pending[future]


def spare_actor(idle, pending: dict, model_of: dict, straggling):
    """An idle actor to run a straggler's shard again: one with no shard in flight (the memory check sized each
    actor for the shards it was to hold, not one more) and of the straggler's device model (another model's
    kernels round otherwise, and the copy that finishes second replaces the file: its bytes must be the
    recorded ones); None if there is none."""
    busy = {id(actor) for actor, _ in pending.values()}
    model = model_of.get(id(straggling))
    return next((a for a in idle if id(a) not in busy and model is not None and model_of.get(id(a)) == model), None)


def task_error(error: "ray.exceptions.RayTaskError", task: ShardTask) -> Exception:
    """What the driver raises for a shard task that failed in its actor: a user's problem (a full disk, a node
    that cannot work, damaged corpus rows) as its one line naming the shard; anything else, a fault of ours, as
    Ray's error with its traceback, after a line naming the shard."""
    from common.sources import CorpusError
    cause = getattr(error, "cause", None)
    if isinstance(cause, (DiskFull, NodeProblem, CorpusError)):
        # the other actors' copies of it, never fetched, are not printed by Ray after that line
        os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
        if isinstance(cause, DiskFull):
            return DiskFull(cause.errno, str(cause))  # names the file it was writing
        return NodeProblem(str(cause)) if isinstance(cause, NodeProblem) else CorpusError(f"{cause} (read for shard "
                                                                                         f"{task.path})")
    print(f"generate: shard {task.path} failed in its actor; Ray's traceback follows", file=sys.stderr, flush=True)
    return error


def libraries() -> str:
    """The versions a shard's bytes depend on beside its device: torch's kernels round, numpy draws the masks,
    pyarrow encodes (its version is in every file's footer)."""
    import numpy
    import pyarrow
    return f"torch {torch.__version__}, numpy {numpy.__version__}, pyarrow {pyarrow.__version__}"


def device_model(device: str) -> str:
    """What a shard's numbers depend on beyond the device kind: the GPU model and compute capability, or the
    vector instructions torch's CPU kernels use (either picks other kernels, which may round differently)."""
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    return f"CPU ({torch.backends.cpu.get_cpu_capability()} kernels)"


def node_problem(out_dir: str, corpus_dir: str, aux_path: str) -> str | None:
    """Why an actor cannot work on this node, if it cannot: the driver's folders (paths or URIs) not seen
    here (every node must see them: a shared file system, or object storage), or a GPU Ray handed it that
    this node's torch cannot use (its shards would be fp32 CPU rows in a folder of bf16 GPU ones)."""
    host = socket.gethostname()
    for what, path, name in (("output folder", out_dir, PLAN_FILE), ("corpus", corpus_dir, CORPUS_META),
                             ("aux model", aux_path, None)):
        seen = location(path) / name if name else location(path)
        if not seen.is_file():
            return (f"the {what} {path} is not there as seen from Ray node {host} ({seen} missing): every node "
                    f"must see the driver's folders at the same paths (a shared file system), or use object storage")
    if ray.get_gpu_ids() and not torch.cuda.is_available():
        return (f"Ray gave an actor GPU {ray.get_gpu_ids()} on {host}, but torch {torch.__version__} there sees no "
                f"CUDA device (a CPU-only build, or the driver): install a CUDA build of torch on that node")
    return None


def read_progress(out_dir) -> dict[str, dict]:
    """Shard records of an earlier (maybe killed) run, by path."""
    return read_records(location(out_dir) / PROGRESS_FILE, "path")


def append_progress(out_dir, record: dict) -> None:
    append_record(location(out_dir) / PROGRESS_FILE, record, key="path")


def start_ray(address: str | None, workers: int) -> None:
    common_start_ray(address, workers, (FAIL_ONCE_ENV, FAIL_ALWAYS_ENV, SLOW_ENV, HANG_ENV))


def slow_seconds(value: str, task: ShardTask) -> float:
    """The test throttle `SLOW_ENV` asks of `task`: "S" seconds before every shard, "S@E" before the shards of
    training epochs E and later."""
    seconds, _, from_epoch = value.partition("@")
    if from_epoch and (task.split != "train" or task.epoch < int(from_epoch)):
        return 0.0
    return float(seconds or 0)


def actor_device(address: str | None, workers: int) -> str:
    """The kind of device this run's shard actors will compute on: every actor gets a GPU when the
    cluster has one (`run_tasks`), else all run on CPU. Starts Ray."""
    start_ray(address, workers)
    return "cuda" if int(ray.cluster_resources().get("GPU", 0)) > 0 else "cpu"


def actor_plan(workers: int, gpus: int, tasks_in_flight: int = 0, actors_per_gpu: int = 1) -> tuple[int, dict]:
    """How many shard actors to start and their Ray options, for `workers` devices asked on a cluster with
    `gpus` GPUs (0: CPU actors, one per worker). A GPU is shared by `actors_per_gpu` actors, each a process
    with its own aux model: one actor's host side (Python, one interpreter lock) bounds what it can give
    its GPU. Each runs `tasks_in_flight` shards at once (0: 2 on a GPU, 1 on a CPU). A GPU's actors ask
    for one CPU between them, as for the GPU: a local Ray holds a CPU per worker (`start_ray`), and k actors
    asking a CPU each would leave all but one of every k unplaced, waiting forever."""
    depth = tasks_in_flight or (2 if gpus else 1)
    share = 1 / actors_per_gpu if gpus else 0
    options = {"num_cpus": share or 1, "num_gpus": share, "max_restarts": 3,
               "max_task_retries": 3, "max_concurrency": depth}  # depth > 1: that many `run` calls at once, in threads
    if not gpus:
        return workers, options
    if workers > gpus:
        print(f"generate: {workers} workers asked, the cluster has {gpus} GPU(s); using {gpus}")
    return min(workers, gpus) * actors_per_gpu, options


def memory_problem(reports: list[dict], batch_tokens: int, actors_per_gpu: int, override: str | None = None) -> str | None:
    """Why the actors would run out of memory, if they would (DESIGN.md, scale: a pre-flight check refuses what
    cannot fit the device): the needs of the actors of each GPU, then of each machine, against GEN_HEADROOM of
    what it has free, from the actors' `memory` reports. `override`: bytes free on every machine and GPU
    (MEMORY_ENV). The advice names settings that keep the shards' bytes first (`--workers`, `actors_per_gpu`,
    `tasks_in_flight`); `batch_tokens` and `rows_per_shard` make another generation."""
    from common.memory import GEN_HEADROOM
    groups = {}
    for r in reports:
        if r["gpu"] is not None:
            groups.setdefault(("device", r["node"], r["gpu"]), []).append(r)
    for r in reports:
        groups.setdefault(("host", r["node"], None), []).append(r)
    for (kind, node, gpu), group in groups.items():
        need, each = sum(r[f"{kind}_need"] for r in group), max(r[f"{kind}_need"] for r in group)
        have, source = (float(override), MEMORY_ENV) if override else min(
            (r[f"{kind}_free"], r[f"{kind}_source"]) for r in group)
        if need <= GEN_HEADROOM * have:
            continue
        fit = int(GEN_HEADROOM * have // each)
        gpus_here = len({r["gpu"] for r in group})
        if not fit:
            advice = ("one actor does not fit: lower [generate] batch_tokens (or rows_per_shard; either makes "
                      "another generation of the shards)")
        elif kind == "device":
            advice = f"set [generate] actors_per_gpu = {fit} (now {actors_per_gpu})"
        elif group[0]["gpu"] is None:
            advice = (f"{fit} fit there: lower --workers (make's WORKERS=; it counts the cluster's actors, "
                      f"{len(reports)} now)")
        elif fit >= gpus_here:
            advice = f"{fit} fit there: set [generate] actors_per_gpu = {fit // gpus_here} (now {actors_per_gpu})"
        else:
            advice = f"{fit} fit there: set [generate] tasks_in_flight = 1, or lower --workers"
        where = f"on GPU {gpu} of {group[0]['host']}" if kind == "device" else f"on {group[0]['host']}"
        return (f"{len(group)} generation actor(s) {where} would need about {_size(need)} more at their peak "
                f"({_size(each)} each: batches of {batch_tokens:,} tokens through an aux model {group[0]['shape']}, "
                f"and the shards in flight), but {source} is {_size(have)} (the actors may plan on "
                f"{GEN_HEADROOM:.0%} of it); {advice}")
    return None


def wait_until_placed(actors: list, options: dict, note_after: float = 60.0) -> None:
    """Wait for every actor to hold its aux model. Ray waits for resources it lacks (an autoscaling cluster's
    nodes may still come), saying so at most in its autoscaler's terms: say how many wait and why, every
    `note_after` seconds."""
    pending = [a.ready.remote() for a in actors]
    waited = 0.0
    while pending:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=note_after)
        ray.get(done)  # an actor that failed to start raises here
        waited += note_after
        if pending:
            print(not_started_note(len(pending), len(actors), waited, options, ray.available_resources(),
                                  ray.cluster_resources()), flush=True)


def not_started_note(pending: int, total: int, waited: float, options: dict, free: dict,
                     cluster: dict | None = None) -> str:
    """What `wait_until_placed` says of actors not yet holding their aux model, given Ray's free resources and
    the cluster's: resources free for one more, or in use for all `total` (Ray reserves an actor's share before
    its process has started), say the actors are still starting, not that they do not fit."""
    cpu, gpu = free.get("CPU", 0.0), free.get("GPU", 0.0)
    fits = cpu >= options["num_cpus"] and gpu >= options["num_gpus"]
    cluster = cluster or {}
    held = all(cluster.get(kind, 0.0) - free.get(kind, 0.0) >= total * options[key] - 1e-3
               for kind, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")))
    return (f"generate: {pending} of {total} actors not started after {waited:.0f} s; each asks Ray for "
            f"{options['num_cpus']:g} CPU and {options['num_gpus']:g} GPU, the cluster has {cpu:g} CPU and {gpu:g} GPU "
            "free " + ("(enough: they are still starting, loading the aux model on a busy machine)" if fits else
                       f"(the rest held, enough for all {total}: they are still starting, loading the aux model on a "
                       f"busy machine)" if held else "(lower --workers or [generate] actors_per_gpu, or add nodes)"))


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def run_tasks(tasks: list[ShardTask], workers: int, actor_args: dict, out_dir: Path, address: str | None = None,
              tasks_in_flight: int = 0, actors_per_gpu: int = 1, seq_len: int = 512) -> list[dict]:
    """Run `tasks` on the actors of `actor_plan` for `workers` devices, once their memory check passed (rows of
    `seq_len` tokens at most); returns their records in completion order."""
    start_ray(address, workers)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    count, options = actor_plan(workers, gpus, tasks_in_flight, actors_per_gpu)
    depth = options["max_concurrency"]
    count = min(count, len(tasks))  # a resumed run with a few shards left: no actor without one
    actors = [ShardActor.options(**options).remote(**actor_args) for _ in range(count)]
    queue, pending, records = deque(tasks), {}, []
    bar = None
    try:
        # before any shard: what the actors will need at their peak against what each machine and GPU has free
        # once every actor holds its aux model
        wait_until_placed(actors, options)
        in_flight = min(depth, -(-len(tasks) // max(count, 1)))  # the shards an actor can hold at once here
        reports = ray.get([a.memory.remote(max((t.count for t in tasks), default=0), seq_len, in_flight)
                           for a in actors])
        problem = memory_problem([r for r in reports if r], actor_args["generate"].batch_tokens, actors_per_gpu,
                                 os.environ.get(MEMORY_ENV))
        if problem:
            raise ConfigError(problem)
        model_of = {id(a): (r or {}).get("device_model") for a, r in zip(actors, reports)}
        tokens, t0 = 0, time.time()
        bar = tqdm(total=len(tasks), desc="generate", unit="shard", dynamic_ncols=True)
        # one slot per task in flight, taken in turn: the first tasks (the validation shard, epoch 0's first
        # shards: the trainer's first steps) go one to each device, not two to one while others wait
        idle = deque(actor for _ in range(depth) for actor in actors)
        started, seconds, quiet_since = {}, [], time.time()
        while queue or pending:
            while queue and idle:
                actor = idle.popleft()
                task = queue.popleft()
                future = actor.run.remote(task)
                pending[future], started[future] = (actor, task), time.time()
            done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            if not done:
                if not queue and idle:  # nothing left to start: a straggler runs again on an idle actor
                    again = straggler(pending, started, seconds)
                    elsewhere = again and spare_actor(idle, pending, model_of, again[1][0])
                    if elsewhere is not None:
                        future, (_, task) = again
                        print(f"generate: shard {task.path} has run {time.time() - started[future]:.0f} s on its "
                              f"actor, the shards so far {median_high(seconds):.0f} s (its node lost, Ray restarting "
                              f"the actor?); running it on an idle actor too (the same bytes)", flush=True)
                        idle.remove(elsewhere)
                        duplicate = elsewhere.run.remote(task)
                        pending[duplicate], started[duplicate] = (elsewhere, task), time.time()
                if time.time() - quiet_since > NOTE_AFTER_S:
                    quiet_since = time.time()
                    free = ray.available_resources()
                    print(f"generate: no shard finished in the last {NOTE_AFTER_S / 60:.0f} min; {len(pending)} in "
                          f"flight; the cluster has {free.get('CPU', 0):g} CPU and {free.get('GPU', 0):g} GPU free. "
                          f"Lost nodes that are not coming back: stop (Ctrl-C) and rerun, the shards done are "
                          f"kept", flush=True)
                continue
            quiet_since = time.time()
            actor, task = pending.pop(done[0])
            try:
                record = ray.get(done[0])
            except ray.exceptions.RayTaskError as e:
                raise task_error(e, task) from None
            except ray.exceptions.RayActorError as e:  # its process died, restarts and retries spent
                if any(t.path == task.path for _, t in pending.values()):  # its other copy runs on
                    continue
                os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
                raise ActorDied(f"the generation actor working on {task.path} died {options['max_restarts'] + 1} "
                                f"times ({str(e).strip().splitlines()[0][:200]}); killed for memory? The node's "
                                f"`dmesg` and Ray's logs (/tmp/ray/session_latest/logs) say. A rerun resumes from "
                                f"the shards done") from None
            append_progress(out_dir, record)
            records.append(record)
            seconds.append(time.time() - started.pop(done[0]))
            for other in [f for f, (_, t) in pending.items() if t.path == task.path]:  # a copy on a stuck actor:
                del pending[other], started[other]  # not waited for (killed below), its slot given no more work
                os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"  # nor its error, if it ever ends in one
            idle.append(actor)
            tokens += record["tokens"]
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / (time.time() - t0):.0f}", device=record["device"])
    finally:
        if bar is not None:
            bar.close()
        for actor in actors:
            ray.kill(actor)
    return records
