"""Child processes of the stages: trainers launched by the sweep, the aux stage and reproduce, and the
ranks under torchrun, none of which may outlive the command that started it."""
from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import threading

from common.io import _alive

LAUNCHER_ENV = "FAST_ELECTRA_LAUNCHER_PID"  # set by run_child, read by stop_with_launcher


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send this process `sig` when its parent dies (PR_SET_PDEATHSIG), so that no trainer
    outlives the command that started it; elsewhere nothing is asked."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))
    except (OSError, AttributeError):
        pass  # not Linux


def stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's Python stack to this process's stderr and the process goes on:
    where a run that seems stuck is (a rank in a collective, a read, the launcher), without a debugger."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def trainer_command(nproc: int) -> list[str]:
    """One rank in a plain process; several under torchrun through train/launch.py (a rank's error is the exit
    code)."""
    if nproc <= 1:
        return [sys.executable, "-m", "train"]
    return [sys.executable, "-m", "train.launch", "--standalone", "--nproc_per_node", str(nproc), "-m", "train"]


class Interrupted(Exception):
    """A child trainer stopped by Ctrl-C (after a checkpoint): the command that launched it stops too."""


def run_child(cmd: list[str], env: dict | None = None) -> int:
    """Run a stage's command (a trainer: `python -m train`, or torchrun through train/launch.py) for a
    parent that launches them (the sweep, the aux stage, reproduce) and return its exit code. The child is
    asked (`stop_with_launcher`) to take SIGTERM when the parent dies, killed included: the trainer then
    checkpoints and stops (torchrun passes it on to its ranks) instead of training on, holding the run
    folder, beside the parent's rerun. Ctrl-C reaches the child from the terminal itself, and it stops after a
    checkpoint (`train.trainer.StopRequest`): this process waits for that, where `subprocess.run` would kill it
    on its own KeyboardInterrupt, and then raises `Interrupted`."""
    child_env = dict(os.environ if env is None else env)
    child_env[LAUNCHER_ENV] = str(os.getpid())
    with subprocess.Popen(cmd, env=child_env) as child:
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None  # after the fork: not the child's
        try:
            code = child.wait()
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
    if code == 128 + signal.SIGINT:
        raise Interrupted("stopped by Ctrl-C, the trainer's last update checkpointed; rerun the same command to "
                          "continue")
    return code


def stop_with_launcher() -> None:
    """In a process `run_child` started: SIGTERM when the launcher dies. Asked here, in the child's own
    start (not between fork and exec, which a parent with threads makes unsafe); not passed on further."""
    launcher = os.environ.pop(LAUNCHER_ENV, "")
    if not launcher.isdigit():
        return
    if os.getppid() == int(launcher):
        die_with_parent(signal.SIGTERM)
        if os.getppid() == int(launcher):
            return
    if not _alive(int(launcher)):  # it died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)
    # else a process further down (a rank under a plain torchrun): its own parent is in charge of it
