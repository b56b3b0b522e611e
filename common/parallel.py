"""Starting Ray the same way for every stage that uses it (corpus, generate)."""
from __future__ import annotations

import os


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
    """One worker per GPU, else one per core."""
    import torch
    return torch.cuda.device_count() or os.cpu_count() or 1
