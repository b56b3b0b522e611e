"""Process-group helpers for the torchrun trainer (one rank when run without torchrun)."""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from common.config import ConfigError


def listed_gpus() -> int:
    """The GPUs `nvidia-smi -L` lists (what `make setup` and the Makefile's NPROC go by); 0 without it."""
    import subprocess
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def unusable_gpus(what: str) -> str | None:
    """Why `what` would run on the CPU of a machine that has NVIDIA GPUs, if it would: `nvidia-smi -L` lists
    GPUs (`make setup` installs a CUDA build where nvidia-smi is found) but this torch cannot use CUDA, a
    CPU-only build (an environment made on a machine without GPUs, a login node say, then used on a GPU node)
    or a CUDA build the driver is too old for. None where torch sees CUDA, where there is no GPU, or where the GPUs are
    hidden on purpose (CUDA_VISIBLE_DEVICES empty, -1, or SGE's NoDevFiles)."""
    if torch.cuda.is_available() or os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1",
                                                                                              "NoDevFiles"):
        return None
    if not listed_gpus():  # no nvidia-smi (or one that lists none: driver tools on a CPU node, a job's cgroup)
        return None
    build = ("a CPU-only build" if torch.version.cuda is None else
             f"built for CUDA {torch.version.cuda}, which this machine's driver may be too old for")
    return (f"this machine has NVIDIA GPUs (nvidia-smi lists them) but torch {torch.__version__} cannot use them "
            f"({build}): {what} would run on the CPU. Make the environment on this machine (rm -rf .venv && make "
            f"setup installs a CUDA build where nvidia-smi is found), or set CUDA_VISIBLE_DEVICES= to run on the "
            f"CPU on purpose")


def setup_distributed() -> tuple[int, int, torch.device]:
    """torchrun sets WORLD_SIZE/RANK; NCCL on GPU, gloo on CPU. Plain `python -m train` is one rank. A machine
    whose GPUs this torch cannot use is refused (`unusable_gpus`) rather than trained on over gloo."""
    if problem := unusable_gpus("training"):
        raise ConfigError(problem)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"rank {rank} (local rank {local_rank}) has no GPU of its own: this machine shows "
            f"{torch.cuda.device_count()} and ranks cannot share one under NCCL. Start one rank per GPU "
            f"(NPROC={torch.cuda.device_count()}), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on CPU over gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        # NCCL for CUDA tensors; gloo also on GPU machines for the few CPU scalars we reduce.
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def all_reduce(values: list[float], world: int, op=None) -> list[float]:
    """Sum (or `op`) of a few floats over all ranks."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


def all_max(values: list[float], world: int) -> list[float]:
    """Element-wise maximum of a few floats over all ranks."""
    return all_reduce(values, world, dist.ReduceOp.MAX if world > 1 else None)


def any_rank(flag: bool, world: int) -> bool:
    """True on every rank when `flag` is true on any."""
    return all_max([float(flag)], world)[0] > 0


def gather_objects(obj, world: int) -> list:
    """`obj` of every rank, in rank order, on every rank."""
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()
