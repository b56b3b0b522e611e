"""Benchmark results carry docs/design.md's key names (the contract other tools read)."""
import json
import math
import os

import pytest
import torch

from bench import train as bench_train
from bench.efficiency import design_ratios
from common.config import config_to_dict
import train.trainer as trainer

DESIGN_KEYS = {"train": ["step_vs_inmemory", "loader_vs_consumption"],
               "efficiency": ["offline_vs_electra_time", "offline_vs_electra_memory", "online_vs_electra_time",
                              "analytic_offline_vs_electra"]}


def test_efficiency_ratios_use_the_design_names():
    seconds = {"electra": 2.0, "fast-online": 1.5, "fast-offline": 1.0}
    memory = {"electra": 1000.0, "fast-online": 800.0, "fast-offline": 700.0}
    analytic = {"paper_convention": {"offline_vs_electra": 0.56, "online_vs_electra": 0.7},
                "as_executed": {"offline_vs_electra": 0.61, "online_vs_electra": 0.74}}
    ratios = design_ratios(seconds, memory, analytic)
    assert set(DESIGN_KEYS["efficiency"]) <= set(ratios)
    assert ratios["offline_vs_electra_time"] == 0.5 and ratios["online_vs_electra_time"] == 0.75
    assert ratios["offline_vs_electra_memory"] == 0.7 and ratios["online_vs_electra_memory"] == 0.8
    assert ratios["analytic_offline_vs_electra"] == 0.56 and ratios["analytic_offline_vs_electra_as_executed"] == 0.61


@pytest.mark.slow
def test_bench_train_writes_the_design_keys(generated, tmp_path, capsys):
    """A real (short) bench-train over generated shards: its JSON has the contract's ratios."""
    manifest, data, _ = generated
    assert bench_train.main(["--manifest", str(manifest), "--data", str(data), "--steps", "2", "--block", "1",
                             "--out", str(tmp_path)]) == 0
    stem = "train-gpu" if torch.cuda.is_available() else "train"  # as bench.train names its results
    result = json.loads((tmp_path / f"{stem}.json").read_text())
    for key in DESIGN_KEYS["train"]:
        assert result[key] > 0, key
    assert 0 < result["optimizer_step_ratio"] and result["optimizer_step_s_fused_median"] > 0
    assert "| update on shards / on an in-memory batch" in (tmp_path / f"{stem}.md").read_text()


@pytest.mark.slow
def test_bench_train_times_the_trainers_own_update_function(generated, tmp_path, monkeypatch):
    """Every update bench-train times is a call of `train.trainer.update`, the function the trainer's
    loop calls (counted through a wrapper that calls it: the update itself runs unchanged)."""
    import train.trainer as trainer
    manifest, data, _ = generated
    calls, real = [], trainer.update
    monkeypatch.setattr(trainer, "update", lambda *a, **k: (calls.append(len(a[4])), real(*a, **k))[1])
    assert bench_train.main(["--manifest", str(manifest), "--data", str(data), "--steps", "2", "--block", "1",
                             "--out", str(tmp_path)]) == 0
    assert len(calls) == 2 + 2 * 2  # 2 warm-up updates, then 2 timed updates in each of the two modes


def test_the_experiments_time_and_train_through_the_trainers_own_update_function(built, generated, monkeypatch,
                                                                                    capsys):
    """`make reproduce`'s update timing and the tiny ablation tool call `train.trainer.update` (counted through a
    wrapper that calls it) with the objective they stand for; the ablation's weights learn (loss is finite)."""
    from experiments import ablate_tiny, reproduce
    calls, real = [], trainer.update
    monkeypatch.setattr(trainer, "update", lambda *a, **k: (calls.append(a[9].objective), real(*a, **k))[1])
    for objective in ("electra", "fast-offline"):
        assert reproduce.measure_update_seconds(built, objective, built.corpus_dir, repeats=2) > 0
    assert calls == ["electra"] * 3 + ["fast-offline"] * 3
    manifest, data = generated[:2]
    assert ablate_tiny.main(["--manifest", str(manifest), "--data", str(data), "--steps", "2"]) == 0
    assert calls[6:] == ["fast-offline"] * 2
    out = capsys.readouterr().out
    assert "step     2  val loss" in out
    loss = float(out.split("step     2  val loss")[1].split()[0])
    assert math.isfinite(loss) and 0 < loss < 5, out
    # a user's mistake is one line, not a traceback
    assert ablate_tiny.main(["--manifest", str(manifest), "--data", str(data.parent / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {data.parent / 'nowhere'}")


def test_bench_aux_probe_trains_through_the_update_and_reports_json(monkeypatch):
    """`make bench-aux`'s probe in its own process (as `bench.aux.measure` runs it): two updates of the trainer's
    own function at a small shape, the losses and peak memory printed as JSON."""
    from bench.aux import measure
    from tests.conftest import ROOT
    monkeypatch.chdir(ROOT)  # `python -m bench.aux`, as make runs it
    result = measure("manifests/tiny.toml", seq_len=32, batch=4, micro=2, steps=2, layers=1, hidden=32, vocab=512)
    assert len(result["losses"]) == 2 and all(5.0 < loss < 8.0 for loss in result["losses"])  # ln 512 = 6.24
    assert result["peak_rss_bytes"] > 0 and result["estimate_bytes"] > 0 and result["micro"] == 2


def test_bench_gpu_times_the_trainers_own_update_function(tmp_path, monkeypatch):
    """`make bench-gpu`'s MFU and efficiency parts time `train.trainer.update` (counted through a wrapper that
    calls it) with the objective each stands for, and their one-micro-batch figure `train.trainer.accumulate`;
    each names the attention backend it ran. Run here on the CPU at a tiny shape: the same functions the GPU
    run calls, only the device differs."""
    import gc
    from bench import gpu
    from tests.conftest import tiny_config
    config = tiny_config(tmp_path)
    calls, accumulated = [], []
    real_update, real_accumulate = trainer.update, trainer.accumulate
    monkeypatch.setattr(trainer, "update", lambda *a, **k: (calls.append((a[9].objective, len(a[4]))),
                                                            real_update(*a, **k))[1])
    monkeypatch.setattr(trainer, "accumulate", lambda *a, **k: (accumulated.append(a[6]), real_accumulate(*a, **k))[1])
    cpu = torch.device("cpu")
    mfu = gpu.measure_mfu(config, rows=2, accum=3, steps=2, device=cpu)
    assert calls == [("fast-offline", 3)] * (2 + 2)  # 2 warm-up updates, 2 timed, 3 micro-batches each
    assert accumulated == ["fast-offline"] * (4 + 2 + 1)  # inside each update, 2 timed micro-batches alone, 1 profiled
    assert mfu["tokens_per_update"] == 2 * 3 * 32 and mfu["model_flops_per_update"] > 0
    assert mfu["seconds_per_update"] > 0 and mfu["seconds_per_micro_batch_fwd_bwd"] > 0
    calls.clear()
    live = []  # parameters alive at each reset of the peak: electra's peak must not hold fast-offline's model
    real_reset = gpu.reset_peak_memory
    monkeypatch.setattr(gpu, "reset_peak_memory", lambda device: (
        real_reset(device), live.append(sum(type(o) is torch.nn.Parameter for o in gc.get_objects()))))
    efficiency = gpu.measure_efficiency(config, rows=2, accum=1, steps=2, device=cpu)
    # each mode's peak alone (2 updates), then both built: a warm-up each, and the timed updates alternating
    offline, electra = ("fast-offline", 1), ("electra", 1)
    assert calls == [offline] * 2 + [electra] * 2 + [offline, electra] * 3, calls
    assert (efficiency["timed_blocks"], efficiency["timed_updates_per_mode"]) == (2, 2)
    assert len(live) == 2 and live[1] == live[0], live
    assert efficiency["offline_vs_electra_time"] > 0 and efficiency["offline_vs_electra_memory"] > 0
    # the attention backend, named from the profiler: on CPU the fused kernel refuses a bias that needs a
    # gradient (the trainer's relative-position bias), so training runs the math path; the aux model's
    # forward (no gradient) runs the fused one
    assert mfu["sdpa_kernels"] == ["aten::_scaled_dot_product_attention_math"]
    generation = gpu.measure_generation(config, rows_per_shard=16, shards=2, device=cpu, profile=True, depths=(2, 3))
    assert generation["aux_sdpa_kernels"] == ["aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert generation["tokens"] == 2 * 16 * 32 and generation["gen_vs_forward"] > 0
    assert generation["forward_flops_per_s"] > 0 and generation["forward_peak_memory_gib"] > 0
    assert set(generation["gen_vs_forward_by_depth"]) == {2, 3} and generation["profiled_wall_s"] > 0
    assert generation["phase_seconds_per_shard"]["device"] > 0 and generation["generation_seconds_per_shard"] > 0
    assert 0 < generation["steady_seconds_per_shard"] and generation["gen_vs_forward_steady"] > 0
    assert generation["no_mask_logits_equal"] is True and generation["head_weight_logits_equal"] is True
    # the attention ways that run on a CPU (FlexAttention's backward does not): the same function as the model's
    # way within bf16 rounding, each naming its backend
    ways = ("sdpa_dense_bias", "sdpa_dense_dropout", "sdpa_head_bias", "sdpa_no_bias", "sdpa_bias_no_grad",
            "split_bias_grad")
    attention = gpu.measure_attention(config, rows=2, repeats=1, device=cpu, variants=ways)
    assert all(f"{way}_fwd_bwd_ms" in attention for way in ways), attention
    assert attention["sdpa_head_bias_max_rel_diff"] < 2e-2 and attention["fastest_same_function"] in ways
    # the bias's gradient computed beside a kernel that gives only q, k and v theirs: the table's gradient too
    assert attention["split_bias_grad_max_rel_diff"] < 2e-2
    # one chunk's draw both ways: the compiled blocked draw (a GPU Corruptor's) against the step-by-step one
    draws = gpu.measure_draws(config, device=cpu, repeats=1, warmup=0)  # 2 calls each, not 5
    assert draws["positions"] * draws["vocab"] <= 2**26 < (draws["positions"] + 1) * draws["vocab"]
    assert draws["same_id_fraction"] >= 0.98 and draws["top1_hits_equal"] is True
    assert attention["sdpa_dense_bias_kernels"] == ["aten::_scaled_dot_product_attention_math"]


def test_the_utilisation_is_against_the_peak_of_the_card_that_ran():
    """A PCIe or NVL card is not measured against its SXM part's peak; an unknown one gets no utilisation."""
    from bench.gpu import bf16_peak
    assert bf16_peak("NVIDIA H100 80GB HBM3") == bf16_peak("NVIDIA H200") == 989.4e12
    assert bf16_peak("NVIDIA H100 PCIe") == 756e12 and bf16_peak("NVIDIA H100 NVL") == bf16_peak("NVIDIA H200 NVL") == 835e12
    assert bf16_peak("NVIDIA A100-SXM4-80GB") == 312e12 and bf16_peak("NVIDIA B200") is None


def test_bench_gpu_times_generation_in_processes_sharing_the_device():
    """`generation_processes`: the shards split evenly over processes (3 asked over 2: 4, so neither waits on the
    other's last shard), each an actor of its own; every token counted once, from the moment all are ready."""
    from bench import gpu
    from common.config import load_manifest
    import time
    config = load_manifest("manifests/tiny.toml")
    t0 = time.perf_counter()
    out = gpu.measure_generation_processes(config, "manifests/tiny.toml", rows_per_shard=8, shards=3, processes=2,
                                           device=torch.device("cpu"))
    call = time.perf_counter() - t0
    # the timed window leaves out the processes' start (interpreters, torch, the aux model, a warm-up shard),
    # most of the call for shards this small
    assert out["tokens"] / out["tokens_per_s"] < 0.5 * call
    assert out["shards"] == 4 and out["tokens"] == 4 * 8 * config.corpus.max_seq_len and out["tokens_per_s"] > 0
    assert set(out["phase_seconds_per_shard"]) == {"read", "prepare", "wait", "device", "finish", "write"}
    assert out["steady_tokens_per_s"] > 0  # 2 of the 4 shards done after each process's first


def test_bench_gpu_refuses_an_unknown_part_before_it_needs_the_gpu(capsys):
    """A lent GPU's minutes are few: a mistyped `--only` stops at once, naming the parts, and every part the
    docs' commands name (the next GPU session's runbook among them) is one bench.gpu knows."""
    import re
    from bench import gpu
    from tests.conftest import ROOT
    with pytest.raises(SystemExit) as stopped:
        gpu.main(["--only", "mfu_compiled,mfu_compield"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "unknown part(s) mfu_compield" in err and "generation_processes" in err
    text = " ".join(p.read_text() for p in [*(ROOT / "docs").glob("*.md"), ROOT / "bench" / "gpu-call.sh"])
    named = re.findall(r"--only\s+([a-z_]+(?:,\s*[a-z_]+)*)", text)
    assert len(named) >= 4, named
    parts = {part.strip() for m in named for part in m.split(",")}
    assert parts <= set(gpu.PARTS), parts - set(gpu.PARTS)
    assert {"mfu_compiled", "mfu_compiled_sdpa", "generation_processes"} <= parts


def test_bench_gpu_mps_that_does_not_start_says_why_and_leaves_the_environment_as_it_was(tmp_path, monkeypatch):
    """`--mps` where nvidia-cuda-mps-control is not on PATH, or where it fails (a stand-in program that exits 1):
    not started, the reason recorded, and the MPS folders of the environment as they were before (a daemon of
    the machine's own stays reachable for the CUDA work that follows)."""
    from bench import gpu
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/the/machine's/pipe")
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    assert gpu.start_mps(tmp_path / "mps") == {"started": False, "error": "nvidia-cuda-mps-control is not on PATH"}
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\necho \"An instance of this daemon is already running\" >&2\nexit 1\n")
    control.chmod(0o755)
    started = gpu.start_mps(tmp_path / "mps")
    assert started == {"started": False, "error": "exit 1: An instance of this daemon is already running"}, started
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == "/the/machine's/pipe"
    assert "CUDA_MPS_LOG_DIRECTORY" not in os.environ


def test_bench_gpu_counts_the_aux_forward_as_generation_runs_it(tmp_path):
    """The aux forward's model FLOPs (`forward_vs_peak`'s numerator): every layer over every token, lookups
    free, the MLM head only at masked positions. By hand for the tiny test shape (d 32, ffn 64, 2 heads,
    2 aux layers, 32 tokens, 320 entries): per layer qkv 2*3*L*d^2 = 196,608, scores and their use of the values
    2 * 2*L^2*d = 131,072, softmax 3*h*L^2 = 6,144, output projection 2*L*d^2 = 65,536, feed-forward
    2*L*2*d*f = 262,144; per masked position 2*d^2 + 2*d*V = 22,528."""
    from bench import gpu
    from tests.conftest import tiny_config
    per_row = 2 * (196_608 + 131_072 + 6_144 + 65_536 + 262_144)
    assert gpu.aux_forward_flops(tiny_config(tmp_path), rows=3, masked=5) == 3 * per_row + 5 * 22_528


@pytest.mark.slow
def test_bench_generates_worker_scaling_runs_the_generators_ray_job(built, env_with_repo):
    """`make bench-generate`'s 1 vs 2 actor figure drives generate.job.run_tasks with the actors' own
    arguments: the same plan's tokens with each count (a changed actor signature would stop it)."""
    import subprocess
    import sys
    from tests.conftest import ROOT
    script = (f"import json; from common.config import config_from_dict; from bench.generate import worker_scaling; "
              f"from pathlib import Path; c = config_from_dict(json.loads({json.dumps(config_to_dict(built))!r})); "
              f"print(json.dumps(worker_scaling(c, Path({str(built.corpus_dir)!r}), "
              f"Path({str(built.aux_dir / 'aux.pt')!r}), rows_per_epoch=120)))")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env_with_repo, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["tokens"] > 0 and out["workers_1_tokens_per_s"] > 0 and out["workers_2_tokens_per_s"] > 0
    # timed from the first shard started to the last done: the actors' start-up outside, inside the wall time
    assert 0 < out["workers_1_seconds"] < out["workers_1_wall_seconds"]
