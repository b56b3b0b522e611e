"""Artifacts a user can trust: one writer per folder, damage found before the first update, stale
corpora rebuilt by content, no trainer outliving its command."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from common.io import FolderLock, FolderLocked
from corpus.build import build_corpus, corpus_is_current
from tests.conftest import ROOT, run_ranks, signal_all, tiny_config, write_text_corpus
from train.__main__ import SLOW_ENV

HOLD = "import sys, time; from common.io import FolderLock; FolderLock(sys.argv[1], 'a test writer').acquire(); " \
       "print('held', flush=True); time.sleep(60)"


def _holder(folder, env):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_stops_naming_the_owner_and_a_dead_owners_lock_is_taken_over(tmp_path, env_with_repo):
    folder = tmp_path / "run"
    holder = _holder(folder, env_with_repo)
    try:
        with pytest.raises(FolderLocked, match=rf"run is being written by a test writer \(pid {holder.pid} on "):
            FolderLock(folder, "me").acquire()
    finally:
        holder.kill()
        holder.wait()
    with FolderLock(folder, "me") as lock:  # the owner is gone: taken over
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert not lock.path.exists()


def test_a_lock_whose_pid_now_belongs_to_another_process_is_taken_over(tmp_path, capsys):
    """A container restarted: the dead writer's pid is some other live process now (here pid 1). The start
    time the lock recorded tells them apart. A lock of another machine is not judged, but the message says
    which file to delete if that machine went down."""
    import socket
    folder = tmp_path / "run"
    lock_file = tmp_path / ".run.lock"
    lock_file.write_text(json.dumps({"pid": 1, "started": -1, "host": socket.gethostname(), "what": "a writer",
                                     "since": "2026-11-25 00:00:00"}))
    with FolderLock(folder, "me") as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert "taking over the lock of process 1 (a writer), which is no longer running" in capsys.readouterr().out
    lock_file.write_text(json.dumps({"pid": 1, "host": "another-host", "what": "a writer", "since": "then"}))
    with pytest.raises(FolderLocked, match=rf"on another-host.*delete {lock_file}"):
        FolderLock(folder, "me").acquire()


TAKE_OVER = """
import sys, time
import common.io as io
real = io.owner_running
def slow(owner):  # judging the dead owner takes a while (a slow /proc, a busy machine): both processes do it at once
    time.sleep(0.3)
    return real(owner)
io.owner_running = slow
try:
    lock = io.FolderLock(sys.argv[1], sys.argv[2]).acquire()
except io.FolderLocked as e:
    print("refused:", e, flush=True)
    sys.exit(0)
print("took it", flush=True)
time.sleep(1.5)  # held while the other one decides
lock.release()
"""


def test_two_processes_finding_the_same_dead_owner_do_not_both_take_the_folder(tmp_path, env_with_repo):
    """Both judged the dead owner's lock stale: the first removed it and made its own, the second then removed
    that one too and made its own, and two writers went on in one folder. One takes it; the other is refused
    naming it."""
    import socket
    folder = tmp_path / "epochs"
    (tmp_path / ".epochs.lock").write_text(json.dumps({"pid": 1, "started": -1, "host": socket.gethostname(),
                                                       "what": "a killed writer", "since": "2026-11-25 00:00:00"}))
    procs = [subprocess.Popen([sys.executable, "-c", TAKE_OVER, str(folder), f"writer {i}"], cwd=ROOT,
                              env=env_with_repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    said = [out for out, _ in outs]
    assert sum("took it" in out for out in said) == 1, said
    assert sum(re.search(r"refused: .*epochs is being written by writer \d", out) is not None for out in said) == 1, said


def test_two_threads_writing_one_path_write_temporaries_of_their_own(tmp_path):
    """A shard run again on an idle slot of the actor already writing it, or by processes of one pid on two
    hosts of a shared file system: each writes a temporary of its own (the pid alone named one file for
    both), and the path ends as one whole file."""
    import threading
    from common.io import atomic_path, tmp_path_for
    target = tmp_path / "shard-00001.parquet"
    names, both_open = [], threading.Barrier(2)

    def write(byte: bytes):
        with atomic_path(target) as tmp:
            names.append(tmp.name)
            tmp.write_bytes(byte * 100_000)
            both_open.wait(timeout=10)  # each temporary open while the other is written
    threads = [threading.Thread(target=write, args=(b,)) for b in (b"a", b"b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(names)) == 2 and all(n.startswith(".shard-00001.parquet.tmp-") for n in names), names
    assert target.read_bytes() in (b"a" * 100_000, b"b" * 100_000)
    assert not list(tmp_path.glob(".*.tmp-*")) and tmp_path_for(target).name.startswith(".shard-00001.parquet.tmp-")


def test_a_dead_owners_lock_is_taken_over_where_the_file_system_has_no_flock(tmp_path, monkeypatch, capsys):
    """Lustre mounted without flock, some FUSE file systems: flock fails (ENOSYS); the take-over goes on
    unguarded, as before the guard, not with a traceback."""
    import errno
    import fcntl
    import socket

    def no_flock(*_):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    (tmp_path / ".run.lock").write_text(json.dumps({"pid": 1, "started": -1, "host": socket.gethostname(),
                                                    "what": "a writer", "since": "2026-11-25 00:00:00"}))
    with FolderLock(tmp_path / "run", "me") as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert "taking over the lock of process 1" in capsys.readouterr().out


def test_an_empty_lock_is_left_while_it_may_be_being_written_and_removed_once_old(tmp_path, monkeypatch):
    """An empty lock file: a writer between its exclusive create and its first write (slow on a network file
    system), or one a kill tore. It was removed after 50 ms, under a writer still writing it; now once it is
    older than TORN_LOCK_S (here 60 s, then the file made older)."""
    import common.io as io
    monkeypatch.setattr(io, "TORN_LOCK_S", 60.0)
    lock_file = tmp_path / ".run.lock"
    lock_file.write_text("")
    with pytest.raises(FolderLocked, match="could not take the lock"):
        FolderLock(tmp_path / "run", "me").acquire()
    assert lock_file.exists() and lock_file.read_text() == ""
    old = time.time() - 2 * io.TORN_LOCK_S
    os.utime(lock_file, (old, old))
    with FolderLock(tmp_path / "run", "me") as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


@pytest.mark.slow
def test_a_trainer_on_a_locked_run_folder_stops_with_exit_code_2(generated, tmp_path, env_with_repo):
    manifest, data, _ = generated
    run = tmp_path / "run"
    holder = _holder(run, env_with_repo)
    try:
        result = subprocess.run([sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(data),
                                 "--out", str(run)], cwd=ROOT, env=env_with_repo, capture_output=True, text=True,
                                timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"is being written by a test writer (pid {holder.pid}" in result.stderr
    assert not (run / "checkpoints").exists()


@pytest.mark.slow
def test_with_verify_shards_a_damaged_shard_of_the_last_epoch_stops_the_trainer_before_step_1(generated, tmp_path,
                                                                                             env_with_repo):
    manifest, data, _ = generated
    copy = tmp_path / "epochs"
    shutil.copytree(data, copy)
    last = json.loads((copy / "manifest.json").read_text())["epochs"][-1]["shards"][-1]["path"]
    raw = bytearray((copy / last).read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, other bytes
    (copy / last).write_bytes(bytes(raw))
    result = subprocess.run([sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(copy),
                             "--out", str(tmp_path / "run"), "--set", "train.verify_shards=true"],
                            cwd=ROOT, env=env_with_repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "found before the first update" in errors[0] and last in errors[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""  # no step was logged


@pytest.mark.slow
def test_killing_the_launchers_process_group_leaves_no_trainer(generated, tmp_path, env_with_repo):
    manifest, data, _ = generated
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "train",
           "--manifest", str(manifest), "--data", str(data), "--out", str(run)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env_with_repo, SLOW_ENV: "1"},  # still training when killed
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "metrics.jsonl").is_file():
        time.sleep(0.2)
    assert (run / "metrics.jsonl").is_file(), "the trainer did not start"
    os.killpg(proc.pid, signal.SIGKILL)  # what make's kill of the job group does to torchrun
    proc.wait()

    def trainers():
        out = subprocess.run(["ps", "-eww", "-o", "pid,args"], capture_output=True, text=True).stdout  # full lines
        return [line for line in out.splitlines() if str(run) in line and "grep" not in line]
    for _ in range(50):
        if not trainers():
            break
        time.sleep(0.2)
    assert trainers() == []


@pytest.mark.slow
def test_sigusr1_prints_the_stacks_of_the_launcher_and_each_rank_and_the_run_goes_on(generated, tmp_path, gloo_env):
    """Where a run that seems stuck is: the README's `pkill -USR1 -f 'python.* -m train'` during `make train
    NPROC=2` picks make's recipe shell, the launcher and its two ranks; each process prints every thread's
    stack (each rank's main thread inside the trainer's loop, the launcher in torchrun's agent), and the run
    finishes as if nothing had been asked (make's shell, whose command line matches too, is not ended by it)."""
    from common.config import dump_toml, load_manifest
    manifest, data, _ = generated
    config = load_manifest(manifest, ["train.max_steps=6"])  # the same corpus, aux model and shards
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(config))
    copy, run = tmp_path / "epochs", tmp_path / "run"
    shutil.copytree(data, copy)  # make's generator checks the folder it is given and writes beside its shards
    cmd = ["make", "--no-print-directory", "train", f"MANIFEST={manifest}", f"DATA={copy}", f"RUN={run}", "NPROC=2",
           "WORKERS=1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**gloo_env, SLOW_ENV: "0.5", "MAKEFLAGS": ""},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text()):
            assert time.time() < deadline and proc.poll() is None, "the run did not log a step"
            time.sleep(0.1)
        # the processes the README's pattern picks (pkill's matching is pgrep's), narrowed to this test's run
        # folder (the other test process may be training); signalled in turn, so that their stacks, dumped into
        # one shared stderr, do not interleave
        pattern = f"python.* -m train.*{run}"
        matched = [int(p) for p in subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()]
        assert len(matched) == 4, matched  # make's shell, the launcher, two ranks
        signal_all(sorted(matched), signal.SIGUSR1, pause=0.5)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert (run / "summary.json").is_file() and " 6 steps x " in out
    lines = err.splitlines()
    in_loop = [line for line in lines if line.strip().startswith("File") and line.endswith(" in train")
               and "train/trainer.py" in line]
    assert len(in_loop) == 2, err[-5000:]  # one frame of train() per rank
    assert any("train/launch.py" in line for line in lines), err[-5000:]
    assert any("torch/distributed/elastic" in line for line in lines), err[-5000:]


@pytest.mark.slow
def test_a_multi_rank_command_that_hangs_fails_its_test_with_every_ranks_stack(generated, tmp_path, gloo_env):
    """The tests' `run_ranks`: a two-rank run past its timeout (here: a minute a step) under a bare torchrun
    (which SIGUSR1 ends, its ranks with it: they are asked first) fails the test with both ranks' stacks, and
    leaves no process behind."""
    manifest, data, _ = generated
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "train",
           "--manifest", str(manifest), "--data", str(data), "--out", str(run)]
    # 20 s: both ranks are in their first step's hook after about 5 s of CPU (measured alone: 5.1 s of 32 s busy)
    with pytest.raises(pytest.fail.Exception, match="timed out after 20 s") as failed:
        run_ranks(cmd, timeout=20, cwd=ROOT, env={**gloo_env, SLOW_ENV: "60"})
    message = str(failed.value)
    assert message.count(" in hook\n") == 2, message[-5000:]  # each rank's main thread, in the slow step
    out = subprocess.run(["ps", "-eww", "-o", "pid,args"], capture_output=True, text=True).stdout
    assert [line for line in out.splitlines() if str(run) in line] == []


def test_an_edited_or_added_source_file_makes_the_corpus_stale(tmp_path):
    raw = write_text_corpus(tmp_path / "raw", num_docs=4)
    config = tiny_config(tmp_path)
    build_corpus(config, config.corpus_dir, log=lambda *_: None)
    assert corpus_is_current(config, config.corpus_dir, config.corpus.source)
    with open(raw / "work_01.txt", "a") as f:
        f.write("\n\nA new paragraph appended to an existing document.\n")
    assert not corpus_is_current(config, config.corpus_dir, config.corpus.source)
    build_corpus(config, config.corpus_dir, log=lambda *_: None)
    assert corpus_is_current(config, config.corpus_dir, config.corpus.source)
    (raw / "work_99.txt").write_text((raw / "work_02.txt").read_text().upper())
    assert not corpus_is_current(config, config.corpus_dir, config.corpus.source)


@pytest.mark.slow
def test_switching_corpora_through_make_reuses_what_each_one_built(tmp_path, env_with_repo):
    """`make train CORPUS=A`, `make train` (the manifest's own source), `make train CORPUS=A` again: each
    corpus has its own work folder, so the third run rebuilds nothing and completes."""
    from common.config import dump_toml
    config = tiny_config(tmp_path / "work")
    config.train.ckpt_every = config.train.eval_every = 8
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(config))
    write_text_corpus(tmp_path / "work" / "raw", num_docs=5, seed=1)
    other = write_text_corpus(tmp_path / "kjv", num_docs=5, seed=2)

    def make(*extra):
        result = subprocess.run(["make", "train", f"MANIFEST={manifest}", "WORKERS=1", *extra], cwd=ROOT,
                                env=env_with_repo, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout
    first = make(f"CORPUS={other}")
    assert f"corpus {other}" in first  # the summary names the corpus it trained on
    make()
    third = make(f"CORPUS={other}")
    assert "is up to date" in third and "complete and verified" in third and "resumed from" in third
    assert f"corpus {other}" in third


@pytest.mark.slow
def test_make_train_does_not_blame_the_generator_it_stopped_when_the_trainer_died(generated, tmp_path,
                                                                                    env_with_repo):
    """The trainer dies (SIGKILL after step 2) while the generator, slowed down, is still writing: make stops
    the generator (whose exit code after a SIGTERM is Ray's, 15 or 134, not 143) and reports the trainer's
    end, not a generator failure."""
    from generate.job import SLOW_ENV as GENERATE_SLOW_ENV
    from train.__main__ import KILL_AT_STEP_ENV
    manifest, _, _ = generated
    data = tmp_path / "epochs"
    log = tmp_path / "epochs.generate.log"  # the generator's log, beside the folder: each run appends
    log.write_text("generate: an earlier run's last line\n")
    result = subprocess.run(["make", "--no-print-directory", "train", f"MANIFEST={manifest}", f"DATA={data}",
                             f"RUN={tmp_path / 'run'}", "WORKERS=1"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**env_with_repo, GENERATE_SLOW_ENV: "1.0", KILL_AT_STEP_ENV: "2"})
    assert result.returncode != 0
    assert "the generator failed" not in result.stderr, result.stderr[-3000:]
    assert not (data / "manifest.json").exists()  # it was stopped before the end
    assert "Error 137" in result.stderr, result.stderr[-3000:]  # the trainer's SIGKILL is what make reports
    earlier, header, ours = log.read_text().partition("\n--- make train, ")
    assert earlier == "generate: an earlier run's last line" and header and "generate: " in ours, log.read_text()[-2000:]


@pytest.mark.slow
def test_with_two_ranks_a_ranks_error_ends_the_command_with_its_exit_code(generated, tmp_path, gloo_env):
    manifest, data, _ = generated
    values = json.loads((data / "manifest.json").read_text())
    copy = tmp_path / "epochs"
    shutil.copytree(data, copy)
    last = values["epochs"][-1]["shards"][-1]["path"]
    raw = bytearray((copy / last).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (copy / last).write_bytes(bytes(raw))
    result = run_ranks([sys.executable, "-m", "train.launch", "--standalone", "--nproc_per_node", "2", "-m",
                        "train", "--manifest", str(manifest), "--data", str(copy), "--out", str(tmp_path / "run")],
                       timeout=300, cwd=ROOT, env=gloo_env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{last}: row group 0" in result.stderr and "is damaged" in result.stderr
    assert "Traceback" not in result.stderr


def flip_inside_row_group(path, group: int = 0, column: str = "input_ids") -> None:
    """Flip one byte in the middle of a row group's column chunk: page data, covered by the page's CRC32."""
    import pyarrow.parquet as pq
    chunk = next(c for c in (pq.ParquetFile(path).metadata.row_group(group).column(i) for i in range(5))
                 if c.path_in_schema.startswith(column))
    raw = bytearray(path.read_bytes())
    raw[chunk.data_page_offset + chunk.total_compressed_size // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.slow
def test_a_damaged_row_group_stops_the_trainer_where_it_is_read_and_a_regenerated_shard_resumes(
        generated, tmp_path, env_with_repo):
    """The default: nothing is hashed up front; a byte flipped in a shard of the first epoch stops the run
    when the step that reads it comes (after the checkpoints before it), naming the shard; the generator
    finds and redoes that shard (its time changed since it was hashed), and --resume ends the run with the
    losses of an undamaged one."""
    manifest, data, _ = generated
    copy = tmp_path / "epochs"
    shutil.copytree(data, copy)
    shard = json.loads((copy / "manifest.json").read_text())["epochs"][0]["shards"][2]  # rows 80..119: steps 10..14
    flip_inside_row_group(copy / shard["path"])
    train = [sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(copy), "--out"]
    result = subprocess.run(train + [str(tmp_path / "run")], cwd=ROOT, env=env_with_repo, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{shard['path']}: row group 0 (rows 80..119 of the stream) is damaged" in errors[0]
    steps = [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 11))  # step 10 read rows 72..79; step 11 would have read the damaged group
    regenerate = subprocess.run([sys.executable, "-m", "generate", "--manifest", str(manifest), "--out", str(copy),
                                 "--workers", "1"], cwd=ROOT, env=env_with_repo, capture_output=True, text=True,
                                timeout=300)
    assert regenerate.returncode == 0, regenerate.stderr[-2000:]
    assert "1 to run" in regenerate.stdout and "redoing it" in regenerate.stdout
    resumed = subprocess.run(train + [str(tmp_path / "run"), "--resume"], cwd=ROOT, env=env_with_repo,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    clean = subprocess.run(train + [str(tmp_path / "clean")], cwd=ROOT, env=env_with_repo, capture_output=True,
                           text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr[-2000:]
    losses = [[json.loads(l)["loss"] for l in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
              for r in ("run", "clean")]
    assert losses[0] == losses[1]


def test_a_process_asked_to_stop_with_its_launcher_tells_its_launcher_from_an_ancestor(env_with_repo):
    """`stop_with_launcher` in a process whose launcher is its parent: asks for SIGTERM at the parent's death
    and runs on; in a process further down (a rank under a plain torchrun, the launcher alive): runs on; in
    one whose launcher is already gone: SIGTERM at once."""
    from common.process import LAUNCHER_ENV
    code = "from common.process import stop_with_launcher; stop_with_launcher(); print('running')"
    run = lambda launcher: subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                          env={**env_with_repo, LAUNCHER_ENV: str(launcher)}, timeout=60)
    assert run(os.getpid()).stdout == "running\n"  # this test's process is its parent
    assert run(os.getppid()).stdout == "running\n"  # an ancestor, alive
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    result = run(gone.pid)
    assert result.returncode == -signal.SIGTERM and result.stdout == ""
