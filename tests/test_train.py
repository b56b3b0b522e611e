"""Trainer pieces without torchrun: the data manifest checks, rank slices, metrics."""
import json

import numpy as np
import pytest
import torch

from common.checkpoint import IncompatibleInputs
from common.shards import SHARD_SCHEMA
from tests.conftest import tiny_config
from train.data import DataError, load_data_manifest, rank_slice
from train.metrics import roc_auc, rtd_metrics


def _manifest(folder, **changes):
    data = {"vocab_size": 320, "max_seq_len": 32, "epochs": [], "valid": {"shards": []},
            "schema": [{"name": f.name, "type": str(f.type)} for f in SHARD_SCHEMA], **changes}
    folder.mkdir(exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps(data))
    return folder


def test_data_manifest_must_match_the_model_config(tmp_path):
    config = tiny_config(tmp_path)
    load_data_manifest(_manifest(tmp_path / "ok"), config)
    with pytest.raises(IncompatibleInputs, match="vocabulary 999 but the manifest config has tokenizer.vocab_size = 320"):
        load_data_manifest(_manifest(tmp_path / "v", vocab_size=999), config)
    with pytest.raises(IncompatibleInputs, match="sequence length 512"):
        load_data_manifest(_manifest(tmp_path / "s", max_seq_len=512), config)
    with pytest.raises(IncompatibleInputs, match="schema"):
        load_data_manifest(_manifest(tmp_path / "c", schema=[{"name": "input_ids", "type": "list<item: int64>"}]), config)
    with pytest.raises(DataError, match="make generate-epochs"):
        load_data_manifest(tmp_path / "missing", config)


def test_shards_made_with_another_tokenizer_than_the_runs_corpus_are_refused_naming_both(tmp_path):
    config = tiny_config(tmp_path)
    config.corpus_dir.mkdir(parents=True)
    (config.corpus_dir / "corpus.json").write_text(json.dumps({"tokenizer_sha256": "a" * 64}))
    load_data_manifest(_manifest(tmp_path / "same", tokenizer_sha256="a" * 64), config)
    with pytest.raises(IncompatibleInputs, match=rf"made with tokenizer b{{12}}, but this run's corpus "
                                                 rf"{config.corpus_dir} has tokenizer a{{12}}"):
        load_data_manifest(_manifest(tmp_path / "other", tokenizer_sha256="b" * 64), config)


def test_rank_slices_partition_the_global_batch():
    for world in (1, 2, 4):
        rows = [r for step in range(3) for rank in range(world) for r in range(*rank_slice(step, 8, rank, world))]
        assert rows == list(range(24))


def test_auc_matches_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=200).astype(float)
    labels = (rng.random(200) < 0.3).astype(int)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairwise = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg))
    assert roc_auc(scores, labels) == pytest.approx(pairwise)


def test_rtd_metrics_ignore_padding():
    logits = torch.tensor([[3.0, -3.0, 3.0, 9.0], [-3.0, 3.0, -3.0, 9.0]])
    labels = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    m = rtd_metrics(logits, labels, mask)
    assert m["tokens"] == 6 and m["accuracy"] == pytest.approx(5 / 6)
    assert m["recall"] == 1.0 and m["precision"] == pytest.approx(2 / 3)
