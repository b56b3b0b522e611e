"""A run's checkpoint: built and restored here, in one place (docs/design.md, checkpoints).

A checkpoint holds the model, optimizer and scheduler, the step (hence the data position:
`rows_consumed` = step x batch size), every rank's RNG state, the resolved config, the data
manifest's hash, the tokenizer's, and `Progress` (the counters and metric history the loop carries). Killed at
any step and resumed, a run reproduces the uninterrupted run's per-step losses (bitwise on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.checkpoint import IncompatibleInputs, latest_checkpoint, list_checkpoints, save_checkpoint
from common.config import RunConfig, changed_keys, config_from_dict, config_to_dict, resume_trajectory
from common.distributed import gather_objects


@dataclass
class Progress:
    """What the loop carries from step to step besides the model and optimizer."""
    step: int = 0
    history: dict = field(default_factory=dict)
    """'start' / 'last' validation metrics and the temperature range consumed so far."""
    nonfinite_total: int = 0
    nonfinite_run: int = 0
    """Non-finite losses in all and in a row (each one skipped its update)."""


def save(ckpt_dir: Path, keep: int, progress: Progress, model, optimizer, scheduler, config: RunConfig,
         manifest_hash: str, rank: int, world: int, device: torch.device, tokenizer_sha256: str = "") -> Path | None:
    """Collective (every rank calls it): gathers every rank's dropout stream, rank 0 writes and gets the
    file's path. `tokenizer_sha256`: the tokenizer the data was made with, so fine-tuning and export can
    refuse another one."""
    own = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
    rng_states = gather_objects(own, world)
    if rank != 0:
        return None
    return save_checkpoint({
        "step": progress.step, "rows_consumed": progress.step * config.train.batch_size,
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "rng": rng_states, "world_size": world, "config": config_to_dict(config),
        "data_manifest_sha256": manifest_hash, "tokenizer_sha256": tokenizer_sha256, "history": progress.history,
        "nonfinite_total": progress.nonfinite_total, "nonfinite_run": progress.nonfinite_run,
    }, ckpt_dir, keep)


def dropout_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of a rank's dropout stream from `step` on: a fresh run's from step 0, a resume on another number
    of ranks (whose saved streams do not fit) from its step."""
    return seed + 1000 + rank + 1_000_003 * step


def restore(ckpt_dir: Path, model, optimizer, scheduler, config: RunConfig, manifest_hash: str, data_desc,
            rank: int, world: int, device: torch.device) -> tuple[Path, Progress] | None:
    """Collective. Load the newest valid checkpoint into model, optimizer and scheduler (and this rank's RNG
    when the world size is the same); None if there is none. Every rank must find the same one. Refuses another data manifest, or a config that
    differs in anything that changes the updates (`common.config.resume_trajectory`)."""
    found = latest_checkpoint(ckpt_dir, mmap=True)
    names = gather_objects(found[0].name if found else None, world)
    if len(set(names)) > 1:  # each rank would resume at another step: different updates, or a hang
        seen: dict = {}
        for r, name in enumerate(names):
            seen.setdefault(name or "none", []).append(str(r))
        raise IncompatibleInputs(
            f"the ranks do not find the same newest checkpoint in {ckpt_dir} ("
            + "; ".join(f"{name} on rank {', '.join(ranks[:4])}{', ...' if len(ranks) > 4 else ''}"
                        for name, ranks in seen.items())
            + "): every rank must read the one run folder rank 0 writes (a shared file system)")
    if not found:
        if unread := list_checkpoints(ckpt_dir):  # every rank sees them: the names above agreed
            raise IncompatibleInputs(
                f"none of the {len(unread)} checkpoint(s) in {ckpt_dir} loads (the newest, {unread[-1].name}; the "
                f"notes above say why): starting over here would rewrite this run's metrics.jsonl. To train this run "
                f"from the start, move them out of the folder; or use a new --out")
        return None
    path, state = found
    if state["data_manifest_sha256"] != manifest_hash:
        raise IncompatibleInputs(f"checkpoint {path} was trained on a data manifest with sha256 "
                                 f"{state['data_manifest_sha256'][:12]}, {data_desc} has {manifest_hash[:12]}")
    saved = resume_trajectory(config_to_dict(config_from_dict(state["config"])))  # newer keys' defaults filled in
    current = resume_trajectory(config_to_dict(config))
    if saved != current:
        raise IncompatibleInputs(f"checkpoint {path} was made with another config ({', '.join(changed_keys(saved, current))} "
                                 f"changed); use a new --out")
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:  # the same settings, another model class: this project's model changed between them
        raise IncompatibleInputs(f"checkpoint {path} holds a model of another shape than this code builds from the "
                                 f"same settings ({str(e).splitlines()[0][:160]}; electra's generator took the aux "
                                 f"model's depth on 2026-11-26): use a new --out") from None
    # the step's kernel is build_optimizer's, not the checkpoint's: one saved before the fused step resumes fused
    for saved_group, built in zip(state["optimizer"]["param_groups"], optimizer.param_groups):
        saved_group["fused"], saved_group["foreach"] = built["fused"], built["foreach"]
    if device.type == "cpu":  # `load_state_dict` keeps a tensor already on the device as it is: here the mapped
        # file's pages, which would hold the file's disk space (rotated away meanwhile) for the whole run
        state["optimizer"]["state"] = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in group.items()}
                                       for k, group in state["optimizer"]["state"].items()}
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state["world_size"] == world:
        cpu_state, cuda_state = state["rng"][rank]
        torch.set_rng_state(cpu_state)
        if cuda_state is not None and device.type == "cuda":
            torch.cuda.set_rng_state(cuda_state, device)
    else:  # no saved stream for this rank: a new one of (seed, rank, step), not step 0's masks over again
        torch.manual_seed(dropout_seed(config.train.seed, rank, state["step"]))
    return path, Progress(state["step"], state["history"], state["nonfinite_total"], state["nonfinite_run"])
