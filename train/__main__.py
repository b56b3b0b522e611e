"""`make train`: the Fast-ELECTRA trainer (`train/trainer.py`).

    torchrun --nproc_per_node N -m train --manifest PATH --data DIR --out RUN [--resume] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from common.checkpoint import IncompatibleInputs
from common.config import ConfigError, add_set_argument
from train.data import DataError
from train.trainer import train

# Fault injection for tests: SIGKILL this process right after finishing step N (a real kill, not an exception).
KILL_AT_STEP_ENV = "FAST_ELECTRA_TEST_KILL_AT_STEP"


def kill_hook():
    """The after-step hook that `KILL_AT_STEP_ENV` asks for, or None."""
    kill_at = int(os.environ.get(KILL_AT_STEP_ENV, "0"))
    if not kill_at:
        return None
    return lambda step: os.kill(os.getpid(), signal.SIGKILL) if step == kill_at else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun -m train", description="Fast-ELECTRA RTD trainer on shards.")
    parser.add_argument("--manifest", default="manifests/tiny.toml")
    add_set_argument(parser)
    parser.add_argument("--data", default=None, help="generated shards (default: WORK_DIR/epochs)")
    parser.add_argument("--out", default=None, help="run folder (default: WORK_DIR/runs/default)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    parser.add_argument("--corpus", default=None, help="fast-online only: corpus folder (default: WORK_DIR/corpus)")
    parser.add_argument("--aux", default=None, help="fast-online only: aux model (default: WORK_DIR/aux/aux.pt)")
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="Unix time: stop (evaluate, checkpoint) after the first update that ends past it")
    args = parser.parse_args(argv)
    try:
        train(args, after_step=kill_hook())
    except (ConfigError, DataError, IncompatibleInputs) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
