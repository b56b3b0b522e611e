"""`make train NPROC=N` (N > 1): torchrun, with a worker's own error as the command's end.

    python -m train.launch --standalone --nproc_per_node N -m train --manifest PATH ...

Takes torchrun's arguments. When ranks fail, each has printed its own `error: ...` line; this
launcher then exits with their exit code (2 for a user's mistake, as `python -m train` does)
instead of torchrun's exit code 1 and its traceback of the launcher itself.
"""
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
    """One rank in a plain process; several under torchrun through `main` (a rank's error is the exit code)."""
    if nproc <= 1:
        return [sys.executable, "-m", "train"]
    return [sys.executable, "-m", "train.launch", "--standalone", "--nproc_per_node", str(nproc), "-m", "train"]


def run_child(cmd: list[str], env: dict | None = None) -> int:
    """Run a stage's command (a trainer: `python -m train`, torchrun) for a parent that launches them (the
    sweep, the aux stage, reproduce) and return its exit code. The child gets SIGTERM when the parent dies, killed included:
    the trainer then checkpoints and stops (torchrun passes it on to its ranks) instead of training on,
    holding the run folder, beside the parent's rerun."""
    return subprocess.run(cmd, env=env, preexec_fn=lambda: die_with_parent(signal.SIGTERM)).returncode


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run
    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except ChildFailedError as e:
        codes = sorted({failure.exitcode for failure in e.failures.values()})
        print(f"train: {len(e.failures)} rank(s) stopped (exit code {', '.join(map(str, codes))}); "
              f"their messages are above", file=sys.stderr)
        return 2 if 2 in codes else next((c for c in codes if 0 < c < 256), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
