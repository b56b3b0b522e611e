"""Child processes of the stages: trainers launched by the sweep, the aux stage and reproduce, and the
ranks under torchrun, none of which may outlive the command that started it."""
from __future__ import annotations

import signal
import subprocess
import sys


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send this process `sig` when its parent dies (PR_SET_PDEATHSIG), so that no trainer
    outlives the command that started it; elsewhere nothing is asked."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))
    except (OSError, AttributeError):
        pass  # not Linux


def trainer_command(nproc: int) -> list[str]:
    """One rank in a plain process; several under torchrun through train/launch.py (a rank's error is the exit
    code)."""
    if nproc <= 1:
        return [sys.executable, "-m", "train"]
    return [sys.executable, "-m", "train.launch", "--standalone", "--nproc_per_node", str(nproc), "-m", "train"]


def run_child(cmd: list[str], env: dict | None = None) -> int:
    """Run a stage's command (a trainer: `python -m train`, torchrun) for a parent that launches them (the
    sweep, the aux stage, reproduce) and return its exit code. The child gets SIGTERM when the parent dies,
    killed included: the trainer then checkpoints and stops (torchrun passes it on to its ranks) instead of
    training on, holding the run folder, beside the parent's rerun."""
    return subprocess.run(cmd, env=env, preexec_fn=lambda: die_with_parent(signal.SIGTERM)).returncode
