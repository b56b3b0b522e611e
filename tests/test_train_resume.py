"""Exact resume: a run killed with SIGKILL and resumed logs the same per-step losses and
row ranges as an uninterrupted run, bitwise on CPU (docs/design.md, trainer contract); also
when killed right at an epoch boundary, and for a 2-node torchrun on loopback."""
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from common.config import config_from_dict, config_to_dict, dump_toml, load_manifest
from tests.conftest import ROOT, run_ranks
from train.__main__ import KILL_AT_STEP_ENV

pytestmark = pytest.mark.slow


def _train_cmd(manifest, data, run, resume=False):
    cmd = [sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(data), "--out", str(run)]
    return cmd + (["--resume"] if resume else [])


def _losses(run):
    return [(r["step"], r["loss"], r["rows"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def test_sigkill_and_resume_reproduces_the_uninterrupted_run(generated, tmp_path, env_with_repo):
    manifest, data, _ = generated
    full = tmp_path / "full"
    subprocess.run(_train_cmd(manifest, data, full), cwd=ROOT, env=env_with_repo, check=True,
                   capture_output=True, timeout=300)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_train_cmd(manifest, data, killed), cwd=ROOT, env=env_with_repo,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 6):
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # wherever it is: mid-step, mid-checkpoint, mid-log
    proc.wait()
    steps_before = len(metrics.read_text().splitlines())
    assert steps_before < len(_losses(full))  # it really stopped early
    (killed / "checkpoints").mkdir(exist_ok=True)
    stale = killed / "checkpoints" / ".step-99999999.pt.tmp-4194305"  # what a kill mid-save leaves (any pid)
    stale.write_bytes(b"\0" * 4096)
    left = [p for folder in (killed, killed / "checkpoints") for p in folder.glob(".*.tmp-*")]  # the kill's own too
    result = subprocess.run(_train_cmd(manifest, data, killed, resume=True), cwd=ROOT, env=env_with_repo,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    assert not any(p.exists() for p in left) and f"removed {len(left)} temporary file(s)" in result.stdout
    assert _losses(killed) == _losses(full)  # exact float equality, same rows


@pytest.fixture(scope="module")
def boundary_setup(generated, tmp_path_factory):
    """A manifest whose checkpoints fall on the epoch boundary, and its uninterrupted run."""
    manifest, data, _ = generated
    per_epoch = json.loads((data / "manifest.json").read_text())["rows_per_epoch"]
    values = config_to_dict(load_manifest(manifest))
    batch = values["train"]["batch_size"]
    boundary_step = per_epoch // batch  # the last step whose rows all belong to epoch 0
    values["train"].update({"ckpt_every": boundary_step, "eval_every": boundary_step})
    folder = tmp_path_factory.mktemp("boundary")
    path = folder / "boundary.toml"
    path.write_text(dump_toml(config_from_dict(values)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(_train_cmd(path, data, folder / "full"), cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    return path, data, folder / "full", boundary_step, batch, per_epoch


@pytest.mark.parametrize("after", [0, 1])
def test_killed_at_the_epoch_boundary_resumes_exactly(boundary_setup, tmp_path, env_with_repo, after):
    manifest, data, full, boundary_step, batch, per_epoch = boundary_setup
    kill_step = boundary_step + after  # right at the boundary, and the first step past it
    run = tmp_path / "run"
    killed = subprocess.run(_train_cmd(manifest, data, run), cwd=ROOT, env={**env_with_repo, KILL_AT_STEP_ENV: str(kill_step)},
                            capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    logged = _losses(run)
    assert logged[-1][0] == kill_step and logged[-1][2][1] == kill_step * batch
    assert (run / "checkpoints" / f"step-{boundary_step:08d}.pt").is_file()  # rows [0, boundary) all consumed
    assert boundary_step * batch <= per_epoch < (boundary_step + 1) * batch
    result = subprocess.run(_train_cmd(manifest, data, run, resume=True), cwd=ROOT, env=env_with_repo,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints'}/step-{boundary_step:08d}.pt at step {boundary_step}" in result.stdout
    assert _losses(run) == _losses(full)


def test_a_checkpoint_from_before_the_fused_step_resumes_fused_and_exactly(boundary_setup, tmp_path, env_with_repo):
    """Checkpoints written before the optimizer was fused hold `fused: None` in their groups, and torch's
    load_state_dict would bring that back: the resumed run must still take the fused step."""
    manifest, data, full, boundary_step, _, _ = boundary_setup
    run = tmp_path / "run"
    killed = subprocess.run(_train_cmd(manifest, data, run), cwd=ROOT,
                            env={**env_with_repo, KILL_AT_STEP_ENV: str(boundary_step + 1)}, capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    path = run / "checkpoints" / f"step-{boundary_step:08d}.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)
    assert all(group["fused"] for group in state["optimizer"]["param_groups"])
    for group in state["optimizer"]["param_groups"]:  # as an AdamW built without fused=True saved them
        group["fused"], group["foreach"] = None, None
    torch.save(state, path)
    result = subprocess.run(_train_cmd(manifest, data, run, resume=True), cwd=ROOT, env=env_with_repo,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _losses(run) == _losses(full)


def _free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999, where every bind to port 0 in the other test
    processes lands) and above Ray's worker ports (10002-19999): the port is free when checked and released
    before torchrun binds it, so a range nobody else draws from keeps that window safe."""
    draw = random.Random()
    for _ in range(200):
        port = draw.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def _two_nodes(manifest, data, run, env, resume=False, attempts=3):
    """The README's `python -m train.launch --nnodes 2` (torchrun) twice on this machine (node ranks 0 and 1,
    loopback rendezvous). Node 0 hosts the rendezvous store: if its port was taken meanwhile, both go down before
    any trainer starts and are run again on another port."""
    for attempt in range(attempts):
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, "-m", "train.launch", "--nnodes", "2",
                                   "--node_rank", str(node), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
                                   "--master_port", str(port), "-m", "train", "--manifest", str(manifest),
                                   "--data", str(data), "--out", str(run)] + (["--resume"] if resume else []),
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for node in (0, 1)]
        first = procs[0].communicate(timeout=300)[0]
        if "address already in use" in first.lower() and attempt + 1 < attempts:
            procs[1].kill()
            procs[1].communicate()
            continue
        procs[1].communicate(timeout=300)
        return [p.returncode for p in procs], first


def test_two_nodes_on_loopback_train_and_resume(boundary_setup, tmp_path, gloo_env):
    env_with_repo = gloo_env  # two nodes on one machine: one GPU cannot serve both
    manifest, data, _, boundary_step, _, _ = boundary_setup
    reference = tmp_path / "standalone"  # one node, two ranks: the same world
    done = run_ranks([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                      "train", "--manifest", str(manifest), "--data", str(data), "--out", str(reference)],
                     timeout=300, cwd=ROOT, env=env_with_repo)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "two-nodes"
    codes, _ = _two_nodes(manifest, data, run, {**env_with_repo, KILL_AT_STEP_ENV: str(boundary_step + 1)})
    assert all(c != 0 for c in codes)  # both nodes went down at step boundary_step + 1
    assert _losses(run)[-1][0] == boundary_step + 1
    codes, out = _two_nodes(manifest, data, run, env_with_repo, resume=True)
    assert codes == [0, 0], out[-3000:]
    assert f"at step {boundary_step}" in out
    assert _losses(run) == _losses(reference)


def test_existing_run_without_resume_is_refused(generated, tmp_path, env_with_repo):
    manifest, data, _ = generated
    run = tmp_path / "run"  # an interrupted run (killed after its step-4 checkpoint): what a rerun most often meets
    killed = subprocess.run(_train_cmd(manifest, data, run), cwd=ROOT, env={**env_with_repo, KILL_AT_STEP_ENV: "4"},
                            capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL and (run / "checkpoints" / "step-00000004.pt").is_file()
    result = subprocess.run(_train_cmd(manifest, data, run), cwd=ROOT, env=env_with_repo,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "pass --resume" in result.stderr


def test_tensorboard_events_hold_the_metrics_and_a_resumed_run_logs_each_step_once(generated, tmp_path,
                                                                                   env_with_repo):
    """`[train] tensorboard = true`: the scalars of metrics.jsonl as TensorBoard events, read back with
    tensorboard's own reader. A run killed (SIGKILL) after step 3, before its first checkpoint, started again
    from step 0 (was: the killed attempt's points kept beside the new ones), killed after step 6, its checkpoint
    at step 4, and resumed to step 8: every step once in the events, with metrics.jsonl's values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    manifest, data, _ = generated
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(data), "--out", str(run),
           "--set", "train.tensorboard=true", "--set", "train.log_every=1", "--set", "train.ckpt_every=4",
           "--set", "train.eval_every=4", "--set", "train.max_steps=8"]
    for step, resume in (("3", []), ("6", ["--resume"])):
        killed = subprocess.run(cmd + resume, cwd=ROOT, env={**env_with_repo, KILL_AT_STEP_ENV: step},
                                capture_output=True, timeout=300)
        assert killed.returncode == -signal.SIGKILL
    result = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env_with_repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    board = EventAccumulator(str(run / "tensorboard"))
    board.Reload()
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"), ("val/auc", "val_auc")):
        logged = [(r["step"], r[key]) for r in records if key in r]
        events = [(e.step, e.value) for e in board.Scalars(tag)]
        assert [step for step, _ in events] == [step for step, _ in logged], tag
        assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for (_, a), (_, b) in zip(events, logged)), tag


def test_two_gloo_ranks_stopped_by_sigterm_checkpoint_the_same_update_and_resume_to_the_end(built, generated,
                                                                                             tmp_path, gloo_env):
    """A cluster's preemption: SIGTERM to torchrun (`make train NPROC=2`'s launcher), which passes it on to
    its ranks. Both stop after one and the same update, checkpoint it (none was due: ckpt_every is past the
    run), release the run folder and end unfinished (143, no summary.json); --resume goes on from there to
    the end, each step logged once with its rows and temperatures, each evaluation that was due made (the
    losses' equality with an uninterrupted run across a stop: test_two_nodes_on_loopback_train_and_resume)."""
    from train.__main__ import SLOW_ENV
    manifest, data, _ = generated
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "train.launch", "--standalone", "--nproc_per_node", "2", "-m", "train",
           "--manifest", str(manifest), "--data", str(data), "--out", str(run), "--set", "train.log_every=1",
           "--set", "train.ckpt_every=1000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**gloo_env, SLOW_ENV: "0.5"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not ((run / "metrics.jsonl").is_file() and len(_losses(run)) >= 2):
        assert time.time() < deadline and proc.poll() is None, "the run did not log two steps"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    stopped = _losses(run)[-1][0]
    assert f"train: stopped by SIGTERM after step {stopped} of" in out, out[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{stopped:08d}.pt"]
    assert not (run / "summary.json").exists() and not (tmp_path / ".run.lock").exists()
    result = run_ranks(cmd + ["--resume"], timeout=300, cwd=ROOT, env=gloo_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"at step {stopped}" in result.stdout
    data_manifest = json.loads((data / "manifest.json").read_text())
    steps = data_manifest["total_rows"] // built.train.batch_size
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # each once, through the stop
    for r in records:
        assert math.isfinite(r["loss"]) and r["rows"] == [(r["step"] - 1) * 8, r["step"] * 8]
        assert 1.0 <= r["temperature_min"] <= r["temperature_max"] <= 2.0
    assert records[0]["temperature_max"] == 2.0
    evals = [r["step"] for r in records if "val_auc" in r]
    assert evals == sorted({*range(4, steps + 1, 4), steps})  # the stop skipped no evaluation that was due
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["dropped_tail_rows"] == data_manifest["total_rows"] - steps * 8
    assert summary["end"]["step"] == steps and summary["temperature_consumed"][1] == 2.0
    assert "RTD loss" in result.stdout and "recall (replaced tokens)" in result.stdout
    final = torch.load(run / "checkpoints" / f"step-{steps:08d}.pt", weights_only=True)
    corpus_tokenizer = json.loads((built.corpus_dir / "corpus.json").read_text())["tokenizer_sha256"]
    assert final["tokenizer_sha256"] == data_manifest["tokenizer_sha256"] == corpus_tokenizer  # recorded for export
    assert (run / "resolved_manifest.toml").is_file()


def test_ctrl_c_stops_after_the_update_in_flight_with_a_checkpoint_and_a_second_one_at_once(generated, tmp_path,
                                                                                              env_with_repo):
    """Ctrl-C (SIGINT, as a terminal sends it to `make train` and the trainer alike): the run stops after the
    update in flight with a checkpoint of it, says so on one line and ends with 130, no traceback (it was a
    KeyboardInterrupt there, losing every update since the last scheduled checkpoint); --resume goes on from it."""
    from train.__main__ import SLOW_ENV
    manifest, data, _ = generated
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(data), "--out", str(run),
           "--set", "train.log_every=1", "--set", "train.ckpt_every=1000", "--set", "train.max_steps=12"]

    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env_with_repo, SLOW_ENV: "0.5"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not ((run / "metrics.jsonl").is_file() and len(_losses(run)) >= 2):
        assert time.time() < deadline and proc.poll() is None, "the run did not log two steps"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
    stopped = _losses(run)[-1][0]
    assert "train: Ctrl-C: stopping after the update in flight, with a checkpoint" in out, out[-3000:]
    assert f"train: stopped by Ctrl-C after step {stopped} of 12, checkpoint" in out, out[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{stopped:08d}.pt"]
    result = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env_with_repo, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and f"at step {stopped}" in result.stdout, result.stderr[-3000:]
    # the finished run resumed again (`make train` twice): it says so, and its summary (its speed) stands
    summary = (run / "summary.json").read_bytes()
    result = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env_with_repo, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "was already complete at step 12; nothing to train" in result.stdout
    # a speed of nothing (" 0 tokens/s"), not one that ends in 0 ("3010 tokens/s", which failed CI once)
    assert (run / "summary.json").read_bytes() == summary and " 0 tokens/s" not in result.stdout, result.stdout


def test_a_run_that_trains_again_in_a_folder_removes_the_summary_an_earlier_run_left(generated, tmp_path,
                                                                                       env_with_repo):
    """A folder holding a finished run's summary.json but no checkpoint (deleted to save space): a new run there
    starts from step 0, and killed, leaves no summary that a sweep would take for its finished result."""
    manifest, data, _ = generated
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"steps": 8, "planned_steps": 8, "data_fingerprint": "x"}))
    killed = subprocess.run([sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(data),
                             "--out", str(run), "--resume"], cwd=ROOT, env={**env_with_repo, KILL_AT_STEP_ENV: "2"},
                            capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    assert not (run / "summary.json").exists() and (run / "metrics.jsonl").is_file()
