"""The stream plan covers the run (docs/design.md, the stream plan): the generator derives the epochs
from the trainer's budget, the last epoch partial, and the trainer refuses a stream that is too short."""
import argparse
import math

import numpy as np
import pytest

from common.config import ConfigError, config_from_dict, config_to_dict, dump_toml, load_manifest
from common.plan import plan_tasks, stream_plan
from tests.conftest import ROOT, tiny_config
from train.data import DataError


def test_base_manifest_plans_the_papers_125k_updates_for_a_corpus_of_the_papers_size():
    config = load_manifest(ROOT / "manifests" / "base.toml")
    # Wikipedia + BookCorpus, 16 GB: about 3.9G tokens at ~0.25 tokens per byte, in rows of 510 + 2.
    rows = 16 * 10**9 // 4 // 510
    plan = stream_plan(rows, config)
    assert plan.total_rows // config.train.batch_size == 125_000 == config.train.max_steps
    assert plan.epochs == math.ceil(125_000 * 2048 / rows) == 33
    assert (plan.epochs - 1) * plan.rows_per_epoch < plan.total_rows <= plan.epochs * plan.rows_per_epoch


def test_a_derived_plan_ends_in_a_partial_epoch_with_u_over_the_whole_stream(tmp_path):
    config = tiny_config(tmp_path)
    config.generate.epochs, config.train.max_steps, config.train.batch_size = 0, 13, 8  # 104 rows of 40 a epoch
    plan = stream_plan(40, config)
    assert (plan.rows_per_epoch, plan.epochs, plan.total_rows) == (40, 3, 104)
    tasks = [t for t in plan_tasks(40, 10, config.generate, 7, plan.total_rows) if t.split == "train"]
    stream = np.concatenate([t.stream_start + np.arange(len(t.row_ids)) for t in tasks])
    assert stream.tolist() == list(range(104))
    last = np.concatenate([t.row_ids for t in tasks if t.epoch == 2])
    assert len(last) == 24 and len(set(last.tolist())) == 24  # a prefix of epoch 2's permutation
    temps = np.concatenate([t.temperatures for t in tasks])
    assert temps[0] == 2.0 and temps[-1] == pytest.approx(1 + np.exp(-103 / 104 / 0.1))
    config.train.max_steps = 0
    with pytest.raises(ConfigError, match="train.max_steps is 0"):
        stream_plan(40, config)


def test_the_trainer_refuses_a_stream_shorter_than_its_budget(generated, tmp_path):
    import train.trainer as trainer
    manifest, data, _ = generated
    values = config_to_dict(load_manifest(manifest))
    values["train"]["max_steps"] = 10_000
    path = tmp_path / "m.toml"
    path.write_text(dump_toml(config_from_dict(values)))
    args = argparse.Namespace(manifest=str(path), data=str(data), out=str(tmp_path / "run"), resume=False)
    with pytest.raises(DataError, match=r"holds \d+ training rows; train.max_steps 10000 x train.batch_size 8 "
                                        r"needs 80000"):
        trainer.train(args)
    assert not (tmp_path / "run").exists()  # refused before any work


def test_validation_shards_read_rows_spread_over_the_held_out_split():
    """512 validation rows of 10,000 held out: every 19th or 20th row, in order, over the whole split (its
    first 512 were the first source files' documents alone); all of them when it holds fewer."""
    import dataclasses
    config = tiny_config(ROOT / "unused")
    cfg = dataclasses.replace(config.generate, valid_rows=512, rows_per_shard=100)
    valid = [t for t in plan_tasks(40, 10_000, cfg, 7) if t.split == "valid"]
    ids = np.concatenate([t.row_ids for t in valid])
    assert len(valid) == 6 and len(ids) == 512 and ids[0] == 0 and ids[-1] >= 10_000 - 20
    assert set(np.diff(ids).tolist()) == {19, 20}
    few = np.concatenate([t.row_ids for t in plan_tasks(40, 300, cfg, 7) if t.split == "valid"])
    assert np.array_equal(few, np.arange(300))
