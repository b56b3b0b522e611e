"""A machine with NVIDIA GPUs whose torch cannot use them (a CPU-only build from an environment made on a
machine without GPUs, or a driver too old for the build) is refused by every stage that would otherwise run on
its CPU without a word: the trainer (8 gloo ranks instead of 8 GPUs), the generator's local Ray (CPU actors),
fine-tuning. `nvidia-smi` on PATH is what `make setup` looks for; here a stand-in script."""
import os
import stat

import pytest
import torch

from common.distributed import unusable_gpus
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="torch uses this machine's GPUs")


@pytest.fixture
def gpu_machine(tmp_path, monkeypatch):
    """PATH holds an `nvidia-smi`, as on a GPU node; CUDA_VISIBLE_DEVICES unset."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_a_torch_that_cannot_use_the_machines_gpus_is_named_with_the_remedy(gpu_machine, monkeypatch):
    problem = unusable_gpus("training")
    assert problem.startswith("this machine has NVIDIA GPUs (nvidia-smi lists them) but torch "), problem
    assert "a CPU-only build" in problem and "training would run on the CPU" in problem, problem
    assert "rm -rf .venv && make setup" in problem and "CUDA_VISIBLE_DEVICES=" in problem, problem
    for hidden in ("", "-1"):  # GPUs hidden on purpose: the CPU is what was asked for
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert unusable_gpus("training") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert unusable_gpus("training") is not None


def test_without_nvidia_smi_the_cpu_is_the_machines_own(tmp_path, monkeypatch):
    assert unusable_gpus("training") is None  # this machine: no GPU, no nvidia-smi
    smi = tmp_path / "nvidia-smi"  # driver tools on a CPU node, or a job's cgroup hiding the GPUs: none listed
    smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert unusable_gpus("training") is None


def test_gpus_a_scheduler_hides_are_not_the_machines(gpu_machine, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "NoDevFiles")  # SGE's way of giving a job no GPU
    assert unusable_gpus("training") is None


def test_the_trainer_and_the_generator_stop_with_one_line_before_any_work(gpu_machine, tmp_path, capsys):
    from generate.__main__ import main as generate_main
    from train.__main__ import main as train_main
    assert train_main(["--manifest", str(ROOT / "manifests/tiny.toml"), "--data", str(tmp_path / "epochs"),
                       "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this machine has NVIDIA GPUs") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
    assert generate_main(["--manifest", str(ROOT / "manifests/tiny.toml"), "--out", str(tmp_path / "epochs")]) == 2
    err = capsys.readouterr().err
    assert "error: this machine has NVIDIA GPUs" in err and "generation would run on the CPU" in err, err
    assert not (tmp_path / "epochs").exists()


def test_make_runs_a_rank_per_gpu_unless_told(tmp_path):
    """NPROC defaults to the GPUs `nvidia-smi -L` lists (the aux model of base trained on one of 8 GPUs when a
    user left NPROC out: `make generate-epochs` trains it first), to 1 without nvidia-smi; NPROC= overrides."""
    import subprocess
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(8)))
    smi.chmod(0o755)
    gpus = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    dry = lambda env, *extra: subprocess.run(["make", "-n", "train", *extra], cwd=ROOT, env=env,  # noqa: E731
                                             capture_output=True, text=True, check=True).stdout
    out = dry(gpus)
    assert "--nproc_per_node 8 -m train" in out and "--nproc 8" in out, out[-2000:]
    assert "--nproc_per_node" not in dry(os.environ) and "--nproc 1" in dry(os.environ)
    assert "--nproc_per_node 2 -m train" in dry(gpus, "NPROC=2")
    shared = {**gpus, "CUDA_VISIBLE_DEVICES": "2,5,7"}  # a scheduler's share of the node: 3 of its 8
    assert "--nproc_per_node 3 -m train" in dry(shared)
