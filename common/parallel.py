"""Starting Ray the same way for every stage that uses it (corpus, generate)."""
from __future__ import annotations

import math
import os
from pathlib import Path


class ActorDied(RuntimeError):
    """A Ray actor's process died more often than Ray restarts it (killed for memory, most often)."""


class NodeProblem(RuntimeError):
    """What keeps a Ray worker from working on its node (a folder it does not see, a GPU its torch cannot
    use): raised by the worker's task, and by the driver as this one line instead of Ray's traceback."""


def start_ray(address: str | None, workers: int, env_names: tuple[str, ...] = ()) -> None:
    """Join the cluster at `address`, or start a local Ray with `workers` CPUs (and this machine's GPUs).
    `env_names`: environment variables the workers must see (the tests' fault injection)."""
    import ray
    import torch
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level="WARNING", log_to_driver=True)
        return
    env = {k: v for k, v in os.environ.items() if k in env_names}
    ray.init(num_cpus=workers, num_gpus=torch.cuda.device_count(), include_dashboard=False,
             logging_level="WARNING", object_store_memory=256 * 1024 * 1024,
             runtime_env={"env_vars": env} if env else None)


def default_workers() -> int:
    """One worker per GPU, else one per core this process may use (`available_cpus`)."""
    import torch
    return torch.cuda.device_count() or available_cpus()


# cgroup v2's quota file, then v1's pair: a container's CPU limit (`docker run --cpus 8` on a 128-core host)
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_QUOTA = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def available_cpus() -> int:
    """The cores this process may use: its CPU affinity (a cpuset, `taskset`), at most its cgroup's quota
    rounded up. `os.cpu_count()` counts the host's: a container limited to 8 of 128 cores started 128
    workers, each importing torch (about 250 MB) before any work."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = None
    try:
        limit, period = Path(CGROUP_CPU_MAX).read_text().split()[:2]
        quota = None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        try:
            limit, period = (int(Path(name).read_text()) for name in CGROUP_V1_QUOTA)
            quota = limit / period if limit > 0 else None
        except (OSError, ValueError, ZeroDivisionError):
            pass
    if quota is not None and quota > 0:
        count = min(count, math.ceil(quota))
    return max(1, count)


def cluster_size(address: str | None, resource: str) -> int:
    """How many of `resource` ("CPU", "GPU") the Ray cluster at `address` holds, joined here: a job's workers
    when none are asked for (this machine's own count would leave the other nodes idle). Starts Ray."""
    import ray
    start_ray(address, 0)
    count = int(ray.cluster_resources().get(resource, 0))
    if resource == "CPU" and count < 1:  # an autoscaling cluster's head with no worker up yet: nothing to size by
        raise NodeProblem(f"the Ray cluster at {address} has no CPU to run workers on yet; wait for its nodes "
                          f"or pass --workers N")
    return count

