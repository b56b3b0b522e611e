"""Every stage's data on object storage: a local S3-compatible server (moto's server mode, started here)
and the real client path (pyarrow's S3 client in the CLIs, their Ray actors and the trainer).

corpus -> aux -> generate (2 Ray workers) -> train with every data folder on s3://; the shards' bytes are
those of the local run; a generator killed mid-upload leaves no partial object, and a rerun gives the same
bytes; a rank's ranged reads fetch about 1/W of the stream.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from common.config import config_from_dict, config_to_dict, dump_toml
from common.storage import UPLOAD_RATE_ENV
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
pytest.importorskip("moto")
BUCKET = "fast-electra-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on a free port, a bucket in it, and the environment that points clients at it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "FAST_ELECTRA_CACHE": str(tmp_path_factory.mktemp("cache"))}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3
    client = boto3.client("s3")
    t0 = time.time()
    while True:
        try:
            client.create_bucket(Bucket=BUCKET)
            break
        except Exception:  # noqa: BLE001 - the server is still starting
            assert time.time() - t0 < 30, "moto server did not start"
            time.sleep(0.2)
    yield client, env
    server.terminate()
    server.wait(timeout=30)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _run(args, env, timeout=300):
    result = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result


def _objects(client, prefix: str) -> dict[str, dict]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"][len(prefix):]: o for page in pages for o in page.get("Contents", [])}


def _sha(client, key: str) -> str:
    import hashlib
    return hashlib.sha256(client.get_object(Bucket=BUCKET, Key=key)["Body"].read()).hexdigest()


@pytest.fixture(scope="module")
def remote_inputs(s3, generated):
    """The corpus and the aux model built by their CLIs straight to s3:// (the session's manifest)."""
    client, env = s3
    manifest, _, _ = generated
    _run(["corpus", "--manifest", str(manifest), "--out", f"s3://{BUCKET}/corpus", "--workers", "1"], env)
    _run(["auxiliary", "--manifest", str(manifest), "--corpus", f"s3://{BUCKET}/corpus", "--out", f"s3://{BUCKET}/aux"],
         env)
    return manifest


def test_corpus_generate_and_train_on_s3_write_the_local_bytes_and_losses(s3, remote_inputs, generated, tmp_path,
                                                                           trained_reference):
    client, env = s3
    manifest, local_epochs, _ = generated
    assert "corpus.json" in _objects(client, "corpus/") and "aux.json" in _objects(client, "aux/")
    _run(["generate", "--manifest", str(manifest), "--corpus", f"s3://{BUCKET}/corpus", "--aux",
          f"s3://{BUCKET}/aux/aux.pt", "--out", f"s3://{BUCKET}/epochs", "--workers", "2"], env)
    local = json.loads((local_epochs / "manifest.json").read_text())
    remote = json.loads(client.get_object(Bucket=BUCKET, Key="epochs/manifest.json")["Body"].read())
    assert remote["generation_key"] == local["generation_key"]
    shards = [s for e in local["epochs"] for s in e["shards"]] + local["valid"]["shards"]
    assert {s["path"]: _sha(client, f"epochs/{s['path']}") for s in shards} == {s["path"]: s["sha256"] for s in shards}
    assert not (local_epochs.parent / "s3:").exists() and not (ROOT / "s3:").exists()  # no URI taken as a folder

    run = tmp_path / "run"
    _run(["train", "--manifest", str(manifest), "--data", f"s3://{BUCKET}/epochs", "--corpus",
          f"s3://{BUCKET}/corpus", "--out", str(run)], env)
    losses = [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    assert losses == trained_reference


def test_a_generator_killed_mid_upload_leaves_no_partial_object_and_a_rerun_gives_the_same_bytes(
        s3, remote_inputs, generated):
    client, env = s3
    manifest, local_epochs, _ = generated
    prefix, out = "killed/", f"s3://{BUCKET}/killed"
    args = ["generate", "--manifest", str(manifest), "--corpus", f"s3://{BUCKET}/corpus", "--aux",
            f"s3://{BUCKET}/aux/aux.pt", "--out", out, "--workers", "1"]
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env, UPLOAD_RATE_ENV: "2000"})
    records = lambda: [k for k in _objects(client, prefix) if k.startswith("progress.jsonl.d/")]
    t0 = time.time()
    while len(records()) < 2:
        assert time.time() - t0 < 180 and proc.poll() is None, "the generator did not write two shards"
        time.sleep(0.2)
    time.sleep(1.0)  # a shard of ~3 KB takes ~1.5 s at 2 KB/s: the next one is mid-upload now
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    objects = _objects(client, prefix)
    assert "manifest.json" not in objects
    shards = {k: o for k, o in objects.items() if k.endswith(".parquet")}
    recorded = {json.loads(client.get_object(Bucket=BUCKET, Key=prefix + k)["Body"].read())["path"]: None
                for k in objects if k.startswith("progress.jsonl.d/")}
    local = json.loads((local_epochs / "manifest.json").read_text())
    expected = {s["path"]: s for e in local["epochs"] for s in e["shards"]} | \
        {s["path"]: s for s in local["valid"]["shards"]}
    assert 2 <= len(shards) < len(expected)
    assert set(shards) == set(recorded)  # nothing visible beyond the finished shards: no partial, no temporary key
    for key, obj in shards.items():  # and each visible one is whole
        assert obj["Size"] == expected[key]["bytes"] and _sha(client, prefix + key) == expected[key]["sha256"]

    result = _run(args, env)
    assert f"{len(shards)} already done" in result.stdout
    assert {p: _sha(client, prefix + p) for p in expected} == {p: s["sha256"] for p, s in expected.items()}


def test_a_rank_fetches_about_its_share_of_the_stream_with_ranged_reads(s3, remote_inputs):
    """Row groups of 32 rows, batches of 64 on 2 ranks: rank 0 fetches about half of what one rank of 1 does
    (plus every shard's footer)."""
    from common.config import load_manifest
    from common.storage import location
    from train.data import load_data_manifest, rank_slice, remote_parquet, training_stream
    _, env = s3
    values = config_to_dict(load_manifest(remote_inputs))
    values["generate"].update(rows_per_row_group=32, rows_per_shard=256, rows_per_epoch=512, epochs=2)
    values["train"]["batch_size"] = 64
    manifest = remote_inputs.parent / "row-groups.toml"
    manifest.write_text(dump_toml(config_from_dict(values)))
    out = f"s3://{BUCKET}/row-groups"
    _run(["generate", "--manifest", str(manifest), "--corpus", f"s3://{BUCKET}/corpus", "--aux",
          f"s3://{BUCKET}/aux/aux.pt", "--out", out, "--workers", "1"], env)
    config = load_manifest(manifest)
    data, _ = load_data_manifest(out, config)
    fetched = {}
    for world in (1, 2):
        stream = training_stream(out, data)
        steps = stream.num_rows // config.train.batch_size
        for step in range(steps):
            stream.rows(*rank_slice(step, config.train.batch_size, 0, world))
        fetched[world] = stream.bytes_fetched
        # the GETs fetched exactly the footers and the column chunks of the row groups holding its rows
        assert stream.bytes_fetched == stream.bytes_read, (world, stream.bytes_fetched, stream.bytes_read)
    total = sum(s["bytes"] for e in data["epochs"] for s in e["shards"])
    assert total * 0.95 <= fetched[1] <= total  # one rank of one reads every byte but the leading magic
    # every rank reads each shard's footer; of the row groups, its own: half of them on 2 ranks
    footers = sum(remote_parquet(location(out) / sh["path"], lambda n: None)[1].serialized_size + 8
                  for e in data["epochs"] for sh in e["shards"])
    share = (fetched[2] - footers) / (fetched[1] - footers)
    print(f"ranged reads: rank 0 of 1 fetched {fetched[1]} bytes, rank 0 of 2 {fetched[2]} "
          f"({fetched[2] / fetched[1]:.3f}); footers {footers}; row-group bytes 2 vs 1 rank: {share:.3f}")
    assert 0.45 < share < 0.55 and fetched[2] / fetched[1] < 0.7, fetched
