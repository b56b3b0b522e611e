"""`fast-online` equivalence (issue: for the same seed, rows and temperature, fast-online feeds the
main model exactly the corrupted ids and labels that generate/ wrote to the shards, bitwise on CPU)."""

import numpy as np
import pytest
import torch

from common.checkpoint import AUX_FILE
from common.config import load_manifest
from tests.conftest import train_with
from train.data import load_data_manifest, training_stream, validation_stream
from train.online import online_streams

pytestmark = pytest.mark.slow


def _same_rows(a: dict, b: dict) -> None:
    assert len(a["input_ids"]) == len(b["input_ids"]) > 0
    assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a["input_ids"], b["input_ids"]))
    assert all(x.dtype == y.dtype == bool and np.array_equal(x, y) for x, y in zip(a["labels"], b["labels"]))
    assert np.array_equal(a["temperature"], b["temperature"]) and a["temperature"].dtype == b["temperature"].dtype
    assert np.array_equal(a["stream_index"], b["stream_index"])


def test_fast_online_feeds_exactly_the_rows_of_the_shards(built, generated):
    manifest_path, data, _ = generated
    config = load_manifest(manifest_path)
    manifest, _ = load_data_manifest(data, config)
    torch.set_num_threads(config.generate.threads_per_worker)
    shards = training_stream(data, manifest)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the generator's actors ran (GPU when there is one)
    online, valid, vocab, _ = online_streams(config, built.corpus_dir, built.aux_dir / AUX_FILE, device)
    assert online.num_rows == shards.num_rows and vocab == manifest["vocab_size"]
    per_epoch, per_shard = manifest["rows_per_epoch"], config.generate.rows_per_shard
    batch = config.train.batch_size
    # training batches: the first, one across a shard boundary, one across the epoch boundary, the last
    for start in (0, per_shard - batch // 2, per_epoch - batch // 2, shards.num_rows - batch):
        _same_rows(online.rows(start, start + batch), shards.rows(start, start + batch))
    held_out = validation_stream(data, manifest)
    _same_rows(valid.rows(0, valid.num_rows), held_out.rows(0, held_out.num_rows))


def test_trainer_runs_the_fast_online_objective(built, generated, tmp_path, env_with_repo):
    result, records = train_with(built, generated[0], tmp_path, env_with_repo, objective="fast-online", max_steps=4,
                                 eval_every=4, ckpt_every=4)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in records)
    assert "val_auc" in records[-1] and "fast-online from" in result.stdout


def test_fast_onlines_pre_flight_counts_its_aux_model_before_any_row_is_corrupted(built, generated, tmp_path,
                                                                                 env_with_repo, monkeypatch):
    """fast-online keeps its frozen aux model beside the detector and corrupts each batch with it: a device with
    room for the detector's training but not for that too is refused before any work, naming the aux model
    (it passed the check and ran out of memory at the first batch or the validation rows)."""
    import subprocess
    import sys
    from common.config import config_from_dict, config_to_dict, dump_toml
    from common.corrupt import Corruptor
    from common.memory import estimate_peak_bytes, online_aux_need
    from tests.conftest import ROOT
    from train.trainer import accumulation
    values = config_to_dict(load_manifest(generated[0]))
    values["train"].update(objective="fast-online", max_steps=2)
    config = config_from_dict(values)
    corruptor = Corruptor.from_config(built.aux_dir / AUX_FILE, config.seed, config.generate, built.corpus_dir)
    tc = config.train
    micro, _ = accumulation(tc.batch_size, 1, tc.micro_batch, "train")  # as the trainer makes it, one rank
    detector = estimate_peak_bytes(config, corruptor.vocab_size, micro, "cpu", accumulating=micro < tc.batch_size)
    aux = online_aux_need(corruptor, tc.batch_size, config.corpus.max_seq_len, gpu=False)
    assert aux > 0, aux  # the estimates are the trainer's own, so a room between them tells the two apart
    (tmp_path / "m.toml").write_text(dump_toml(config))

    def train(room: float):
        return subprocess.run([sys.executable, "-m", "train", "--manifest", str(tmp_path / "m.toml"), "--out",
                               str(tmp_path / f"run-{room:.0f}"), "--corpus", str(built.corpus_dir), "--aux",
                               str(built.aux_dir / AUX_FILE)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**env_with_repo, "FAST_ELECTRA_MEMORY_BYTES": str(int(room)),
                                   "CUDA_VISIBLE_DEVICES": ""})  # the CPU, whose estimates these are
    refused = train(detector + aux / 2)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "fast-online's aux model" in refused.stderr + refused.stdout, refused.stderr[-3000:]
    assert not (tmp_path / f"run-{detector + aux / 2:.0f}" / "metrics.jsonl").exists()
    ran = train(1.02 * (detector + aux))
    assert ran.returncode == 0, ran.stderr[-3000:]
    # the check comes once the aux model is loaded, before it corrupts a row (the validation rows come first)
    corrupted, real = [], Corruptor.__call__
    monkeypatch.setattr(Corruptor, "__call__",
                        lambda self, *a, **k: (corrupted.append(len(a[0])), real(self, *a, **k))[1])
    seen = []
    online_streams(config, built.corpus_dir, built.aux_dir / AUX_FILE, "cpu",
                   loaded=lambda corruptor: seen.append(list(corrupted)))
    assert seen == [[]] and corrupted, (seen, corrupted)


def test_each_rank_corrupts_on_its_own_gpu_named_by_index(built, generated, monkeypatch):
    """fast-online and electra under several GPUs: the frozen aux model also runs on the trainer's reader
    thread, where a bare "cuda" means cuda:0 (torch.cuda.set_device holds for the thread that called it), so
    rank 1 would load the model on cuda:1 and send its inputs to cuda:0. The trainer names the device with
    its index. (Stopped at the call: no second GPU here.)"""
    import dataclasses
    from types import SimpleNamespace
    import train.online
    from train.trainer import open_streams
    seen = []

    def called(config, corpus_dir, aux_path, device, corrupt=True, loaded=None):
        seen.append((device, corrupt))
        raise RuntimeError("stopped at the call")

    monkeypatch.setattr(train.online, "online_streams", called)
    config = load_manifest(generated[0])
    args = SimpleNamespace(corpus=str(built.corpus_dir), aux=str(built.aux_dir / AUX_FILE))
    for objective in ("fast-online", "electra"):
        with pytest.raises(RuntimeError, match="stopped at the call"):
            open_streams(dataclasses.replace(config, train=dataclasses.replace(config.train, objective=objective)),
                         args, torch.device("cuda", 1))
    assert seen == [("cuda:1", True), ("cuda:1", False)]


def test_an_online_runs_data_key_names_the_device_kind_that_corrupts_its_batches():
    """fast-online's batches come from the aux model's kernels on the trainer's device (bf16 on a GPU): a GPU
    run's checkpoint is not resumed on the CPU; CPU runs keep their former key; electra (no corruption) too."""
    import hashlib
    import json
    from train.online import online_data_key
    former = lambda corrupt: hashlib.sha256(json.dumps({"online": "k", "corrupt": corrupt}).encode()).hexdigest()
    assert online_data_key("k", True, "cpu") == former(True) != online_data_key("k", True, "cuda")
    assert online_data_key("k", False, "cuda") == online_data_key("k", False, "cpu") == former(False)


def test_every_validation_reads_the_same_rows_spread_over_the_held_out_split(built, generated):
    """The generator's validation shard, the aux model's validation and the online objectives' read the same
    held-out rows, spread over the split (its first rows were the first source files' documents alone)."""
    import pyarrow.parquet as pq
    from common.corpus import SplitRows
    from train.mlm import valid_rows
    manifest_path, data, _ = generated
    config = load_manifest(manifest_path)
    held_out = len(SplitRows(built.corpus_dir, "valid"))
    count = config.generate.valid_rows
    shards = np.concatenate([pq.read_table(p, columns=["row_id"]).column("row_id").to_numpy()
                             for p in sorted((data / "valid").glob("shard-*.parquet"))])
    assert count < held_out and len(shards) == count  # a part of the split: where spreading shows
    assert shards[0] == 0 and shards[-1] >= held_out - held_out // count - 1 and np.all(np.diff(shards) > 0)
    assert np.array_equal(valid_rows(built.corpus_dir, count).data["row_id"], shards)
    assert np.array_equal(valid_rows(built.corpus_dir, config.aux.valid_rows).data["row_id"][:3],
                          np.arange(3) * held_out // min(config.aux.valid_rows, held_out))

