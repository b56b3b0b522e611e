"""Determinism, resume and fault tolerance of the Ray generator (real Ray, real processes).

A shard's bytes depend only on (corpus, tokenizer, aux, manifest, seed, epoch, shard):
the same with 1 or 2 workers, after a SIGKILL and a rerun, after a worker dies mid-task,
and after a damaged shard is detected and regenerated.
"""
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from common.config import config_from_dict, config_to_dict, dump_toml
from common.io import sha256_file
from generate.job import FAIL_ALWAYS_ENV, FAIL_ONCE_ENV, HANG_ENV, SLOW_ENV
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _cmd(manifest, out, workers):
    return [sys.executable, "-m", "generate", "--manifest", str(manifest), "--out", str(out), "--workers", str(workers)]


def _run(manifest, out, workers, env=None):
    result = subprocess.run(_cmd(manifest, out, workers), cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _hashes(out):
    manifest = json.loads((out / "manifest.json").read_text())
    shards = [s for e in manifest["epochs"] for s in e["shards"]] + manifest["valid"]["shards"]
    assert all(sha256_file(out / s["path"]) == s["sha256"] for s in shards)
    return {s["path"]: s["sha256"] for s in shards}


@pytest.fixture(scope="module")
def reference(generated, tmp_path_factory):
    """The uninterrupted run every test here compares with: a copy of the session's generated folder (2 Ray
    workers), which the tests below may damage and redo."""
    manifest, out, _ = generated
    folder = tmp_path_factory.mktemp("resume")
    shutil.copytree(out, folder / "uninterrupted")
    return manifest, folder, _hashes(folder / "uninterrupted")


def test_one_worker_writes_the_same_bytes_as_two(reference):
    manifest, folder, expected = reference
    _run(manifest, folder / "one_worker", 1)
    assert _hashes(folder / "one_worker") == expected


def test_two_tasks_in_flight_per_actor_write_the_same_bytes(reference, built):
    """The GPU actors' pipelining (next shard's masking and aux forward while the last is written),
    forced on this CPU: same bytes, same generation key."""
    manifest, folder, expected = reference
    values = config_to_dict(built)
    values["generate"]["tasks_in_flight"] = 2
    pipelined = folder / "in_flight.toml"
    pipelined.write_text(dump_toml(config_from_dict(values)))
    _run(pipelined, folder / "in_flight", 1)
    assert _hashes(folder / "in_flight") == expected
    key = lambda out: json.loads((out / "plan.json").read_text())["generation_key"]
    assert key(folder / "in_flight") == key(folder / "uninterrupted")
    spans = sorted((r["started_at"], r["finished_at"]) for r in map(json.loads, (folder / "in_flight" / "progress.jsonl")
                                                                      .read_text().splitlines()))
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))  # one actor, two shards at once


def test_sigkill_halfway_then_rerun_equals_uninterrupted(reference):
    manifest, folder, expected = reference
    out = folder / "killed"
    proc = subprocess.Popen(_cmd(manifest, out, 2), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, SLOW_ENV: "0.4"}, start_new_session=True)
    progress = out / "progress.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (progress.is_file() and len(progress.read_text().splitlines()) >= 3):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver, its Ray cluster and the actors
    proc.wait()
    done_before = len(progress.read_text().splitlines())
    assert not (out / "manifest.json").exists() and 3 <= done_before < len(expected)
    # whatever carries a final name is complete: every recorded shard verifies
    for line in progress.read_text().splitlines():
        record = json.loads(line)
        assert sha256_file(out / record["path"]) == record["sha256"]
    result = _run(manifest, out, 1)
    assert f"{done_before} already done" in result.stdout
    assert "hashed" not in result.stdout  # the killed run's shards are trusted by the stamps of their records
    assert _hashes(out) == expected
    assert not list(out.rglob(".*.tmp-*"))


def test_worker_dying_mid_task_is_retried_with_identical_output(reference, tmp_path):
    manifest, folder, expected = reference
    marker = tmp_path / "killed-once"
    _run(manifest, folder / "fault", 2, env={FAIL_ONCE_ENV: str(marker)})
    assert marker.is_file() and "killed pid" in marker.read_text()  # a worker process really died
    assert _hashes(folder / "fault") == expected


def test_a_shard_whose_actor_never_returns_runs_again_on_an_idle_one_with_identical_output(reference, tmp_path):
    """A task that never returns (its node lost: Ray restarts the actor only where there is room, which a
    cluster of busy GPUs lacks) left the driver waiting forever, silently. Once nothing else is left to start,
    it runs again on an idle actor, said on stdout; the folder is the uninterrupted one, a record per shard."""
    manifest, folder, expected = reference
    marker, out = tmp_path / "hung-once", folder / "hung"
    result = _run(manifest, out, 2, env={HANG_ENV: str(marker)})
    hung = marker.read_text().split(" on ")[-1].strip()
    assert marker.read_text().startswith("hung pid"), marker.read_text()
    assert re.search(rf"generate: shard {re.escape(hung)} has run \d+ s on its actor, the shards so far \d+ s .*"
                     rf"running it on an idle actor too", result.stdout), result.stdout[-3000:]
    assert _hashes(out) == expected
    records = [json.loads(line)["path"] for line in (out / "progress.jsonl").read_text().splitlines()]
    assert sorted(records) == sorted(expected) and len(records) == len(set(records))


def test_damaged_shard_is_detected_and_regenerated(reference, tmp_path):
    manifest, folder, expected = reference
    out = shutil.copytree(folder / "uninterrupted", tmp_path / "damaged")  # the reference stays as it was made
    victim = sorted(expected)[1]
    data = bytearray((out / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / victim).write_bytes(bytes(data))
    result = _run(manifest, out, 1)
    assert "1 to run" in result.stdout and "hashed 1 shard(s) again" in result.stdout  # its time changed
    assert f"{out / victim} is missing or damaged (size or sha256 differ from its record); redoing it" in result.stdout
    assert _hashes(out) == expected
    # complete and verified: nothing to do, no Ray; a manifest that differs in what the shards do not depend
    # on (the trainer's learning rate) leaves the folder's resolved manifest, the one it was made from
    from common.config import dump_toml, load_manifest
    made_from = (out / "resolved_manifest.toml").read_bytes()
    config = load_manifest(manifest)
    other = tmp_path / "other_lr.toml"
    other.write_text(dump_toml(dataclasses.replace(config, train=dataclasses.replace(config.train, lr=0.005))))
    result = _run(other, out, 1)
    assert "complete and verified" in result.stdout
    assert (out / "resolved_manifest.toml").read_bytes() == made_from


def test_a_folder_made_on_two_device_models_says_so_and_lists_them(reference, tmp_path):
    """Each record names the model its shard's kernels came from (GPU and compute capability, or the CPU
    kernels' vector instructions). A folder of one kind made on two models (a cluster of mixed nodes) is
    allowed, its manifest lists both and the run says so; no shard is redone (no Ray started)."""
    from common.config import load_manifest
    from common.checkpoint import AUX_FILE
    from generate.generator import generate
    manifest, folder, expected = reference
    out = shutil.copytree(folder / "uninterrupted", tmp_path / "mixed")
    progress = out / "progress.jsonl"
    records = [json.loads(line) for line in progress.read_text().splitlines()]
    (model,) = {r["device_model"] for r in records}
    assert model.startswith("CPU (") and model.endswith(" kernels)") or " (sm_" in model, model
    other = "CPU (AVX2 kernels)" if model != "CPU (AVX2 kernels)" else "CPU (AVX512 kernels)"
    progress.write_text("".join(json.dumps({**r, "device_model": other} if i % 2 else r) + "\n"
                                for i, r in enumerate(records)))  # every other shard as another machine wrote it
    (out / "manifest.json").unlink()
    shards = sorted(out.rglob("*.parquet"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    config, logged = load_manifest(manifest), []
    written = generate(config, out, config.corpus_dir, config.aux_dir / AUX_FILE, 1, log=logged.append)
    assert written["device_models"] == sorted([model, other]) and _hashes(out) == expected
    assert [p.stat().st_mtime_ns for p in shards] == stamps  # none written again
    assert any("0 to run" in line for line in logged), logged
    (note,) = [line for line in logged if "device models" in line]
    assert "made on 2 device models" in note and model in note and other in note


def test_shards_of_another_device_are_not_mixed_in(reference, tmp_path):
    """A folder whose finished shards came from GPU actors (bf16) is not completed by CPU actors (fp32),
    nor the other way round: the run stops before touching a shard; --force redoes those shards here."""
    manifest, folder, expected = reference
    out = tmp_path / "from_gpu"
    shutil.copytree(folder / "uninterrupted", out)
    progress = out / "progress.jsonl"
    records = [json.loads(line) for line in progress.read_text().splitlines()]
    (here,) = {r["device"] for r in records}  # cpu, or cuda on a GPU machine
    other = "cpu" if here == "cuda" else "cuda"
    progress.write_text("".join(json.dumps({**r, "device": other}) + "\n" for r in records))  # as the other kind writes them
    victim = out / sorted(expected)[0]
    victim.unlink()                                            # one shard left to do
    kept = lambda: {p: p.stat().st_mtime_ns for p in [*out.rglob("*.parquet"), progress, out / "manifest.json"]}
    before = kept()
    result = subprocess.run(_cmd(manifest, out, 1), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert f"made on {other}" in result.stderr and f"would use {here}" in result.stderr and "--force" in result.stderr
    assert kept() == before and not victim.exists()  # shards, progress and manifest untouched
    result = subprocess.run(_cmd(manifest, out, 1) + ["--force"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"0 already done, {len(expected)} to run" in result.stdout
    assert _hashes(out) == expected
    made = json.loads((out / "manifest.json").read_text())
    from generate.job import libraries
    assert made["devices"] == [here] and made["libraries"] == [libraries()]  # torch, numpy and pyarrow's versions


def test_a_folder_of_two_device_kinds_with_no_shard_left_is_refused_not_finished(reference, tmp_path):
    """A --force switch to another device kind killed after its last shard but before its manifest: every shard
    is there and verified, yet they come from two kinds: refused (it was given a manifest of both); --force
    redoes the other kind's."""
    manifest, folder, _ = reference
    out = tmp_path / "mixed"
    shutil.copytree(folder / "uninterrupted", out)
    (out / "manifest.json").unlink()
    progress = out / "progress.jsonl"
    records = [json.loads(line) for line in progress.read_text().splitlines()]
    (here,) = {r["device"] for r in records}
    other = "cpu" if here == "cuda" else "cuda"
    progress.write_text("".join(json.dumps({**r, "device": other if i == 1 else here}) + "\n"
                                for i, r in enumerate(records)))
    result = subprocess.run(_cmd(manifest, out, 1), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and f"made on {other}" in result.stderr, result.stderr[-3000:]
    assert "--force" in result.stderr and not (out / "manifest.json").exists()  # --force: the test above


def test_an_actor_dying_past_rays_restarts_stops_the_run_with_one_line_naming_its_shard(reference, tmp_path):
    """Killed for memory at every shard, say: Ray restarts it 3 times, then the run ends with one line (exit 1,
    not a user's error), not Ray's ActorDiedError traceback."""
    manifest, _, _ = reference
    result = subprocess.run(_cmd(manifest, tmp_path / "epochs", 1), cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, FAIL_ALWAYS_ENV: "1"})
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "the generation actor working on valid/shard-00000.parquet died 4 times" in errors[0] \
        and "killed for memory?" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
