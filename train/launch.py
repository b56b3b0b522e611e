"""`make train NPROC=N` (N > 1): torchrun, with a worker's own error as the command's end.

    python -m train.launch --standalone --nproc_per_node N -m train --manifest PATH ...

Takes torchrun's arguments. When ranks fail, each has printed its own `error: ...` line; this
launcher then exits with their exit code (2 for a user's mistake, as `python -m train` does)
instead of torchrun's exit code 1 and its traceback of the launcher itself.
"""
from __future__ import annotations

import signal
import sys


def main(argv=None) -> int:
    from common.process import stop_with_launcher
    stop_with_launcher()  # launched by the sweep or the aux stage: SIGTERM (passed on to the ranks) when it dies
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run
    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except SignalException as e:  # passed on to the ranks, which stopped (on SIGTERM: after a checkpoint)
        print(f"train: stopped by {signal.Signals(e.sigval).name}", file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        codes = sorted({failure.exitcode for failure in e.failures.values()})
        print(f"train: {len(e.failures)} rank(s) stopped (exit code {', '.join(map(str, codes))}); "
              f"their messages are above", file=sys.stderr)
        return 2 if 2 in codes else next((c for c in codes if 0 < c < 256), 1)
    return 0


if __name__ == "__main__":
    from common.process import stacks_on_sigusr1
    stacks_on_sigusr1()
    sys.exit(main())
