"""train/state.py: a checkpoint saved and restored in one place; resume compares only the settings that
change the updates, so editing [sweep], [reproduce] or the logging intervals does not stop `make train`."""
import dataclasses

import pytest
import torch

from common.checkpoint import IncompatibleInputs
from common.config import ConfigError, dump_toml, load_manifest, trajectory_config, config_to_dict
from common.model import ReplacedTokenDetector
from common.optim import build_optimizer, build_scheduler
from tests.conftest import tiny_config
from train import state


def _parts(config):
    torch.manual_seed(0)
    model = ReplacedTokenDetector(config.model, 320)
    optimizer = build_optimizer(model, config.train.lr, config.train.betas, config.train.eps,
                                config.train.weight_decay)
    return model, optimizer, build_scheduler(optimizer, 2, 10)


def _saved_run(tmp_path):
    config = tiny_config(tmp_path)
    model, optimizer, scheduler = _parts(config)
    model(torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.bool)).sum().backward()
    optimizer.step()
    scheduler.step()
    progress = state.Progress(step=1, history={"start": {"step": 0}}, nonfinite_total=2, nonfinite_run=0)
    state.save(tmp_path / "ckpt", 2, progress, model, optimizer, scheduler, config, "data-key", 0, 1,
               torch.device("cpu"))
    return config, model


def _restore(tmp_path, config, key="data-key"):
    model, optimizer, scheduler = _parts(config)
    return state.restore(tmp_path / "ckpt", model, optimizer, scheduler, config, key, "DATA", 0, 1,
                         torch.device("cpu")), model


def test_restore_returns_the_saved_weights_and_progress(tmp_path):
    config, trained = _saved_run(tmp_path)
    (path, progress), model = _restore(tmp_path, config)
    assert path.name == "step-00000001.pt"
    assert progress == state.Progress(1, {"start": {"step": 0}}, 2, 0)
    for a, b in zip(model.state_dict().values(), trained.state_dict().values()):
        assert torch.equal(a, b)


def test_resume_ignores_settings_that_do_not_change_the_updates(tmp_path):
    config, _ = _saved_run(tmp_path)
    config.sweep.train = {"lr": [1e-4, 1e-3]}
    config.reproduce.budget_s = 60.0
    config.train.eval_every, config.train.log_every, config.train.ckpt_every = 7, 3, 9
    config.train.tensorboard = True
    config.aux.eval_every, config.aux.log_every, config.aux.ckpt_every = 5, 2, 11  # the aux run's own intervals
    config.generate.actors_per_gpu, config.generate.tasks_in_flight = 4, 3  # the generator's scheduling only
    config.generate.gamma_max, config.generate.soh_alpha = 0.3, 0.2  # not read by temperature scaling
    config.train.micro_batch = 4  # what the memory check asks of a run resumed on smaller GPUs
    config.work_dir = str(tmp_path / "elsewhere")
    assert _restore(tmp_path, config)[0] is not None


def test_a_resume_on_another_number_of_ranks_draws_dropout_anew_not_step_0s_masks_again(tmp_path):
    """The saved streams are one per rank: with another world size none is restored, and each rank's stream is
    seeded from the seed, its rank and the step, not set back to the stream the run started with."""
    config, _ = _saved_run(tmp_path)
    path = tmp_path / "ckpt" / "step-00000001.pt"
    saved = torch.load(path, weights_only=False)
    saved["world_size"] = 2  # saved by two ranks; resumed by one
    torch.save(saved, path)
    draws = []
    for _ in range(2):
        model, optimizer, scheduler = _parts(config)
        torch.manual_seed(config.train.seed + 1000)  # what the trainer sets before it restores, rank 0
        assert state.restore(tmp_path / "ckpt", model, optimizer, scheduler, config, "data-key", "DATA", 0, 1,
                             torch.device("cpu"))
        draws.append(torch.rand(8))
    torch.manual_seed(config.train.seed + 1000)
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], torch.rand(8))


def test_the_aux_models_run_resumes_whatever_generate_and_the_rtd_weight_say(tmp_path):
    """The `mlm` objective (the aux run, shared by every ablation) reads neither: an aux run interrupted under
    one manifest resumes under another that edits them."""
    config = tiny_config(tmp_path, train={"objective": "mlm"})
    model, optimizer, scheduler = _parts(config)
    state.save(tmp_path / "ckpt", 2, state.Progress(step=1, history={}), model, optimizer, scheduler, config,
               "data-key", 0, 1, torch.device("cpu"))
    config.generate.t0, config.generate.mask_prob, config.train.electra_lambda = 3.0, 0.2, 7.0
    assert _restore(tmp_path, config)[0] is not None
    config.aux.mask_prob = 0.3  # what it does read
    with pytest.raises(IncompatibleInputs, match=r"aux\.mask_prob changed"):
        _restore(tmp_path, config)


def test_the_rtd_weight_of_electra_counts_for_electra_runs_only(tmp_path):
    """`train.electra_lambda` weighs the `electra` objective's RTD loss and nothing else: a fast-offline run
    resumes whatever it says (a preset giving the baseline its paper value), an electra run does not."""
    config, _ = _saved_run(tmp_path)
    config.train.electra_lambda = 70.0
    assert _restore(tmp_path, config)[0] is not None
    config = tiny_config(tmp_path / "electra", train={"objective": "electra"})
    model, optimizer, scheduler = _parts(config)
    state.save(tmp_path / "electra" / "ckpt", 2, state.Progress(step=1, history={}), model, optimizer, scheduler,
               config, "data-key", 0, 1, torch.device("cpu"))
    config.train.electra_lambda = 70.0
    with pytest.raises(IncompatibleInputs, match=r"train\.electra_lambda changed"):
        _restore(tmp_path / "electra", config)


def test_resume_refuses_a_changed_trajectory_naming_the_keys(tmp_path):
    config, _ = _saved_run(tmp_path)
    config.corpus.source = "/mnt/moved/raw"  # the text mounted elsewhere: its rows are in the data's key
    config.train.compile, config.train.attention = "on", "sdpa"  # turned off or changed after one failed
    assert _restore(tmp_path, config)[0] is not None
    config.corpus.max_seq_len = 64  # what makes other rows of it
    with pytest.raises(IncompatibleInputs, match=r"corpus\.max_seq_len changed"):
        _restore(tmp_path, config)
    config.corpus.max_seq_len = 32
    config.train.lr, config.generate.t0 = 5e-3, 3.0
    with pytest.raises(IncompatibleInputs, match=r"generate\.t0, train\.lr changed"):
        _restore(tmp_path, config)
    with pytest.raises(IncompatibleInputs, match="data manifest"):
        _restore(tmp_path, tiny_config(tmp_path), key="other-data")


def test_a_checkpoint_of_a_model_this_code_no_longer_builds_is_refused_in_one_line(tmp_path):
    """The same settings, another model (an electra run saved when its generator was 1/3 of the main depth):
    an error naming the checkpoint, not torch's traceback of missing keys."""
    from train.objectives import ElectraPair
    config = tiny_config(tmp_path, train={"objective": "electra"})
    torch.manual_seed(0)
    old = ElectraPair(config.model, 320, 1)  # the former depth, round(2 / 3)
    optimizer = build_optimizer(old, config.train.lr, config.train.betas, config.train.eps, config.train.weight_decay)
    state.save(tmp_path / "ckpt", 2, state.Progress(step=1, history={}), old, optimizer,
               build_scheduler(optimizer, 2, 10), config, "data-key", 0, 1, torch.device("cpu"))
    model = ElectraPair(config.model, 320, config.aux.num_layers)
    optimizer = build_optimizer(model, config.train.lr, config.train.betas, config.train.eps, config.train.weight_decay)
    with pytest.raises(IncompatibleInputs, match=r"step-00000001\.pt holds a model of another shape"):
        state.restore(tmp_path / "ckpt", model, optimizer, build_scheduler(optimizer, 2, 10), config, "data-key",
                      "DATA", 0, 1, torch.device("cpu"))


def test_trajectory_config_keeps_what_decides_the_updates(tmp_path):
    kept = trajectory_config(config_to_dict(tiny_config(tmp_path)))
    assert "sweep" not in kept and "reproduce" not in kept and "work_dir" not in kept
    assert {"lr", "max_steps", "seed", "batch_size"} <= set(kept["train"]) and "eval_every" not in kept["train"]
    assert {"model", "generate", "corpus", "tokenizer", "aux", "seed"} <= set(kept)


def test_set_overrides_any_manifest_key_and_refuses_unknown_ones(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(dump_toml(tiny_config(tmp_path)))
    config = load_manifest(path, ["train.lr=2e-3", "generate.schedule=constant", "sweep.train.lr=[1e-4, 2e-4]"])
    assert (config.train.lr, config.generate.schedule, config.sweep.train) == (2e-3, "constant", {"lr": [1e-4, 2e-4]})
    with pytest.raises(ConfigError, match="train.no_such_key"):
        load_manifest(path, ["train.no_such_key=1"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_manifest(path, ["train.lr"])
    # a section given as a table overrides its keys as `extends` does, not the whole section with defaults
    config = load_manifest(path, ["train={lr=2e-3}"])
    assert config.train == dataclasses.replace(tiny_config(tmp_path).train, lr=2e-3)
    config = load_manifest(path, ["sweep.train={warmup_steps=[1, 2]}", "sweep.train={lr=[1e-4]}"])
    assert config.sweep.train == {"lr": [1e-4]}  # a table-valued setting is a value: replaced


def test_a_rank_without_a_gpu_of_its_own_stops_with_a_clear_error(monkeypatch):
    """Two ranks on a 1-GPU machine: rank 1 stops naming the GPU count and the ways out, before any
    CUDA call (seen on an H100 machine as CUDA's 'invalid device ordinal')."""
    from common.config import ConfigError
    from common.distributed import setup_distributed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device reached"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match=r"local rank 1\) has no GPU of its own: this machine shows 1 .*NPROC=1.*CUDA_VISIBLE_DEVICES="):
        setup_distributed()


def _restore_on_rank(rank, tmp_path, results):
    """Rank `rank` of two gloo ranks: restores from the shared folder, then with rank 1 looking elsewhere."""
    import os
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=rank, world_size=2)
    config = tiny_config(tmp_path)
    for case, folders in (("shared", ("ckpt", "ckpt")), ("node-local", ("ckpt", "node-local"))):
        model, optimizer, scheduler = _parts(config)
        try:
            found = state.restore(tmp_path / folders[rank], model, optimizer, scheduler, config, "data-key",
                                  "DATA", rank, 2, torch.device("cpu"))
            results[(case, rank)] = f"step {found[1].step}"
        except IncompatibleInputs as e:
            results[(case, rank)] = str(e)
    dist.barrier()
    # The group is never torn down, as a trainer's rank ends (train/__main__.py, `leave`): with a barrier before
    # it, gloo's teardown still aborted a rank under load ("terminate called without an active exception",
    # session 27's `make test`). An error above ends the process as any exception does.
    os._exit(0)


def test_every_rank_resumes_from_the_same_checkpoint_or_none_does(tmp_path):
    """Two gloo ranks: on a shared run folder both resume at step 1; where rank 1 sees another folder (a
    node-local run folder: no checkpoint there) both stop with the same error instead of rank 1 starting over."""
    import torch.multiprocessing as mp
    _saved_run(tmp_path)
    (tmp_path / "node-local").mkdir()
    results = mp.Manager().dict()
    mp.spawn(_restore_on_rank, args=(tmp_path, results), nprocs=2)
    assert results[("shared", 0)] == results[("shared", 1)] == "step 1"
    for rank in (0, 1):
        message = results[("node-local", rank)]
        assert "step-00000001.pt on rank 0; none on rank 1" in message and "shared file system" in message, message


def test_a_second_ctrl_c_stops_at_once():
    """The first Ctrl-C in the loop asks for a stop after the update in flight; a second one (the user does not
    want to wait for it) stops at once, as Stopped, which ends the trainer with 130; SIGTERM never does."""
    import signal
    from train.trainer import StopRequest, Stopped
    stop = StopRequest()
    stop.armed = True
    stop._ask(signal.SIGTERM, None)
    stop._ask(signal.SIGTERM, None)  # a scheduler's repeated SIGTERM waits for the checkpoint too
    stop = StopRequest()
    stop.armed = True
    stop._ask(signal.SIGINT, None)
    assert stop.signal == signal.SIGINT and stop.name == "Ctrl-C"
    with pytest.raises(Stopped) as stopped:
        stop._ask(signal.SIGINT, None)
    assert stopped.value.signum == signal.SIGINT


def test_every_shard_a_followed_run_reads_is_hashed_by_one_rank_that_reads_it():
    """train.verify_shards with --follow: each shard is hashed as it arrives by one of the ranks whose slices of
    the batches hold its rows (was: rank k % W only if it happened to read it: with shards smaller than a rank's
    share, 20 of 34 shards hashed at 2 ranks, batch 160, 40-row shards)."""
    import random
    from train.data import hashed_by, rank_slice
    rng = random.Random(0)
    for _ in range(300):
        world = rng.choice([1, 2, 4, 8])
        batch = world * rng.randint(1, 40)
        rows_per_shard = rng.randint(1, 3 * batch)
        for k in range(12):
            start = k * rows_per_shard
            readers = {r for step in range(start // batch, (start + rows_per_shard - 1) // batch + 1)
                       for r in range(world) if max(start, rank_slice(step, batch, r, world)[0]) <
                       min(start + rows_per_shard, rank_slice(step, batch, r, world)[1])}
            assert hashed_by(start, rows_per_shard, k, world, batch) in readers, (world, batch, rows_per_shard, k)
