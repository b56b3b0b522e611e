"""The aux model's training job (`make aux`: the trainer's `mlm` objective, train/mlm.py, launched and
published by auxiliary/mlm.py): exact resume after kill -9, ranks and accumulation, its own masks,
chunked logits, the pre-flight check."""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from common.checkpoint import AUX_FILE, safe_load
from common.config import ConfigError, accumulation, dump_toml
from common.curriculum import AUX_MLM_STREAM
from common.plan import IndexPermutation
from tests.conftest import ROOT, run_ranks
from train.__main__ import KILL_AT_STEP_ENV


def aux_manifest(built, tmp_path, name="aux.toml", **aux):
    """The fixture's config with [aux] overrides, written as a manifest whose work_dir is under tmp_path."""
    config = dataclasses.replace(built, work_dir=str(tmp_path / "work"),
                                 aux=dataclasses.replace(built.aux, **aux))
    path = tmp_path / name
    path.write_text(dump_toml(config))
    return path, config


def run_aux(manifest, built, out, env, *extra):
    cmd = [sys.executable, "-m", "auxiliary", "--manifest", str(manifest), "--corpus", str(built.corpus_dir),
           "--out", str(out), *extra]
    return run_ranks(cmd, timeout=300, cwd=ROOT, env=env)


def weights(out):
    return safe_load(out / AUX_FILE)["state_dict"]


@pytest.mark.slow
def test_kill_9_during_make_aux_and_a_rerun_give_the_uninterrupted_aux_pt(built, tmp_path, env_with_repo):
    manifest, _ = aux_manifest(built, tmp_path, steps=6, ckpt_every=2, log_every=1, eval_every=2)
    full = run_aux(manifest, built, tmp_path / "full", env_with_repo)
    assert full.returncode == 0, full.stderr[-3000:]
    killed = run_aux(manifest, built, tmp_path / "killed", {**env_with_repo, KILL_AT_STEP_ENV: "3"})
    assert killed.returncode != 0 and "run `make aux` again to resume" in killed.stderr
    assert not (tmp_path / "killed" / AUX_FILE).exists()  # nothing published from a run that did not finish
    resumed = run_aux(manifest, built, tmp_path / "killed", env_with_repo)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step-00000002.pt" in resumed.stdout  # step 3 was lost, not 2
    assert (tmp_path / "killed" / AUX_FILE).read_bytes() == (tmp_path / "full" / AUX_FILE).read_bytes()
    (run,) = (tmp_path / "killed").glob("run-*")
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7)) and all("top1" in r for r in records)
    assert "val_top1" in records[-1]
    again = run_aux(manifest, built, tmp_path / "killed", env_with_repo)  # up to date: nothing retrained
    assert again.returncode == 0 and "up to date" in again.stdout


@pytest.mark.slow
def test_two_ranks_give_the_weights_of_one_rank_with_twice_the_accumulation(built, tmp_path, gloo_env):
    """8 rows per update as 2 ranks x 2 micro-batches of 2 rows, and as 1 rank x 4 micro-batches of 2 rows
    (dropout off): the same rows in each micro-batch, summed in another order. Measured: the largest
    weight difference after 6 updates was 7.5e-9 (relative 7.9e-7); asserted within 1e-6."""
    config = dataclasses.replace(built, model=dataclasses.replace(built.model, dropout=0.0))
    values = json.loads(json.dumps(dataclasses.asdict(config)))
    values["aux"].update(micro_batch=2, steps=6)
    from common.config import config_from_dict
    manifest = tmp_path / "aux.toml"
    manifest.write_text(dump_toml(config_from_dict(values)))
    outs = {}
    for nproc in (1, 2):
        outs[nproc] = tmp_path / f"n{nproc}"
        result = run_aux(manifest, built, outs[nproc], gloo_env, "--nproc", str(nproc))
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"(2 per micro-batch, {4 // nproc} accumulated)" in result.stdout
    one, two = weights(outs[1]), weights(outs[2])
    diffs = {k: float((one[k] - two[k]).abs().max()) for k in one}
    assert max(diffs.values()) <= 1e-6, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    # the updates happened: the weights left their initial values (equal ones would agree without training)
    from common.aux_record import aux_run_config
    from train.trainer import build_model
    initial = build_model(aux_run_config(config_from_dict(values)), built.tokenizer.vocab_size, 0.0,
                          torch.device("cpu"))[0].state_dict()
    assert set(one) <= set(initial) and all(one[k].shape == initial[k].shape for k in one)
    still = [k for k in one if one[k].dim() == 2 and torch.equal(one[k], initial[k])]  # (at lr 1e-30 every
    assert still == []  # bias moves off its zeros, the matrices stay as they were: this line fails there)


def test_the_aux_masks_are_never_the_generators_masks(built):
    """The aux model trains on masks of a stream of its own: for a few rows, at every epoch, its masked
    positions differ from those the generator (and fast-online, and ELECTRA) draws for that row."""
    from common.corpus import SplitRows
    from train.mlm import mlm_tensors
    from common.batching import masked_inputs
    rows = SplitRows(built.corpus_dir, "train")
    ids = np.arange(6)
    originals = [rows[int(i)] for i in ids]
    for epoch in range(4):
        epochs = np.full(len(ids), epoch)
        made = mlm_tensors({"input_ids": originals, "row_id": ids, "epoch": epochs}, built.seed, 0.15)
        aux = torch.zeros(made["masked_ids"].numel(), dtype=torch.bool).index_fill_(0, made["masked_index"], True)
        aux = aux.view_as(made["masked_ids"])
        generator = masked_inputs(originals, ids, epochs, built.seed, 0.15, aux.shape[1])["masked_flags"]
        assert (aux.sum(1) == generator.sum(1)).all()  # the same exact count per row ...
        for i in range(len(ids)):
            assert not torch.equal(aux[i], generator[i]), (epoch, i)  # ... at other positions


def test_the_aux_stream_reads_every_row_once_per_epoch_in_its_own_order(built):
    from train.mlm import CorpusStream
    stream = CorpusStream(built.corpus_dir, 0, built.seed)
    n = stream.per_epoch
    stream.num_rows = 2 * n + 3
    whole = stream.rows(0, stream.num_rows)
    assert sorted(whole["row_id"][:n]) == list(range(n)) and sorted(whole["row_id"][n:2 * n]) == list(range(n))
    assert list(whole["epoch"][[0, n, 2 * n]]) == [0, 1, 2]
    assert not np.array_equal(whole["row_id"][:n], whole["row_id"][n:2 * n])  # each epoch its own order
    parts = [stream.rows(a, b)["row_id"] for a, b in ((0, 5), (5, n + 1), (n + 1, stream.num_rows))]
    assert np.array_equal(np.concatenate(parts), whole["row_id"])  # any slicing: the same rows
    from common.plan import epoch_order
    assert not np.array_equal(whole["row_id"][:n], epoch_order(n, 0, built.seed)(np.arange(n)))  # not the generator's order


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4099])
def test_the_index_permutation_is_a_permutation(n):
    order = IndexPermutation(n, [5, 0, AUX_MLM_STREAM])
    values = order(np.arange(n))
    assert sorted(values) == list(range(n))
    assert np.array_equal(order(np.arange(n)[::-1]), values[::-1])  # index by index, any order
    if n > 8:
        assert not np.array_equal(values, IndexPermutation(n, [6, 0, AUX_MLM_STREAM])(np.arange(n)))


def test_chunked_logits_give_the_loss_and_gradients_of_all_logits_at_once(built, monkeypatch):
    """Logits at masked positions, a chunk at a time and recomputed in backward: the same loss and
    gradients (within float32 summation order) as one pass over every masked position."""
    import train.mlm as mlm
    from common.corpus import SplitRows
    rows = SplitRows(built.corpus_dir, "train")
    batch = mlm.mlm_tensors({"input_ids": [rows[i] for i in range(8)], "row_id": np.arange(8),
                             "epoch": np.zeros(8, int)}, built.seed, 0.15)
    results = []
    for entries in (2**26, 5 * built.tokenizer.vocab_size):  # one chunk; chunks of 5 positions
        monkeypatch.setattr(mlm, "LOGIT_CHUNK_ENTRIES", entries)
        torch.manual_seed(0)
        model = mlm.MLMObjective(dataclasses.replace(built.model, dropout=0.0), built.tokenizer.vocab_size, 2)
        loss, hits = model(*(batch[k] for k in mlm.MLM_INPUTS))
        loss.backward()
        results.append((loss.detach(), int(hits), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert len(batch["targets"]) > 10  # really several chunks
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-5)
    assert results[0][1] == results[1][1]
    for name, grad in results[0][2].items():
        torch.testing.assert_close(grad, results[1][2][name], rtol=1e-5, atol=1e-6)


def test_under_torch_compile_the_aux_model_stops_recompiling_when_the_masked_count_changes(built, monkeypatch):
    """`[train] compile` ("auto": on a GPU) wraps `make aux`'s model: batches whose rows differ in length
    differ in masked positions, and the chunked loss's loop over them was traced into one graph per count
    (torch gives up compiling after 8). Counted through a backend that only counts: the graphs stop at a
    dynamic shape, and the losses are eager's."""
    import train.mlm as mlm
    from common.corpus import SplitRows
    monkeypatch.setattr(mlm, "LOGIT_CHUNK_ENTRIES", 5 * built.tokenizer.vocab_size)  # several chunks per batch
    rows = SplitRows(built.corpus_dir, "train")
    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch.manual_seed(0)
    model = mlm.MLMObjective(dataclasses.replace(built.model, dropout=0.0), built.tokenizer.vocab_size, 2)
    compiled = torch.compile(model, backend=counting, dynamic=None)
    counts = set()
    text = np.concatenate([rows[i] for i in range(100)])
    for i, length in enumerate((32, 27, 20, 14, 8, 30, 24, 17, 11, 32)):  # 4 rows: 4 x 1 to 4 x 5 masked
        batch = mlm.mlm_tensors({"input_ids": [text[(4 * i + j) * 32:][:length - j] for j in range(4)],
                                 "row_id": np.arange(4) + 4 * i, "epoch": np.zeros(4, int)}, built.seed, 0.15)
        counts.add(len(batch["targets"]))
        inputs = [batch[k] for k in mlm.MLM_INPUTS]
        loss, hits = compiled(*inputs)
        loss.backward()
        expected, expected_hits = model(*inputs)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-5)
        assert int(hits) == int(expected_hits)
    assert len(counts) >= 7 and len(graphs) <= 3, (sorted(counts), len(graphs))


def test_a_micro_batch_that_does_not_fit_stops_make_aux_before_any_work(built, tmp_path, env_with_repo):
    manifest, _ = aux_manifest(built, tmp_path)
    env = {**env_with_repo, "FAST_ELECTRA_MEMORY_BYTES": str(300 * 2**20)}  # less than the process alone
    result = run_aux(manifest, built, tmp_path / "out", env)
    assert result.returncode == 2
    assert "aux.micro_batch = 8 rows of 32 tokens needs about" in result.stderr
    assert "FAST_ELECTRA_MEMORY_BYTES is 0.29 GiB" in result.stderr and "no micro-batch" in result.stderr
    (run,) = (tmp_path / "out").glob("run-*")
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


def test_the_preflight_names_the_largest_micro_batch_that_fits(built, monkeypatch):
    from common.memory import estimate_peak_bytes, preflight
    config = dataclasses.replace(built, train=dataclasses.replace(built.train, batch_size=64))
    vocab = built.tokenizer.vocab_size
    assert estimate_peak_bytes(config, vocab, 8) > estimate_peak_bytes(config, vocab, 4)  # grows with the micro-batch
    room = (estimate_peak_bytes(config, vocab, 8) + estimate_peak_bytes(config, vocab, 16)) / 2
    monkeypatch.setenv("FAST_ELECTRA_MEMORY_BYTES", str(int(room)))
    assert preflight(config, vocab, 8, torch.device("cpu"), share=64) <= room
    with pytest.raises(ConfigError, match=r"train\.micro_batch = 64 rows .* set train\.micro_batch = 8 "):
        preflight(config, vocab, 64, torch.device("cpu"), share=64)


def test_the_estimate_counts_what_triton_adds_to_a_cpu_process():
    """Every trainer imports torch._dynamo (torch.optim's constructor does), which imports Triton where it is
    installed (the `test` extra; torch's CUDA builds): the pre-flight's runtime counts it, TRITON_BYTES, measured
    here again as the peak RSS of that import with Triton importable over without (fresh processes)."""
    import importlib.util
    from common import memory
    if importlib.util.find_spec("triton") is None:
        assert memory.runtime_bytes("cpu") == memory.RUNTIME_BYTES["cpu"]
        pytest.skip("Triton is not installed here: nothing to measure")
    assert memory.runtime_bytes("cpu") == memory.RUNTIME_BYTES["cpu"] + memory.TRITON_BYTES
    probe = ("import sys; {}import torch._dynamo; from common.memory import peak_rss_bytes; "
             "print(sys.modules.get('triton') is not None, peak_rss_bytes())")
    peaks = {}
    for blocked in (False, True):
        out = subprocess.run([sys.executable, "-c", probe.format("sys.modules['triton'] = None; " if blocked else "")],
                             capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
        assert out[0] == str(not blocked), out
        peaks[blocked] = int(out[1])
    assert 0.6 < (peaks[False] - peaks[True]) / memory.TRITON_BYTES < 1.2, peaks  # measured: 0.71 and 1.00


def test_the_gpu_room_counts_what_the_caching_allocator_holds_unused(monkeypatch):
    """On a GPU the pre-flight's room is the free memory plus the blocks this process's caching allocator
    keeps without a tensor in them (fast-online and electra corrupt their validation rows on the GPU first):
    `mem_get_info` counts those as used. (torch.cuda's counters stood in for: no GPU here.)"""
    from common.memory import available_bytes
    gib = 2**30
    for name, value in (("mem_get_info", lambda d: (10 * gib, 80 * gib)), ("memory_reserved", lambda d: 6 * gib),
                        ("memory_allocated", lambda d: 1 * gib), ("get_device_name", lambda d: "a GPU")):
        monkeypatch.setattr(torch.cuda, name, value)
    assert available_bytes(torch.device("cuda", 0)) == (15 * gib, "free memory of a GPU")


def test_accumulation_is_derived_and_a_combination_that_does_not_divide_is_named():
    assert accumulation(2048, 8, 32) == (32, 8)
    assert accumulation(32, 2, 0) == (16, 1)
    with pytest.raises(ConfigError, match="2048 over 8 rank.* 256 rows per rank, not a multiple of train.micro_batch 48"):
        accumulation(2048, 8, 48)
    with pytest.raises(ConfigError, match="aux.batch_size 10 is not divisible by the 4 ranks"):
        accumulation(10, 4, 0, "aux")


def test_the_mlm_update_never_counts_masked_positions_on_the_device(built):
    """`make aux`'s update (`train.trainer.update`, objective `mlm`) runs on fake tensors, which carry shapes and
    no values: the masked positions arrive as flat indices made on the host (`mlm_tensors`), so nothing has a
    size the device must report (a GPU would wait for each micro-batch's count). The indices give the loss and
    every gradient of the boolean mask, bitwise."""
    import contextlib
    from functools import partial
    from torch._subclasses.fake_tensor import FakeTensorMode
    import train.mlm as mlm
    from common.corpus import SplitRows
    from common.curriculum import masked_count
    from common.optim import build_optimizer, build_scheduler
    from train import trainer
    rows = SplitRows(built.corpus_dir, "train")
    micro = [{"input_ids": [rows[i] for i in range(s, s + 4)], "row_id": np.arange(s, s + 4),
              "epoch": np.zeros(4, int)} for s in (0, 4)]
    batches = [mlm.mlm_tensors(r, built.seed, 0.15) for r in micro]  # host work, before the device's part
    tc = dataclasses.replace(built.train, objective="mlm")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = mlm.MLMObjective(built.model, built.tokenizer.vocab_size, 2)
        optimizer = build_optimizer(model, tc.lr, tc.betas, tc.eps, tc.weight_decay)
        scheduler = build_scheduler(optimizer, 2, 10)
        made = iter(batches)
        loss, extra, tokens, _, _ = trainer.update(model, model, optimizer, scheduler, micro, lambda _: next(made),
                                                   torch.device("cpu"), contextlib.nullcontext(), 1, tc,
                                                   partial(masked_count, mask_prob=0.15))
    assert loss.shape == extra["top1"].shape == () and tokens == sum(len(r) for m in micro for r in m["input_ids"])

    batch = batches[0]
    flags = torch.zeros(batch["masked_ids"].numel(), dtype=torch.bool).index_fill_(0, batch["masked_index"], True)
    results = []
    for positions in (batch["masked_index"], flags.view_as(batch["masked_ids"])):
        torch.manual_seed(0)
        model = mlm.MLMObjective(dataclasses.replace(built.model, dropout=0.0), built.tokenizer.vocab_size, 2)
        loss, hits = model(batch["masked_ids"], batch["attention_mask"], positions, batch["targets"])
        loss.backward()
        results.append((loss.detach(), int(hits), [p.grad for p in model.parameters()]))
    (loss_a, hits_a, grads_a), (loss_b, hits_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and hits_a == hits_b and all(map(torch.equal, grads_a, grads_b))


def test_the_aux_model_stays_current_when_only_generation_logging_or_the_main_runs_training_change(built, tmp_path):
    """Every ablation edits [generate] and shares one aux model; the aux run's intervals, the RTD loss's weight
    and the main run's own [train] (its optimizer settings, a hyper-parameter search's; how it runs: compile,
    attention) do not change the aux run's updates: none of them may start a fresh aux run (for base, 125K
    updates) and leave the shards it made behind."""
    from common.aux_record import aux_is_current
    edited = dataclasses.replace(
        built, generate=dataclasses.replace(built.generate, t0=3.0, schedule="constant", zstd_level=3, epochs=5),
        aux=dataclasses.replace(built.aux, eval_every=1, log_every=1, ckpt_every=3),
        train=dataclasses.replace(built.train, electra_lambda=7.0, clip_norm=0.5, weight_decay=0.1, betas=[0.9, 0.999],
                                  eps=1e-8, rel_bias_lr_scale=10.0, embed_lr_scale=2.0, lr=3e-3, compile="off",
                                  attention="sdpa"))
    assert aux_is_current(edited, built.corpus_dir, built.aux_dir)
    # nor what its own resume may change: the micro-batch a memory check asks for, where the raw text is mounted
    moved = dataclasses.replace(built, aux=dataclasses.replace(built.aux, micro_batch=4),
                                corpus=dataclasses.replace(built.corpus, source="/mnt/moved/raw"))
    assert aux_is_current(moved, built.corpus_dir, built.aux_dir)
    # an aux model published before the key left these out (aux.json's key by the former formula) stays current
    import shutil
    from common.aux_record import run_key
    from common.checkpoint import AUX_META
    old = shutil.copytree(built.aux_dir, tmp_path / "aux-published-before")
    meta = json.loads((old / AUX_META).read_text())
    for form in ("2026-11-26", "legacy"):
        earlier = run_key(built, built.corpus_dir, form)
        assert earlier != run_key(built, built.corpus_dir), form
        meta["metrics"]["run_key"] = earlier
        (old / AUX_META).write_text(json.dumps(meta))
        assert aux_is_current(built, built.corpus_dir, old)
    meta["metrics"]["run_key"] = "0" * 12
    (old / AUX_META).write_text(json.dumps(meta))
    assert not aux_is_current(built, built.corpus_dir, old)
    for changed in (dataclasses.replace(built, aux=dataclasses.replace(built.aux, lr=1e-3)),
                    dataclasses.replace(built, seed=built.seed + 1),
                    dataclasses.replace(built, aux=dataclasses.replace(built.aux, warmup_steps=built.aux.warmup_steps + 1))):
        assert not aux_is_current(changed, built.corpus_dir, built.aux_dir)


def test_an_aux_run_started_under_the_former_key_is_resumed_not_redone(built, tmp_path):
    """Its folder run-LEGACYKEY (the key before [generate] left it) is taken over: the run goes on from its
    checkpoints instead of starting afresh beside them."""
    import os
    import shutil
    from auxiliary.mlm import train_aux
    from common.aux_record import run_key
    aux = tmp_path / "aux"
    shutil.copytree(built.aux_dir, aux)
    new, legacy = (f"run-{run_key(built, built.corpus_dir, form)}" for form in ("current", "legacy"))
    (aux / new).rename(aux / legacy)
    (aux / AUX_FILE).unlink()
    checkpoints = sorted(p.name for p in (aux / legacy / "checkpoints").iterdir())
    said = []
    train_aux(built, built.corpus_dir, aux, log=said.append, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert not (aux / legacy).exists() and (aux / AUX_FILE).is_file()
    assert sorted(p.name for p in (aux / new / "checkpoints").iterdir()) == checkpoints
    assert f"training in {aux / new}" in said[0]
