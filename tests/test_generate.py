"""The generator without Ray: the pure corruption function, the plan, and input checks."""
import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import ray

from common.checkpoint import AUX_FILE, AUX_META, IncompatibleInputs
from common.config import GenerateConfig, dump_toml
from common.corpus import load_split
from common.curriculum import num_to_mask
from tests.conftest import ROOT, temperature_at
from common.sources import CorpusError
from common.tokenizer import SPECIAL_IDS
from generate.generator import OutputConflict, generate
from common.plan import plan_tasks
from common.corrupt import Corruptor


def test_corruptor_is_pure_and_follows_the_label_rule(built):
    rows = load_split(built.corpus_dir, "train")[:20]
    corruptor = Corruptor(built.aux_dir / AUX_FILE, seed=3, mask_prob=0.15, batch_tokens=200)
    temps = np.linspace(2.0, 1.0, len(rows))
    out = corruptor(rows, np.arange(20), epoch=0, temperatures=temps)
    again = corruptor(rows, np.arange(20), epoch=0, temperatures=temps)
    assert all(np.array_equal(a, b) for a, b in zip(out["input_ids"], again["input_ids"]))
    changed = 0
    for original, corrupted, labels in zip(rows, out["input_ids"], out["labels"]):
        assert corrupted.shape == original.shape and labels.dtype == np.int8
        assert np.array_equal(labels, (corrupted != original).astype(np.int8))
        special = np.isin(original, SPECIAL_IDS)
        assert np.array_equal(corrupted[special], original[special])  # specials never touched
        assert not np.isin(corrupted[~special], SPECIAL_IDS).any()    # and never sampled
        assert labels.sum() <= num_to_mask(int((~special).sum()), 0.15)
        changed += int(labels.sum())
    assert out["replaced"] == changed and out["masked"] >= changed > 0
    other_epoch = corruptor(rows, np.arange(20), epoch=1, temperatures=temps)
    assert any(not np.array_equal(a, b) for a, b in zip(out["input_ids"], other_epoch["input_ids"]))


def test_plan_gives_every_row_its_own_u():
    cfg = GenerateConfig(epochs=3, rows_per_epoch=50, rows_per_shard=16, valid_rows=10)
    tasks = plan_tasks(num_train_rows=80, num_valid_rows=30, cfg=cfg, seed=1)
    valid = [t for t in tasks if t.split == "valid"]
    train = [t for t in tasks if t.split == "train"]
    assert sum(len(t.row_ids) for t in valid) == 10 and all((t.temperatures == 1.0).all() for t in valid)
    stream = np.concatenate([t.stream_start + np.arange(len(t.row_ids)) for t in train])
    assert stream.tolist() == list(range(150))  # 3 epochs x 50 rows, in order
    temps = np.concatenate([t.temperatures for t in train])
    assert temps[0] == 2.0
    assert np.allclose(temps, temperature_at(stream / 150, 2.0, 0.1))
    for epoch in range(3):
        ids = np.concatenate([t.row_ids for t in train if t.epoch == epoch])
        assert len(set(ids.tolist())) == 50 and ids.max() < 80  # a sample without repeats
    coarse = plan_tasks(80, 30, GenerateConfig(epochs=2, rows_per_shard=40, temperature_granularity="epoch"), 1)
    coarse_train = [t for t in coarse if t.split == "train"]
    assert {t.epoch for t in coarse_train} == {0, 1}
    for t in coarse_train:  # the paper's coarser option: one temperature per epoch, u = epoch / epochs
        assert np.all(t.temperatures == temperature_at(t.epoch / 2, 2.0, 0.1))
    # over few epochs (a corpus as large as the budget) that is a few temperatures: said by the generator
    from common.plan import granularity_note
    assert granularity_note(GenerateConfig(temperature_granularity="epoch"), 1) == (
        'temperature_granularity = "epoch" over 1 epoch(s): the curriculum takes 1 value(s), 2.000, one an epoch '
        '("row" follows it row by row at any length)')
    assert f"2.000, {temperature_at(0.5, 2.0, 0.1):.3f}, one an epoch" in granularity_note(
        GenerateConfig(temperature_granularity="epoch"), 2)
    assert granularity_note(GenerateConfig(temperature_granularity="epoch"), 5) is None
    assert granularity_note(GenerateConfig(), 1) is None


def _copy_aux_with_vocab(built, tmp_path, vocab):
    aux = tmp_path / "aux"
    aux.mkdir()
    (aux / AUX_FILE).write_bytes((built.aux_dir / AUX_FILE).read_bytes())
    meta = json.loads((built.aux_dir / AUX_META).read_text())
    meta["vocab_size"] = vocab
    (aux / AUX_META).write_text(json.dumps(meta))
    return aux / AUX_FILE


def test_bad_inputs_are_refused_before_ray_starts(built, tmp_path):
    out = tmp_path / "epochs"
    bad_aux = _copy_aux_with_vocab(built, tmp_path, 999)
    with pytest.raises(IncompatibleInputs, match=r"vocabulary of 999 tokens but the tokenizer .* has 320"):
        generate(built, out, built.corpus_dir, bad_aux, workers=1)
    with pytest.raises(CorpusError, match="run `make corpus` first"):
        generate(built, out, tmp_path / "no_corpus", built.aux_dir / AUX_FILE, workers=1)
    with pytest.raises(FileNotFoundError, match="make aux"):
        generate(built, out, built.corpus_dir, tmp_path / "none" / AUX_FILE, workers=1)
    out.mkdir()
    (out / "plan.json").write_text(json.dumps({"generation_key": "something-else"}))
    with pytest.raises(OutputConflict, match="different generation"):
        generate(built, out, built.corpus_dir, built.aux_dir / AUX_FILE, workers=1)
    assert not ray.is_initialized()
    assert sorted(p.name for p in out.iterdir()) == ["plan.json"]  # nothing written


@pytest.mark.slow
def test_an_actor_that_cannot_work_on_its_node_stops_the_run_with_one_line(built, tmp_path):
    """A node that does not see the driver's folders (a node-local --out), or that holds a GPU its torch
    cannot use (a CPU-only build: before, it wrote fp32 CPU shards into a folder of bf16 GPU ones), stops the
    run with one line naming the node and what is wrong, not a restarted actor and Ray's traceback. Joining a
    cluster without --workers starts an actor per GPU of the cluster (it was this machine's count: 2 cores here,
    so 2 actors; the idle nodes' GPUs unused). Real Ray actors; the cluster is the Ray this process started,
    told it has 3 GPUs (this machine's torch has no CUDA)."""
    import subprocess
    import sys
    from tests.conftest import ROOT
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(built))
    script = f"""
import sys
from pathlib import Path
import ray
ray.init(num_cpus=3, num_gpus=3, include_dashboard=False, logging_level="ERROR")
from common.config import load_manifest
from common.parallel import NodeProblem
from common.plan import plan_tasks
from generate.generator import generate
from generate.job import run_tasks
config = load_manifest({str(manifest)!r})
g = config.generate
import dataclasses
args = dict(aux_path={str(built.aux_dir / AUX_FILE)!r}, corpus_dir={str(built.corpus_dir)!r}, seed=config.seed,
            generate=dataclasses.replace(g, threads_per_worker=1, zstd_level=1))
task = plan_tasks(100, 0, g, config.seed)[:1]
out = {str(tmp_path / "node-local")!r}  # a folder the driver wrote no plan.json in: what another node sees
try:
    run_tasks(task, 1, dict(args, out_dir=out), Path(out))
except NodeProblem as e:
    print("unseen |", e)
import generate.__main__ as cli  # --address: Ray is up already, so this process's cluster is the one joined
sys.exit(cli.main(["--manifest", {str(manifest)!r}, "--out", {str(tmp_path / "epochs")!r}, "--address", "joined"]))
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    said = dict(line.split(" | ", 1) for line in result.stdout.splitlines() if " | " in line)
    assert set(said) == {"unseen"}, result.stdout + result.stderr[-3000:]
    assert f"the output folder {tmp_path / 'node-local'} is not there as seen from Ray node" in said["unseen"]
    assert "plan.json missing" in said["unseen"] and "shared file system" in said["unseen"]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "to run on 3 worker(s)" in result.stdout, result.stdout
    (error,) = [line for line in result.stderr.splitlines() if "Ray gave" in line]  # once, not per actor
    assert error.startswith("error: Ray gave an actor GPU [") and "sees no CUDA device" in error, result.stderr[-3000:]
    assert not list((tmp_path / "epochs").glob("*.parquet"))  # no CPU shard in what would be a GPU folder


@pytest.mark.slow
def test_a_cluster_with_no_cpu_yet_or_a_node_missing_a_corpus_part_stops_the_ray_stages_with_one_line(built,
                                                                                                      tmp_path):
    """An autoscaling cluster whose head has no CPU and no worker node up yet, joined without --workers:
    `python -m generate` and `python -m corpus` each stop with one `error:` line saying so and what to do
    (exit 2), before any actor or output (a real Ray started with 0 CPUs, joined by both CLIs). An actor whose
    node's copy of the corpus lacks a part (corpus.json there): one problem naming the node and the file, not
    a restarted actor and Ray's traceback (a real actor of a Ray with 1 CPU)."""
    import subprocess
    import sys
    from tests.conftest import ROOT
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(built))
    script = f"""
import ray
ray.init(num_cpus=0, include_dashboard=False, logging_level="ERROR")
import corpus.__main__ as corpus_cli
import generate.__main__ as generate_cli
for cli, out in ((generate_cli, "epochs"), (corpus_cli, "corpus")):
    code = cli.main(["--manifest", {str(manifest)!r}, "--out", {str(tmp_path)!r} + "/" + out, "--address", "joined"])
    print("exit |", code, flush=True)
ray.shutdown()
ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
import shutil
from pathlib import Path
from common.config import load_manifest
from common.parallel import NodeProblem
from common.plan import plan_tasks
from generate.job import run_tasks
config = load_manifest({str(manifest)!r})
g = config.generate
partial = shutil.copytree({str(built.corpus_dir)!r}, {str(tmp_path / "partial-corpus")!r})
next(Path(partial).glob("train/*.tokens.npy")).unlink()
out = Path({str(tmp_path / "written")!r})
out.mkdir()
(out / "plan.json").write_text("{{}}")  # the driver's folder, seen
import dataclasses
args = dict(aux_path={str(built.aux_dir / AUX_FILE)!r}, corpus_dir=partial, out_dir=str(out), seed=config.seed,
            generate=dataclasses.replace(g, threads_per_worker=1, zstd_level=1))
try:
    run_tasks(plan_tasks(100, 0, g, config.seed)[:1], 1, args, out)
except NodeProblem as e:
    print("part |", e, flush=True)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("exit |")] == ["exit | 2"] * 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: the Ray cluster at joined has no CPU to run workers on yet; wait for its nodes or "
                      "pass --workers N"] * 2, result.stderr[-3000:]
    assert not list((tmp_path / "epochs").glob("**/*.parquet")) and not (tmp_path / "corpus").exists()
    (part,) = [line.split(" | ", 1)[1] for line in result.stdout.splitlines() if line.startswith("part |")]
    assert part.startswith("an actor on Ray node ") and "cannot load its inputs: " in part, part
    assert "partial-corpus/train/" in part and "is missing or has another size than corpus.json says" in part, part
    assert not list((tmp_path / "written").glob("**/*.parquet"))


def test_actors_share_a_gpu_as_asked_and_cpu_actors_are_one_per_worker(capsys):
    """`[generate] actors_per_gpu`: k actors a GPU, each asking Ray for 1/k of it (one actor's host side bounds
    what it gives its GPU); workers count devices, never more than the cluster's GPUs; CPU actors ignore it."""
    from generate.job import actor_plan
    count, options = actor_plan(workers=2, gpus=8, actors_per_gpu=4)
    assert count == 8 and options["num_gpus"] == options["num_cpus"] == 0.25 and options["max_concurrency"] == 2
    count, options = actor_plan(workers=16, gpus=8, tasks_in_flight=3, actors_per_gpu=2)
    assert count == 16 and options["num_gpus"] == 0.5 and options["max_concurrency"] == 3
    assert "16 workers asked, the cluster has 8 GPU(s); using 8" in capsys.readouterr().out
    count, options = actor_plan(workers=3, gpus=0, actors_per_gpu=4)
    assert count == 3 and options["num_gpus"] == 0 and options["num_cpus"] == 1 and options["max_concurrency"] == 1


PLACEMENT_PROBE = """
import os, sys, threading, time
import ray, torch
torch.cuda.device_count = lambda: 1  # a 1-GPU machine as Ray sees it; the probes never touch a GPU
from common.parallel import start_ray
from generate.job import actor_plan, wait_until_placed

@ray.remote
class Probe:
    def ready(self):
        return True

start_ray(None, 1)  # as `make generate-epochs` starts it there: a CPU per worker, the machine's GPUs
count, options = actor_plan(1, 1, actors_per_gpu=3)
wait_until_placed([Probe.options(**options).remote() for _ in range(count)], options, note_after=2)
print("placed", count, flush=True)
unplaceable = Probe.options(**{**options, "num_cpus": 2}).remote()
threading.Thread(target=wait_until_placed, args=([unplaceable], {**options, "num_cpus": 2}, 2), daemon=True).start()
time.sleep(5)
os._exit(0)
"""


def test_a_gpus_actors_are_all_placed_on_a_local_ray_and_one_that_cannot_be_is_named(env_with_repo):
    """`actors_per_gpu = 3` on a 1-GPU machine without --address (local Ray, one CPU per worker): all three
    actors start (each asked a whole CPU before: two waited forever); an actor Ray cannot
    place is reported with what it asks and what is free."""
    result = subprocess.run([sys.executable, "-c", PLACEMENT_PROBE], cwd=ROOT, env=env_with_repo,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "placed 3" in result.stdout, result.stdout[-3000:]
    # a note before all three started (a busy machine) says they are starting, never that they do not fit
    assert "lower --workers" not in result.stdout.split("placed 3")[0], result.stdout[-3000:]
    assert re.search(r"generate: 1 of 1 actors not started after \d+ s; each asks Ray for 2 CPU and 0.333+ GPU, "
                     r"the cluster has [\d.]+ CPU and [\d.]+ GPU free \(lower --workers", result.stdout), result.stdout[-3000:]


def test_a_stragglers_copy_goes_to_an_idle_actor_of_its_device_model_with_nothing_in_flight():
    """The copy's actor holds no other shard (the memory check sized each for the shards it was to hold) and
    has the straggler's device model (another's kernels round otherwise: the copy finishing second would
    replace the recorded bytes with others)."""
    from generate.job import spare_actor
    a, b, c, d = (object() for _ in range(4))  # actors: a straggles; b busy; c another model; d fits
    model_of = {id(a): "H100 sm90", id(b): "H100 sm90", id(c): "A100 sm80", id(d): "H100 sm90"}
    pending = {"f1": (a, "task 1"), "f2": (b, "task 2")}
    assert spare_actor([b, c, d], pending, model_of, a) is d
    assert spare_actor([b, c], pending, model_of, a) is None
    assert spare_actor([d], pending, {**model_of, id(a): None}, a) is None  # the straggler's model unknown


def test_actors_waiting_on_resources_that_are_free_are_said_to_be_still_starting():
    from generate.job import not_started_note
    options = {"num_cpus": 1, "num_gpus": 0.25}
    assert not_started_note(2, 4, 60, options, {"CPU": 3.0, "GPU": 0.5}).endswith(
        "the cluster has 3 CPU and 0.5 GPU free (enough: they are still starting, loading the aux model on a busy machine)")
    assert not_started_note(2, 4, 60, options, {"CPU": 3.0}).endswith("0 GPU free (lower --workers or [generate] "
                                                                     "actors_per_gpu, or add nodes)")
    # nothing free, but what is held covers all 4 actors (Ray reserved their shares; the processes still start)
    assert not_started_note(2, 4, 60, options, {"CPU": 0.0001, "GPU": 0.0001}, {"CPU": 4.0, "GPU": 1.0}).endswith(
        "(the rest held, enough for all 4: they are still starting, loading the aux model on a busy machine)")
    assert not_started_note(2, 4, 60, options, {"CPU": 0.0001, "GPU": 0.0001}, {"CPU": 3.0, "GPU": 1.0}).endswith(
        "(lower --workers or [generate] actors_per_gpu, or add nodes)")  # one CPU short of four actors


def test_a_shards_record_says_where_its_time_went(built, tmp_path):
    """`phase_seconds`: reading, masking, waiting for the device, the aux model and sampling, labels, writing;
    in that order, adding up to the shard's time; a wait for the device lock (another shard's turn) is counted
    as waiting, not as device time."""
    import threading
    import time
    from common.corpus import SplitRows
    from generate.worker import ShardWriter
    g = GenerateConfig(epochs=1, rows_per_shard=64, valid_rows=0, rows_per_epoch=64)
    task = plan_tasks(len(load_split(built.corpus_dir, "train")), 0, g, built.seed)[0]
    corruptor = Corruptor(built.aux_dir / AUX_FILE, built.seed, 0.15, 2048)
    writer = ShardWriter({"train": SplitRows(built.corpus_dir, "train")}, corruptor, tmp_path)
    class DeviceLock:  # the actor's lock, noting when the shard asks for it
        def __init__(self):
            self.lock, self.asked = threading.Lock(), None

        def __enter__(self):
            self.asked = time.perf_counter()
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()
    device, records = DeviceLock(), []
    with device.lock:  # another shard on the device until half a second after this one asked for it
        worker = threading.Thread(target=lambda: records.append(writer(task, device)))
        worker.start()
        while device.asked is None:
            time.sleep(0.01)
        time.sleep(0.5)
        released = time.perf_counter()
    worker.join()
    phases = records[0]["phase_seconds"]
    assert list(phases) == ["read", "prepare", "wait", "device", "finish", "write"]
    assert min(phases.values()) >= 0 and phases["device"] > 0 and phases["write"] > 0
    # the wait runs from the end of masking (before the ask) to the lock taken (after the release): at least
    # the time the lock was held past the ask, none of it counted as device time
    assert phases["wait"] >= released - device.asked
    assert sum(phases.values()) <= records[0]["seconds"] + 1e-3


def test_a_batch_of_rows_of_one_length_goes_to_the_aux_model_without_a_mask(built):
    """Rows grouped by length: a batch with no padded row carries no attention mask (one attention bias for the
    batch, `common.model.Encoder.forward`), with the aux model's logits of an all-True mask bit for bit; a
    batch of mixed lengths keeps its mask."""
    import torch
    from common.batching import attention_mask
    rows = [r for r in load_split(built.corpus_dir, "train") if len(r) == 32][:6]
    rows += [r[:20] for r in rows[:2]] + [rows[0][:25]]  # 6 rows of 32 tokens, 3 shorter ones
    corruptor = Corruptor(built.aux_dir / AUX_FILE, seed=3, mask_prob=0.15, batch_tokens=3 * 32)
    _, _, batches = corruptor.masked_batches(rows, np.arange(len(rows)), 0)
    assert [len(batch) for batch, *_ in batches] == [3, 3, 3]  # 20, 20, 25 tokens; twice 3 x 32
    assert [attn is None for _, _, attn, _ in batches] == [False, True, True]
    assert not batches[0][2].all()
    _, ids, _, flags = batches[1]
    with torch.no_grad():
        assert torch.equal(corruptor.aux_logits(ids, None, flags).clone(),
                           corruptor.aux_logits(ids, attention_mask([32] * 3, 32), flags))


def test_the_generation_memory_estimate_grows_with_the_work_and_meets_a_measured_cpu_actor():
    """`common.memory.generation_need`: more tokens per batch, longer rows, longer shards and more of them in
    flight need more; a batch holds a row at least and a shard at most; past a chunk of sampling the
    vocabulary adds no positions; a GPU actor's host holds only the shards. Against a real CPU actor writing a
    shard of 1,024 rows of 128 tokens twice, in batches of 32,768 tokens, one of them padded (`bench.scale`'s
    probe; measured 0.956 of its rise)."""
    from bench.scale import run_probe
    from common.memory import AuxShape, GEN_FIXED, GEN_PER_SHARD_TOKEN, aux_shape, generation_need
    shape = AuxShape(hidden=768, ffn=3072, heads=12, vocab=128000)
    need = lambda **kw: generation_need(shape, **{"batch_tokens": 32768, "seq_len": 512, "shard_tokens": 2**20,
                                                  "in_flight": 1, "mask_prob": 0.15, **kw})[0]
    host = need()
    assert need(batch_tokens=65536) > host and need(seq_len=1024) > host and need(in_flight=2) > host
    assert need(shard_tokens=2**21) > host
    assert need(batch_tokens=1) == need(batch_tokens=512)  # a batch holds one row at least
    assert need(batch_tokens=2**22, shard_tokens=2**16) == need(batch_tokens=2**16, shard_tokens=2**16)
    wide = AuxShape(hidden=768, ffn=3072, heads=12, vocab=256000)
    assert generation_need(wide, 32768, 512, 2**20, 1, 0.15)[0] == host  # a chunk holds 2^26 entries either way
    gpu_host, gpu_device = generation_need(shape, 32768, 512, 2**20, 1, 0.15, gpu=True)
    assert gpu_host == GEN_FIXED + GEN_PER_SHARD_TOKEN * 2**20 and 0 < gpu_device < host
    # a Hugging Face family naming its widths otherwise (DistilBERT: dim, hidden_dim, n_heads)
    from transformers import DistilBertConfig
    hf = types.SimpleNamespace(model=types.SimpleNamespace(config=DistilBertConfig(dim=64, hidden_dim=96, n_heads=4)))
    assert aux_shape(hf, 320) == AuxShape(hidden=64, ffn=96, heads=4, vocab=320)
    measured = run_probe("generation", 2, 128, 4, 8000, 128, 32768, 1024, "padded")
    assert 0.75 <= measured["estimate_over_measured"] <= 1.33, measured


def _report(node, need, free, gpu=None, device_need=0.0, device_free=0.0):
    return {"host": f"host-{node}", "node": node, "shape": "32 wide", "host_need": need, "host_free": free,
            "host_source": "available RAM (MemAvailable)", "gpu": gpu, "device_need": device_need,
            "device_free": device_free, "device_source": "free memory of the GPU"}


def test_actors_memory_is_checked_per_gpu_and_per_machine():
    """`generate.job.memory_problem`: the actors sharing a GPU against its free memory, those of a machine
    against its RAM, each with a tenth kept; what fits says nothing, what does not names the place, both
    numbers and what to set (settings that keep the shards' bytes first)."""
    from generate.job import memory_problem
    gib = 2**30
    cpu = [_report("a", 3 * gib, 10 * gib), _report("a", 3 * gib, 10 * gib), _report("b", 3 * gib, 4 * gib)]
    assert memory_problem(cpu, 4096, 1) is None  # 6 of 9 GiB on a, 3 of 3.6 on b
    problem = memory_problem(cpu + [_report("b", 3 * gib, 4 * gib)], 4096, 1)
    assert problem.startswith("2 generation actor(s) on host-b would need about 6.00 GiB more at their peak (3.00 "
                              "GiB each: batches of 4,096 tokens through an aux model 32 wide"), problem
    assert ("available RAM (MemAvailable) is 4.00 GiB (the actors may plan on 90% of it); 1 fit there: lower "
            "--workers (make's WORKERS=; it counts the cluster's actors, 4 now)") in problem, problem
    assert "one actor does not fit" in memory_problem(cpu, 4096, 1, override=str(3 * gib))
    assert "is 400 MiB" in memory_problem(cpu, 4096, 1, override=str(400 * 2**20))
    gpus = [_report("a", gib, 64 * gib, gpu=str(k % 2), device_need=7 * gib, device_free=20 * gib) for k in range(4)]
    assert memory_problem(gpus, 4096, 2) is None  # 2 actors of 7 GiB on each GPU of 20
    problem = memory_problem(gpus + [_report("a", gib, 64 * gib, "1", 7 * gib, 20 * gib)], 4096, 3)
    assert problem.startswith("3 generation actor(s) on GPU 1 of host-a would need about 21.00 GiB"), problem
    assert problem.endswith("free memory of the GPU is 20.00 GiB (the actors may plan on 90% of it); set "
                            "[generate] actors_per_gpu = 2 (now 3)"), problem
    # GPU 1 of another machine is another GPU
    assert memory_problem(gpus + [_report("c", gib, 64 * gib, "1", 7 * gib, 20 * gib)], 4096, 2) is None
    assert "one actor does not fit" in memory_problem([_report("a", gib, 64 * gib, "0", 30 * gib, 20 * gib)], 4096, 1)
    short = [_report("a", 20 * gib, 100 * gib, str(k), gib, 20 * gib) for k in range(8)]  # 4 of 8 actors fit its RAM
    assert memory_problem(short, 4096, 2).endswith("4 fit there: set [generate] tasks_in_flight = 1, or lower --workers")
    two_each = [_report("a", 5 * gib, 100 * gib, str(k % 4), gib, 20 * gib) for k in range(8)]  # 2 on each of 4 GPUs
    assert memory_problem(two_each, 4096, 2) is None
    assert memory_problem(two_each, 4096, 2, override=str(30 * gib)).endswith(
        "5 fit there: set [generate] actors_per_gpu = 1 (now 2)")


@pytest.mark.slow
def test_generation_that_would_not_fit_stops_before_any_shard_with_one_line(built, tmp_path, env_with_repo):
    """The real CLI, two CPU actors on this machine whose RAM (FAST_ELECTRA_MEMORY_BYTES, read by the driver)
    holds one actor's estimated peak but not two: exit code 2, one line naming each actor's need as computed
    from the actors' own inputs (aux widths, batch and shard sizes, row length), the numbers and `--workers`,
    no shard written."""
    import subprocess
    import sys
    from common.checkpoint import load_aux
    from common.memory import GEN_HEADROOM, aux_shape, generation_need
    from generate.job import _size
    from tests.conftest import ROOT
    model, meta = load_aux(built.aux_dir / AUX_FILE)
    seq_len, rows, batch = built.corpus.max_seq_len, 400, 4096
    each, _ = generation_need(aux_shape(model, meta["vocab_size"]), batch, seq_len, rows * seq_len, 1,
                              built.generate.mask_prob)
    manifest, out = tmp_path / "m.toml", tmp_path / "epochs"
    manifest.write_text(dump_toml(built))
    budget = 1.5 * each / GEN_HEADROOM
    result = subprocess.run([sys.executable, "-m", "generate", "--manifest", str(manifest), "--out", str(out),
                             "--workers", "2", "--set", f"generate.rows_per_shard={rows}",
                             "--set", f"generate.batch_tokens={batch}"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**env_with_repo, "FAST_ELECTRA_MEMORY_BYTES": str(int(budget)),
                                              "TQDM_DISABLE": "1"})
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "generation actor(s)" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"({_size(each)} each: batches of 4,096 tokens" in errors[0], (errors[0], each)
    assert f"FAST_ELECTRA_MEMORY_BYTES is {_size(budget)}" in errors[0] and "1 fit there: lower --workers" in errors[0]
    assert not list(out.rglob("*.parquet")) and not (out / "progress.jsonl").exists()


def test_the_manifests_own_aux_model_made_by_other_aux_settings_is_refused(built, tmp_path, capsys):
    """No --aux: the aux model in the manifest's work folder must be the one its [aux] settings make; one of
    other settings (here a 3-layer aux asked, a 2-layer one there) is one error line before any work."""
    from generate.__main__ import main as generate_main
    manifest, out = tmp_path / "m.toml", tmp_path / "epochs"
    manifest.write_text(dump_toml(built))
    assert generate_main(["--manifest", str(manifest), "--out", str(out), "--set", "aux.num_layers=3"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {built.aux_dir / AUX_FILE} was not made by this manifest's [aux] settings, corpus and "
                   f"source (trained here): `make aux` (python -m auxiliary) makes it, or name an aux model with "
                   f"--aux\n"), err
    assert not out.exists()


def test_workers_default_to_the_cores_this_process_may_use_not_the_hosts(tmp_path, monkeypatch):
    """A container limited to 8 of a host's 128 cores (its cpuset, or its cgroup's quota: `docker run --cpus`)
    starts 8 workers of the corpus and of a CPU generation, not 128 of about 250 MB each."""
    from common import parallel
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(parallel, "CGROUP_V1_QUOTA", (str(tmp_path / "none"), str(tmp_path / "none")))
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(parallel, "CGROUP_CPU_MAX", str(cpu_max))
    assert parallel.available_cpus() == 16  # no quota file: the affinity
    cpu_max.write_text("max 100000\n")
    assert parallel.available_cpus() == 16
    cpu_max.write_text("750000 100000\n")  # 7.5 cores: 8 workers
    assert parallel.available_cpus() == 8
    cpu_max.write_text("5000 100000\n")
    assert parallel.available_cpus() == 1
    cpu_max.unlink()
    quota, period = tmp_path / "quota", tmp_path / "period"
    monkeypatch.setattr(parallel, "CGROUP_V1_QUOTA", (str(quota), str(period)))
    quota.write_text("400000\n")
    period.write_text("100000\n")
    assert parallel.available_cpus() == 4  # cgroup v1
    quota.write_text("-1\n")
    assert parallel.available_cpus() == 16
    if not __import__("torch").cuda.is_available():
        assert parallel.default_workers() == 16
