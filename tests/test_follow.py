"""Training that follows the generation (`train --follow`): real generator and trainer processes.

The trainer starts while the generator still writes, waits for each shard it needs, and ends with the
losses of a run over the finished folder; a generator killed mid-way stops the waiting trainer with an
error naming it, and after the generator is rerun the trainer resumes and still ends with those losses.
"""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from generate.job import SLOW_ENV
from tests.conftest import ROOT


def _generator(manifest, out, seconds_per_shard: float | str, env):
    """`seconds_per_shard`: generate.job.SLOW_ENV's value ("S@E": from training epoch E on)."""
    return subprocess.Popen([sys.executable, "-m", "generate", "--manifest", str(manifest), "--out", str(out),
                             "--workers", "1"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**env, SLOW_ENV: str(seconds_per_shard)}, start_new_session=True)


def test_the_generators_test_throttle_can_spare_the_first_epochs():
    """`SLOW_ENV`'s "S@E" (these tests' generators, fast until the epoch a trainer must catch up in)."""
    from common.plan import ShardTask
    from generate.job import slow_seconds
    task = lambda split, epoch: ShardTask(epoch, 0, split, 0, 0, 1, "x", None)
    every = [("valid", 10**6), ("train", 0), ("train", 1), ("train", 2)]
    assert [slow_seconds("1.5", task(*t)) for t in every] == [1.5, 1.5, 1.5, 1.5]
    assert [slow_seconds("1.0@1", task(*t)) for t in every] == [0.0, 0.0, 1.0, 1.0]
    assert slow_seconds("", task("train", 0)) == 0.0


def _trainer(manifest, data, run, env, *extra):
    return subprocess.Popen([sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(data),
                             "--out", str(run), *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def _records(out) -> list[dict]:
    """The generator's records so far; a line it is still writing is skipped (read again on the next poll)."""
    path, records = out / "progress.jsonl", []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def _wait_for(condition, what: str, timeout: float = 120):
    t0 = time.time()
    while not condition():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)


def _losses(run) -> list:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


@pytest.mark.slow
def test_a_trainer_started_during_the_second_epoch_ends_with_the_losses_of_the_finished_folder(
        generated, trained_reference, tmp_path, env_with_repo):
    manifest, _, _ = generated
    data = tmp_path / "epochs"
    gen = _generator(manifest, data, "1.0@1", env_with_repo)  # the first epoch at full speed
    plan = None
    try:
        _wait_for(lambda: (data / "plan.json").is_file(), "plan.json")
        plan = json.loads((data / "plan.json").read_text())
        second = {p for p, _ in plan["shards"]["epochs"][1]}
        _wait_for(lambda: any(r["path"] in second for r in _records(data)), "a shard of the second epoch")
        assert not (data / "manifest.json").exists()
        # verify_shards: each arriving shard hashed too (train.data.hashed_by), the losses unchanged
        trainer = _trainer(manifest, data, tmp_path / "run", env_with_repo, "--follow", "--follow-timeout", "60",
                           "--set", "train.verify_shards=true")
        out, _ = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, out[-3000:]
    finally:
        gen.wait(timeout=300)
    assert gen.returncode == 0, gen.stderr.read()[-3000:]
    done = {r["path"] for r in _records(data)}
    assert second - done == set() and "waiting for the generator" in out  # it caught up and waited
    print(*[line for line in out.splitlines() if line.startswith("train: followed the generation")])
    assert _losses(tmp_path / "run") == trained_reference  # bitwise: the same floats at every step


@pytest.mark.slow
def test_a_dead_generator_stops_the_waiting_trainer_which_resumes_when_generation_does(
        generated, trained_reference, tmp_path, env_with_repo):
    manifest, _, _ = generated
    data, run = tmp_path / "epochs", tmp_path / "run"
    gen = _generator(manifest, data, 1.5, env_with_repo)
    trainer = None
    try:
        _wait_for(lambda: len(_records(data)) >= 3, "three shards")
        trainer = _trainer(manifest, data, run, env_with_repo, "--follow", "--follow-timeout", "6")
        _wait_for(lambda: (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir()), "a checkpoint")
    except BaseException:
        if trainer is not None:
            trainer.kill()
        raise
    finally:
        os.killpg(gen.pid, signal.SIGKILL)  # the generator and its Ray actors, as a crash would
        gen.wait(timeout=60)
    out, _ = trainer.communicate(timeout=300)
    assert trainer.returncode == 2, out[-3000:]
    assert "was not written within 6s" in out and "no longer running" in out and f"pid {gen.pid}" in out, out[-2000:]
    assert not (data / "manifest.json").exists()

    gen = _generator(manifest, data, 0.0, env_with_repo)  # generation resumes; so does the trainer
    try:
        trainer = _trainer(manifest, data, run, env_with_repo, "--follow", "--resume")
        out, _ = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, out[-3000:]
        assert "resumed from" in out
    finally:
        gen.wait(timeout=300)
    assert gen.returncode == 0
    assert _losses(run) == trained_reference


def test_following_a_folder_of_another_generation_is_refused_before_any_step(generated, built):
    """`make train` after a [generate] setting (here the seed) changed: the folder holds the old generation, which
    the generator refuses to overwrite; the trainer refuses it too instead of training on it meanwhile."""
    from train.data import DataError, open_data
    _, data, _ = generated
    assert open_data(data, built, follow=5)["following"] is False  # the same generation: read as finished
    with pytest.raises(DataError, match="another generation"):
        open_data(data, dataclasses.replace(built, seed=built.seed + 1), follow=5)
    open_data(data, dataclasses.replace(built, seed=built.seed + 1))  # without --follow: the folder is trusted


def test_following_a_generation_for_a_longer_run_is_read_as_its_finished_folder_would_be(generated, built, tmp_path):
    """With generate.epochs = 0 the stream's length (train.max_steps x batch_size) is in the generation key: a
    short run following a long one's generation is the same generation, noted and read, as the finished
    folder is; it was refused as another generation, with the advice to remove the folder (at base, 190 GB
    being written)."""
    from common.corpus import load_corpus_meta
    from common.plan import stream_plan
    from common.shards import MANIFEST_FILE
    from train.data import DataError, expected_key, open_data
    _, data, _ = generated
    folder = shutil.copytree(data, tmp_path / "epochs")
    (folder / MANIFEST_FILE).unlink()  # still being generated: read by its plan
    with_steps = lambda config, steps: dataclasses.replace(  # noqa: E731
        config, generate=dataclasses.replace(config.generate, epochs=0),
        train=dataclasses.replace(config.train, max_steps=steps))
    long, short = with_steps(built, 1500), with_steps(built, 100)
    plan = json.loads((folder / "plan.json").read_text())
    plan["total_rows"] = stream_plan(load_corpus_meta(built.corpus_dir)["train"]["rows"], long).total_rows
    plan["generation_key"] = expected_key(long)  # what the long run's generator writes
    (folder / "plan.json").write_text(json.dumps(plan))
    notes = []
    assert open_data(folder, short, follow=5, log=notes.append)["following"] is True
    assert any(f"generated for a stream of {plan['total_rows']:,} rows" in n for n in notes), notes
    with pytest.raises(DataError, match="another generation"):  # another seed is still another generation
        open_data(folder, dataclasses.replace(short, seed=short.seed + 1), follow=5)


def test_the_prior_of_a_finished_folder_needs_no_progress_log(generated, built, tmp_path):
    from train.data import open_data
    _, data, _ = generated
    copy = tmp_path / "epochs"
    shutil.copytree(data, copy)
    (copy / "progress.jsonl").unlink()
    prior = open_data(data, built)["prior"]
    assert 0 < prior < 0.5 and open_data(copy, built)["prior"] == prior


@pytest.mark.slow
def test_sigterm_to_a_trainer_waiting_for_a_shard_stops_it_at_once_naming_its_checkpoint(generated, tmp_path,
                                                                                          env_with_repo):
    """While a step waits for the generator, SIGTERM ends the trainer at once (exit 143, run folder released):
    it cannot checkpoint between updates, so it names the newest checkpoint the rerun goes on from."""
    manifest, _, _ = generated
    data, run = tmp_path / "epochs", tmp_path / "run"
    gen = _generator(manifest, data, "4.0@0", env_with_repo)  # a training shard every 4 s; its 5 steps take ~1 s
    try:
        follow_timeout = 120  # what a trainer that kept waiting for the shard would wait at most
        trainer = _trainer(manifest, data, run, env_with_repo, "--follow", "--follow-timeout", str(follow_timeout))
        _wait_for(lambda: (run / "metrics.jsonl").is_file() and len(_losses(run)) >= 5, "the first shard's steps")
        time.sleep(0.3)  # the trainer now waits for the second shard, due about 3 s from now
        trainer.send_signal(signal.SIGTERM)
        t0 = time.time()
        out, _ = trainer.communicate(timeout=60)
        assert trainer.returncode == 128 + signal.SIGTERM, out[-3000:]
        assert time.time() - t0 < follow_timeout / 4, out[-3000:]  # not the wait's length: stopped at once
    finally:
        os.killpg(gen.pid, signal.SIGKILL)
        gen.wait()
    assert "stopped by SIGTERM while waiting for the shards of step" in out, out[-3000:]
    assert "newest checkpoint (" in out and not (tmp_path / ".run.lock").exists()


def test_a_micro_batch_too_large_is_refused_before_the_trainer_waits_for_a_generator(built, tmp_path, env_with_repo):
    """`make train` on a machine too small for the manifest's micro-batch: the pre-flight reads the vocabulary
    from the corpus and refuses at once, not after the generator has started (here it never does: the trainer
    would wait its --follow-timeout for plan.json)."""
    from common.config import dump_toml
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(built))
    trainer = _trainer(manifest, tmp_path / "epochs", tmp_path / "run",
                       {**env_with_repo, "FAST_ELECTRA_MEMORY_BYTES": str(2**20)}, "--follow", "--follow-timeout", "300")
    out = trainer.communicate(timeout=240)[0]
    assert trainer.returncode == 2 and "by the pre-flight estimate" in out, out[-3000:]
    assert "waiting for the generator" not in out


@pytest.mark.slow
def test_sigterm_while_a_finished_folders_read_is_slow_stops_after_the_update_with_a_checkpoint(
        generated, built, tmp_path, monkeypatch):
    """Only a wait for a generator's shards (--follow) is given up on a SIGTERM; a slow read of a finished folder
    (object storage, a busy network file system) is waited for, and the run stops after that update with its
    checkpoint, as at any other step (it stopped without one, losing up to ckpt_every updates)."""
    import argparse
    import threading
    import torch
    from train import data as train_data, trainer
    manifest, data, _ = generated
    real = train_data.ShardStream.rows

    def slow(self, start, stop):  # step 2's rows, longer than the wait's poll (1 s): the signal comes while it waits
        if start == built.train.batch_size:
            time.sleep(2.5)
        return real(self, start, stop)
    monkeypatch.setattr(train_data.ShardStream, "rows", slow)
    torch.set_num_threads(1)

    def after(step):  # the signal comes while the next step's rows are being read
        if step == 1:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    run = tmp_path / "run"
    args = argparse.Namespace(manifest=str(manifest), data=str(data), out=str(run), resume=False,
                              sets=["train.max_steps=4", "train.ckpt_every=1000", "train.log_every=1"])
    with pytest.raises(trainer.Stopped):
        trainer.train(args, after_step=after)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002.pt"]
    assert _losses(run)[-1][0] == 2


@pytest.mark.slow
def test_sigterm_during_an_update_while_the_next_read_waits_for_the_generator_stops_at_once(generated, tmp_path):
    """The update's own stop (SIGTERM during it): checkpoint, stop line, run folder released, without waiting
    out the read of the next step that waits for a shard not yet written (it held the stop up to
    --follow-timeout, past torchrun's 30 s grace: killed, its lock left behind)."""
    import argparse
    import torch
    from common.shards import MANIFEST_FILE, PROGRESS_FILE
    from train import trainer
    manifest, data, _ = generated
    partial = tmp_path / "epochs"  # a generation under way: the validation shard and one training shard written
    shutil.copytree(data, partial)
    (partial / MANIFEST_FILE).unlink()
    first = sorted(r["path"] for r in _records(data) if r["path"].startswith("epoch-000/"))[0]
    kept = [line for line, r in zip((data / PROGRESS_FILE).read_text().splitlines(), _records(data))
            if r["path"].startswith("valid/") or r["path"] == first]
    (partial / PROGRESS_FILE).write_text("\n".join(kept) + "\n")
    steps = json.loads(kept[-1])["rows"] // 8  # the shard's rows, 8 a step: the read of the step after waits

    def after(step):  # the signal lands while the next update runs, whose next read is the one that waits
        if step == steps - 1:
            os.kill(os.getpid(), signal.SIGTERM)
    torch.set_num_threads(1)
    run = tmp_path / "run"
    args = argparse.Namespace(manifest=str(manifest), data=str(partial), out=str(run), resume=False, follow=True,
                              follow_timeout=60.0, follow_pid=0, sets=["train.ckpt_every=1000"])
    t0 = time.time()
    with pytest.raises(trainer.Stopped):
        trainer.train(args, after_step=after)
    assert time.time() - t0 < args.follow_timeout / 2  # the run itself: ~2 s; the wait it no longer makes: 60 s
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{steps:08d}.pt"]
    assert not (tmp_path / ".run.lock").exists()


def _open_on_rank(rank: int, store: str, manifest: str, data: str, results) -> None:
    """One of two gloo ranks opening the shards as the trainer does (`train.trainer.open_streams`, following)."""
    import argparse
    import torch
    import torch.distributed as dist
    from common.config import load_manifest
    from train.trainer import open_streams
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        args = argparse.Namespace(data=data, follow=True, follow_timeout=30.0, follow_pid=0)
        stream = open_streams(load_manifest(manifest), args, torch.device("cpu"))[0]
        results.put((rank, getattr(stream, "follower", None) is not None))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_that_see_the_folder_differently_all_follow_it(generated, tmp_path):
    """A generator (re)started beside the ranks removes manifest.json while it checks the shards: rank 0 still
    sees it, rank 1 no longer does. Both then read the folder as followed (their collectives differ between the
    two ways: with verify_shards one all-reduces where the other waits at a barrier)."""
    import multiprocessing
    manifest, data, _ = generated
    unfinished = tmp_path / "epochs"  # the same shards, as rank 1 sees the folder
    shutil.copytree(data, unfinished)
    (unfinished / "manifest.json").unlink()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_open_on_rank, args=(rank, str(tmp_path / "store"), str(manifest), str(folder),
                                                        results))
             for rank, folder in ((0, data), (1, unfinished))]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert sorted(results.get(timeout=5) for _ in procs) == [(0, True), (1, True)]


def test_a_followed_shard_missing_or_cut_short_is_named_with_the_remedy(generated, tmp_path):
    """A shard the generator's log records but whose file is gone (removed by hand) or of another size: one
    error naming the file, what is wrong and what to run (was: "has None bytes")."""
    from train.data import DataError, open_data
    from common.config import load_manifest
    manifest, data, _ = generated
    config = load_manifest(manifest)
    followed = tmp_path / "epochs"
    shutil.copytree(data, followed)
    (followed / "manifest.json").unlink()
    first = sorted(r["path"] for r in _records(data) if r["path"].startswith("epoch-000/"))[0]
    (followed / first).unlink()
    stream = open_data(followed, config, follow=5.0, log=lambda _: None)["train"]
    with pytest.raises(DataError, match=rf"{first} is missing, though the generator's log records it \(\d+ bytes\): "
                                        r"run `make generate-epochs`"):
        stream.rows(0, 8)
    shutil.copy(data / first, followed / first)
    with open(followed / first, "ab") as f:
        f.write(b"\0")
    stream = open_data(followed, config, follow=5.0, log=lambda _: None)["train"]
    with pytest.raises(DataError, match=rf"{first} has \d+ bytes, its record in the generator's log says \d+: run"):
        stream.rows(0, 8)


def test_shards_whose_row_groups_exceed_a_ranks_share_are_noted_where_several_ranks_read_them(generated, tmp_path):
    """tiny's shards are one row group each: with 2 ranks each would read the other's rows too, which the
    trainer says at start (naming the setting); one rank, or row groups within a rank's share: no note. The
    followed folder (its plan has no config) says the same from the run's own [generate]."""
    from common.config import load_manifest
    from train.data import open_data
    manifest, data, _ = generated
    config = load_manifest(manifest)
    for folder, follow in ((data, 0.0), (tmp_path / "epochs", 5.0)):
        if follow:
            shutil.copytree(data, folder)
            (folder / "manifest.json").unlink()
        notes = []
        open_data(folder, config, follow, log=notes.append, world=2)
        said = [n for n in notes if "row groups hold" in n]
        share = config.train.batch_size // 2
        assert len(said) == 1 and f"more than a rank's {share:,} of a batch" in said[0], notes
        assert "rows_per_row_group dividing" in said[0]
        notes.clear()
        open_data(folder, config, follow, log=notes.append, world=1)
        assert not [n for n in notes if "row groups hold" in n]
    small = tmp_path / "small"  # a finished folder whose generation set 4-row groups (its manifest says so)
    shutil.copytree(data, small)
    made = json.loads((small / "manifest.json").read_text())
    made["config"]["generate"]["rows_per_row_group"] = 4
    (small / "manifest.json").write_text(json.dumps(made))
    notes = []
    open_data(small, config, 0.0, log=notes.append, world=2)
    assert not [n for n in notes if "row groups hold" in n], notes
