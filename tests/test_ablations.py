"""The checked-in ablation manifests (paper section 5, appendix C): each is the tiny preset with
one curriculum changed, and each generates and trains on the fixture corpus (slow test)."""
import argparse
import json

import numpy as np
import pytest

from common.checkpoint import AUX_FILE
from common.config import config_from_dict, config_to_dict, dump_toml, load_manifest
from common.shards import SHARD_SCHEMA, list_column, read_parquet
import train.trainer as trainer
from tests.conftest import ROOT

ABLATIONS = sorted((ROOT / "manifests" / "ablations").glob("*.toml"))
CURRICULUM_KEYS = ("distribution", "augmentation", "schedule", "gamma_max", "soh_alpha", "t0", "tau")


def test_ablations_are_the_tiny_preset_with_one_curriculum_each(tmp_path):
    tiny = config_to_dict(load_manifest(ROOT / "manifests" / "tiny.toml"))
    seen = set()
    assert len(ABLATIONS) == 14
    for path in ABLATIONS:
        config = load_manifest(path)
        (tmp_path / "r.toml").write_text(dump_toml(config))
        assert load_manifest(tmp_path / "r.toml") == config
        data = config_to_dict(config)
        assert data["work_dir"] == f"work/ablations/{path.stem}" and data["shared_dir"] == tiny["work_dir"]
        for section in ("corpus", "tokenizer", "model", "aux", "train"):
            assert data[section] == tiny[section], (path.name, section)
        rest = {k: v for k, v in data["generate"].items() if k not in CURRICULUM_KEYS}
        assert rest == {k: v for k, v in tiny["generate"].items() if k not in CURRICULUM_KEYS}, path.name
        seen.add(tuple(data["generate"][k] for k in CURRICULUM_KEYS))
    assert len(seen) == len(ABLATIONS)  # no two variants are the same curriculum


def _shrunk(path, built, work):
    """The ablation's curriculum on the fixture's corpus, aux model and sizes."""
    data = config_to_dict(built)
    ablation = config_to_dict(load_manifest(path))["generate"]
    data["generate"].update({k: ablation[k] for k in CURRICULUM_KEYS}, rows_per_epoch=80, valid_rows=16)
    data["train"].update(max_steps=4, eval_every=4, ckpt_every=4, log_every=1)
    data.update(name=path.stem, work_dir=str(work), shared_dir=built.work_dir)
    return config_from_dict(data)


@pytest.mark.slow
def test_every_ablation_generates_and_trains_briefly(built, tmp_path):
    import ray
    from generate.generator import generate
    valid_hashes = set()
    try:
        for path in ABLATIONS:
            config = _shrunk(path, built, tmp_path / path.stem)
            assert config.corpus_dir == built.corpus_dir  # shared_dir: one corpus and aux for all variants
            out = tmp_path / path.stem / "epochs"
            manifest = generate(config, out, config.corpus_dir, config.aux_dir / AUX_FILE, workers=1, log=lambda *_: None)
            g = config.generate
            for epoch in manifest["epochs"]:
                record = epoch["curriculum"]
                assert record["distribution"] == g.distribution and record.get("augmentation", g.augmentation) == g.augmentation
                low, high = record["gamma_range"]
                assert 0.0 <= low <= high <= 1.0 + (g.t0 - 1.0)
            table = read_parquet(out / manifest["epochs"][0]["shards"][0]["path"], SHARD_SCHEMA)
            for ids, labels in zip(list_column(table, "input_ids"), list_column(table, "labels")):
                assert ids.min() >= 0 and ids.max() < manifest["vocab_size"] and labels.dtype == bool
            valid_hashes.add(manifest["valid"]["shards"][0]["sha256"])
            toml = tmp_path / path.stem / "manifest.toml"
            toml.write_text(dump_toml(config))
            run = tmp_path / path.stem / "run"  # the real trainer, in this process (no torchrun start-up)
            trainer.train(argparse.Namespace(manifest=str(toml), data=str(out), out=str(run), resume=False,
                                             corpus=None, aux=None))
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in records if "loss" in r][-1] == 4, path.name
            assert all(np.isfinite(r["loss"]) for r in records if "loss" in r), path.name
    finally:
        ray.shutdown()
    assert len(valid_hashes) == 1  # every variant is validated on the same rows: the aux model at T = 1
