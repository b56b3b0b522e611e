"""`make sweep`: several trainer configs over the same dumped shards. The shards' sha256 and
mtimes are unchanged afterwards and the generator never ran (issue: sweep reuse)."""
import json
import subprocess

import pytest

from common.config import config_from_dict, config_to_dict, dump_toml, load_manifest
from common.io import sha256_file
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _snapshot(folder):
    """Every file of the data folder (shards, manifest, plan, progress journal): sha256 and mtime."""
    return {str(p.relative_to(folder)): (sha256_file(p), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def _sweep_manifest(manifest, tmp_path, **train):
    """The session's manifest with 6 updates, `train`, and a grid of two learning rates; (its path, its values)."""
    values = config_to_dict(load_manifest(manifest))
    values["train"].update({"max_steps": 6, **train})
    values["sweep"] = {"train": {"lr": [1e-3, 4e-3]}}
    path = tmp_path / "sweep.toml"
    path.write_text(dump_toml(config_from_dict(values)))
    return path, values


def test_make_sweep_reuses_the_shards_and_never_runs_the_generator(generated, tmp_path, env_with_repo):
    if not (ROOT / ".venv" / ".installed").is_file():
        pytest.skip("`make sweep` needs the project venv; run the suite with `make test`")
    manifest, data, _ = generated
    sweep_manifest, _ = _sweep_manifest(manifest, tmp_path, eval_every=3, ckpt_every=3)
    before = _snapshot(data)
    assert any(name.endswith(".parquet") for name in before) and "manifest.json" in before

    out = tmp_path / "sweep"
    result = subprocess.run(["make", "--no-print-directory", "sweep", f"MANIFEST={sweep_manifest}", f"DATA={data}",
                             f"SWEEP={out}", "NPROC=1"], cwd=ROOT, env=env_with_repo, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "-m generate" not in result.stdout and "generate:" not in result.stdout  # make did not call it
    assert _snapshot(data) == before  # no shard, manifest or journal rewritten, not even touched

    summary = json.loads((out / "sweep.json").read_text())
    assert [r["grid"] for r in summary["runs"]] == [{"lr": 1e-3}, {"lr": 4e-3}]
    assert all(r["status"] == "done" and r["steps"] == 6 for r in summary["runs"])
    for r in summary["runs"]:  # each run trained with its own lr, on the same data
        resolved = load_manifest(f"{r['run_dir']}/resolved_manifest.toml")
        assert resolved.train.lr == r["grid"]["lr"] and resolved.sweep.train == {}
    end_losses = [r["end"]["loss"] for r in summary["runs"]]
    assert end_losses[0] != end_losses[1]
    table = (out / "sweep.md").read_text()
    assert table.count("| 0.001 |") == 1 and table.count("| 0.004 |") == 1
    assert summary["best_by_val_auc"] in ("lr=0.001", "lr=0.004")
    # a DATA= folder the generation has not finished: the way to finish it names that folder, not the default
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    result = subprocess.run(["make", "--no-print-directory", "sweep", f"MANIFEST={sweep_manifest}",
                             f"DATA={unfinished}", f"SWEEP={out}"], cwd=ROOT, env=env_with_repo, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode != 0 and f"`make generate-epochs DATA={unfinished}`" in result.stderr, result.stderr


def test_a_killed_sweep_stops_its_trainer_with_a_checkpoint_and_only_results_of_these_shards_and_settings_stand(
        generated, tmp_path, env_with_repo):
    """SIGKILL to the sweep alone: its running trainer (torchrun, then its rank) gets SIGTERM, checkpoints and
    lets go of its run folder instead of training on beside the rerun. The rerun resumes it; a second rerun
    finds both finished; one with other [train] settings does not take the old results for its own."""
    import os
    import signal
    import sys
    import time
    from train.__main__ import SLOW_ENV
    manifest, data, _ = generated
    sweep_manifest, values = _sweep_manifest(manifest, tmp_path, log_every=1, eval_every=3, ckpt_every=1000)
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "experiments.sweep", "--manifest", str(sweep_manifest), "--data", str(data),
           "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env_with_repo, SLOW_ENV: "0.4"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    first, lock = out / "lr=0.001", out / ".lr=0.001.lock"
    deadline = time.time() + 120
    while not ((first / "metrics.jsonl").is_file() and len((first / "metrics.jsonl").read_text().splitlines()) >= 2):
        assert time.time() < deadline and proc.poll() is None, "the first run did not log two steps"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    while lock.exists() and time.time() < deadline + 60:
        time.sleep(0.1)
    assert not lock.exists()  # the trainer stopped by itself, not left training
    assert list((first / "checkpoints").glob("step-*.pt")) and not (first / "summary.json").exists()

    rerun = lambda *sets: subprocess.run(cmd + list(sets), cwd=ROOT, env=env_with_repo, capture_output=True,
                                         text=True, timeout=600)
    result = rerun()
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "resumed from" in result.stdout
    result = rerun()
    assert result.returncode == 0 and result.stdout.count("already finished") == 2, result.stdout[-3000:]
    values["train"]["warmup_steps"] += 1  # the base settings edited: the old results are not this sweep's
    sweep_manifest.write_text(dump_toml(config_from_dict(values)))
    result = rerun()
    assert result.returncode == 1 and "already finished" not in result.stdout, result.stdout[-3000:]
    assert "train.warmup_steps" in result.stderr
    assert [r["status"] for r in json.loads((out / "sweep.json").read_text())["runs"]] == ["failed (exit 2)"] * 2
    # --set (make's CORPUS= and AUX= pass their work folder so) reaches every run's config: the edit undone
    result = rerun("--set", f"train.warmup_steps={values['train']['warmup_steps'] - 1}")
    assert result.returncode == 0 and result.stdout.count("already finished") == 2, result.stdout[-3000:]


@pytest.mark.slow
def test_ctrl_c_stops_the_sweep_after_its_trainer_checkpoints(generated, tmp_path, env_with_repo):
    """Ctrl-C reaches the sweep and its trainer alike (one process group, as a terminal sends it): the trainer
    stops after the update in flight with a checkpoint, the sweep waits for it (it killed the trainer, on its own
    KeyboardInterrupt) and ends with 130 without starting the next run."""
    import os
    import signal
    import sys
    import time
    from train.__main__ import SLOW_ENV
    manifest, data, _ = generated
    sweep_manifest, _ = _sweep_manifest(manifest, tmp_path, log_every=1, ckpt_every=1000)
    out = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.sweep", "--manifest", str(sweep_manifest), "--data",
                             str(data), "--out", str(out)], cwd=ROOT, env={**env_with_repo, SLOW_ENV: "0.4"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics, deadline = out / "lr=0.001" / "metrics.jsonl", time.time() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert time.time() < deadline and proc.poll() is None, "the first run did not log two steps"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130 and "Traceback" not in output, output[-3000:]
    assert "sweep: stopped by Ctrl-C" in output and "train: stopped by Ctrl-C after step" in output, output[-3000:]
    stopped = len(metrics.read_text().splitlines())
    assert [p.name for p in (out / "lr=0.001" / "checkpoints").iterdir()] == [f"step-{stopped:08d}.pt"]
    assert not (out / "lr=0.004").exists()


def test_a_diverged_run_is_never_the_best_and_an_unfinished_summary_is_no_finished_run(generated, tmp_path):
    import math
    from experiments.sweep import best_run, finished
    rows = [{"name": "lr=0.01", "end": {"auc": math.nan}}, {"name": "lr=0.001", "end": {"auc": 0.7}},
            {"name": "lr=0.0001", "end": {"auc": 0.6}}, {"name": "failed"}]
    assert best_run(rows) == "lr=0.001"  # max() kept the nan in first place
    assert best_run(rows[:1]) is None
    manifest, _, _ = generated
    config = load_manifest(manifest)
    run = tmp_path / "run"
    run.mkdir()
    (run / "resolved_manifest.toml").write_text(dump_toml(config))
    for steps, planned, done in ((8, 8, True), (5, 8, False)):  # a run cut short (a deadline) is not finished
        (run / "summary.json").write_text(json.dumps({"data_fingerprint": "f", "steps": steps, "planned_steps": planned}))
        assert finished(run, config, "f") is done
    # what a resume may change (its updates the same up to rounding) does not make it another combination's run
    (run / "summary.json").write_text(json.dumps({"data_fingerprint": "f", "steps": 8, "planned_steps": 8}))
    other = load_manifest(manifest, ["train.micro_batch=4", "train.compile=\"off\"", "corpus.source=\"/mnt/raw\""])
    assert finished(run, other, "f") and not finished(run, load_manifest(manifest, ["train.lr=0.5"]), "f")


def test_a_finished_run_given_to_reuse_stands_for_the_combination_with_its_settings(generated, tmp_path, monkeypatch):
    """`make sweep` passes the default run (`--reuse`): where it finished on these shards with one combination's
    settings (make train's own run and the grid's value of the manifest's lr), that combination is not trained
    again; a run of other settings is not taken for one. (The trainer is not under test: its calls are counted.)"""
    import experiments.sweep as sweep_module
    from train.data import load_data_manifest
    manifest, data, _ = generated
    sweep_manifest, values = _sweep_manifest(manifest, tmp_path)
    config = load_manifest(sweep_manifest)
    _, fingerprint = load_data_manifest(data, config)

    def finished_run(folder, lr):  # what a finished trainer leaves: its resolved settings and its summary
        folder.mkdir(parents=True)
        run_values = {**values, "train": {**values["train"], "lr": lr}}
        (folder / "resolved_manifest.toml").write_text(dump_toml(config_from_dict(run_values)))
        (folder / "summary.json").write_text(json.dumps({"data_fingerprint": fingerprint, "steps": 6,
                                                         "planned_steps": 6, "end": {"auc": 0.7, "loss": 0.3}}))
        return folder
    default, other = finished_run(tmp_path / "default", 1e-3), finished_run(tmp_path / "other", 2e-3)
    trained = []
    monkeypatch.setattr(sweep_module, "run_one", lambda run_dir, *a: (trained.append(run_dir.name), 1)[1])
    rows = sweep_module.sweep(config, data, tmp_path / "sweep", 1, log=lambda *_: None, reuse=(other, default))
    assert trained == ["lr=0.004"], trained  # lr=0.001 is the default run's; 0.004 is no one's
    assert [(r["grid"], r["status"], r["run_dir"]) for r in rows] == [
        ({"lr": 1e-3}, "done", str(default)), ({"lr": 4e-3}, "failed (exit 1)", str(tmp_path / "sweep" / "lr=0.004"))]
    assert not (tmp_path / "sweep" / "lr=0.001").exists()
