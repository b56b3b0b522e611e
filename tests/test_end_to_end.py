"""The whole chain on a corpus the test writes: Ray generation with 2 CPU workers,
then `torchrun` with 2 gloo ranks. Checks that manifest, shards and metrics agree."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from common.config import dump_toml
from common.corpus import load_split
from tests.conftest import temperature_at
from common.io import sha256_file
from common.shards import SHARD_SCHEMA, list_column, read_parquet
from tests.conftest import ROOT, run_ranks

pytestmark = pytest.mark.slow


def test_generation_manifest_matches_the_shards(built, generated):
    _, out, result = generated
    assert "generate: " in result.stdout and "tokens/s" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    train_rows = load_split(built.corpus_dir, "train")
    assert len(manifest["epochs"]) == 2
    assert manifest["total_rows"] == 2 * len(train_rows) == sum(e["rows"] for e in manifest["epochs"])
    assert manifest["schema"] == [{"name": f.name, "type": str(f.type)} for f in SHARD_SCHEMA]
    next_index = 0
    for epoch in manifest["epochs"]:
        replaced = 0
        for shard in epoch["shards"]:
            path = out / shard["path"]
            assert path.stat().st_size == shard["bytes"] and sha256_file(path) == shard["sha256"]
            table = read_parquet(path, SHARD_SCHEMA)
            stream = table.column("stream_index").to_numpy()
            assert stream.tolist() == list(range(next_index, next_index + shard["rows"]))
            next_index += shard["rows"]
            temps = table.column("temperature").to_numpy()
            assert np.array_equal(temps, temperature_at(stream / manifest["total_rows"], 2.0, 0.1).astype(np.float32))
            assert (shard["temperature_min"], shard["temperature_max"]) == pytest.approx((temps.min(), temps.max()))
            ids, labels = list_column(table, "input_ids"), list_column(table, "labels")
            for row_id, corrupted, label in zip(table.column("row_id").to_numpy(), ids, labels):
                original = train_rows[row_id]
                assert np.array_equal(label, (corrupted != original).astype(np.int8))
                replaced += int(label.sum())
            assert sum(len(i) for i in ids) == shard["tokens"]
        assert epoch["replaced_fraction"] == pytest.approx(replaced / epoch["masked_positions"])
        assert 0 < epoch["replaced_fraction"] <= 1 and 0 <= epoch["aux_top1"] <= 1
    assert manifest["epochs"][0]["temperature_max"] == 2.0
    assert manifest["valid"]["temperature_max"] == manifest["valid"]["temperature_min"] == 1.0
    assert not list(out.rglob(".*.tmp-*"))


def test_two_ranks_and_accumulation_follow_the_one_rank_curve(built, generated, tmp_path, gloo_env):
    """The same global batch of 8 rows as 1 rank x 1 micro-batch, 2 ranks x 2 micro-batches of 2 rows and
    1 rank x 4 micro-batches of 2 rows (accumulation derived from train.micro_batch): the same losses
    (dropout off, so the only difference is where the rows are summed; measured within 2e-5)."""
    import dataclasses
    _, data, _ = generated
    losses = {}
    for nproc, micro in ((1, 8), (2, 2), (1, 2)):
        config = dataclasses.replace(built, model=dataclasses.replace(built.model, dropout=0.0),
                                     train=dataclasses.replace(built.train, micro_batch=micro, max_steps=6))
        manifest = tmp_path / f"m{nproc}{micro}.toml"
        manifest.write_text(dump_toml(config))
        run = tmp_path / f"run{nproc}{micro}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "train", "--manifest", str(manifest), "--data", str(data), "--out", str(run)]
        result = run_ranks(cmd, timeout=300, cwd=ROOT, env=gloo_env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"({micro} per micro-batch, {8 // nproc // micro} accumulated)" in result.stdout
        records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        losses[(nproc, micro)] = [r["loss"] for r in records]
        assert [r["rows"] for r in records] == [[8 * s, 8 * (s + 1)] for s in range(6)]
        # the updates happened (runs that never stepped would agree too): every weight matrix left its init
        from common.checkpoint import latest_checkpoint
        from train.trainer import build_model
        state = latest_checkpoint(run / "checkpoints")[1]
        initial = build_model(config, built.tokenizer.vocab_size, 0.15, torch.device("cpu"))[0].state_dict()
        assert state["step"] == 6 and set(state["model"]) == set(initial)
        assert [k for k, v in state["model"].items() if v.dim() == 2 and torch.equal(v, initial[k])] == []
    assert len(losses[(1, 8)]) == 6
    np.testing.assert_allclose(losses[(2, 2)], losses[(1, 8)], rtol=2e-5)
    np.testing.assert_allclose(losses[(1, 2)], losses[(1, 8)], rtol=2e-5)


def test_the_trainer_under_torch_compile_gives_the_eager_losses(built, generated, tmp_path, env_with_repo):
    """`[train] compile = "on"` on CPU (inductor), 5 updates of the fixture model, dropout off: the losses of
    the eager run within rtol 1e-5, and checkpoints keep the plain parameter names (they resume eagerly)."""
    import dataclasses
    _, data, _ = generated
    losses = {}
    for setting in ("off", "on"):
        config = dataclasses.replace(built, model=dataclasses.replace(built.model, dropout=0.0),
                                     train=dataclasses.replace(built.train, max_steps=5, compile=setting))
        manifest = tmp_path / f"{setting}.toml"
        manifest.write_text(dump_toml(config))
        run = tmp_path / setting
        result = subprocess.run([sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(data),
                                 "--out", str(run)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                                env=env_with_repo)
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("under torch.compile" in result.stdout) == (setting == "on")
        losses[setting] = [json.loads(l)["loss"] for l in (run / "metrics.jsonl").read_text().splitlines()]
        state = torch.load(sorted((run / "checkpoints").glob("step-*.pt"))[-1], weights_only=False)
        assert not any("_orig_mod" in k for k in state["model"])
    assert len(losses["on"]) == 5
    np.testing.assert_allclose(losses["on"], losses["off"], rtol=1e-5)
