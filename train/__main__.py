"""`make train`: the Fast-ELECTRA trainer (`train/trainer.py`).

    torchrun --nproc_per_node N -m train --manifest PATH --data DIR|s3://BUCKET/PREFIX --out RUN [--resume]
                                         [--follow [--follow-timeout S]] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from common.process import die_with_parent, stacks_on_sigusr1, stop_with_launcher

if __name__ == "__main__":  # before torch is imported: a rank whose start-up hangs shows where too
    stacks_on_sigusr1()

from tqdm import tqdm  # noqa: E402

from common.checkpoint import CheckpointUnreadable, IncompatibleInputs  # noqa: E402
from common.config import ConfigError, add_manifest_argument, add_set_argument  # noqa: E402
from common.io import DamagedFile, DiskFull, FolderLocked  # noqa: E402
from common.sources import CorpusError  # noqa: E402
from train.data import DataError  # noqa: E402
from train.trainer import Stopped, train  # noqa: E402

# Fault injection for tests: SIGKILL this process right after finishing step N (a real kill, not an exception);
# sleep this many seconds after every step (a run slow enough to be killed from outside).
KILL_AT_STEP_ENV = "FAST_ELECTRA_TEST_KILL_AT_STEP"
SLOW_ENV = "FAST_ELECTRA_TEST_SECONDS_PER_STEP"


def test_hook():
    """The after-step hook that the tests' environment variables ask for, or None."""
    kill_at = int(os.environ.get(KILL_AT_STEP_ENV, "0"))
    pause = float(os.environ.get(SLOW_ENV, "0"))
    if not kill_at and not pause:
        return None

    def hook(step: int) -> None:
        time.sleep(pause)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def die_with_torchrun() -> None:
    """Under torchrun a worker runs in a session of its own: killed with its launcher (make's kill of the job
    group), so no trainer outlives the command that started it."""
    if "LOCAL_RANK" in os.environ:
        die_with_parent(signal.SIGKILL)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun -m train", description="Fast-ELECTRA RTD trainer on shards.")
    add_manifest_argument(parser)
    add_set_argument(parser)
    parser.add_argument("--data", default=None, help="generated shards (default: WORK_DIR/epochs)")
    parser.add_argument("--out", default=None, help="run folder (default: WORK_DIR/runs/default)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    parser.add_argument("--follow", action="store_true",
                        help="train while the generator still writes --data: each step waits for its shards")
    parser.add_argument("--follow-timeout", type=float, default=600.0,
                        help="--follow: stop with an error when a needed shard is not written within this many "
                             "seconds (default 600)")
    parser.add_argument("--follow-pid", type=int, default=0,
                        help="--follow: the generator's process id (make train): stop as soon as it exits unfinished")
    parser.add_argument("--corpus", default=None, help="fast-online only: corpus folder (default: WORK_DIR/corpus)")
    parser.add_argument("--aux", default=None, help="fast-online only: aux model (default: WORK_DIR/aux/aux.pt)")
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="Unix time: stop (evaluate, checkpoint) after the first update that ends past it")
    args = parser.parse_args(argv)
    if args.follow and args.follow_timeout <= 0:
        parser.error(f"--follow-timeout must be > 0 seconds, got {args.follow_timeout:g}")
    die_with_torchrun()
    stop_with_launcher()
    try:
        train(args, after_step=test_hook())
    except (ConfigError, DataError, IncompatibleInputs, FolderLocked, DamagedFile, CorpusError, DiskFull,
            CheckpointUnreadable, FloatingPointError) as e:  # FloatingPointError: K non-finite losses in a row
        tqdm.write(f"error: {e}", file=sys.stderr)  # on a line of its own, not after the progress bar's
        return leave(2)
    except Stopped as e:  # as if the signal had ended it, a scheduler sees the run unfinished; a shard read that
        sys.stdout.flush()  # was still waiting for the generator is not waited for
        sys.stderr.flush()
        os._exit(128 + e.signum)
    return leave(0)


def leave(code: int) -> int:
    """A rank under torchrun ends here, with `code`, its process group never torn down: on an error, at
    interpreter shutdown the group (the other ranks are stopping too) can abort the process (SIGABRT,
    "terminate called without an active exception"), and the launcher would then report that abort
    instead of the error's exit code; at a run's end, gloo's teardown can deadlock (train.trainer.run's
    end). Everything worth keeping is written and flushed by now; one rank alone returns `code`."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
