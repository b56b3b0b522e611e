"""Exact resume: a run killed with SIGKILL and resumed logs the same per-step losses and
row ranges as an uninterrupted run, bitwise on CPU (DESIGN.md, trainer contract)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

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
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    steps_before = len(metrics.read_text().splitlines())
    assert steps_before < len(_losses(full))  # it really stopped early
    result = subprocess.run(_train_cmd(manifest, data, killed, resume=True), cwd=ROOT, env=env_with_repo,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    assert _losses(killed) == _losses(full)  # exact float equality, same rows


def test_existing_run_without_resume_is_refused(generated, tmp_path, env_with_repo):
    manifest, data, _ = generated
    run = tmp_path / "run"
    subprocess.run(_train_cmd(manifest, data, run), cwd=ROOT, env=env_with_repo, check=True,
                   capture_output=True, timeout=300)
    result = subprocess.run(_train_cmd(manifest, data, run), cwd=ROOT, env=env_with_repo,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "pass --resume" in result.stderr
