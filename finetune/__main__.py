"""`make finetune`: fine-tune a pre-trained checkpoint (or a random init) on a GLUE-style task
(`finetune/finetuner.py`).

    python -m finetune --checkpoint RUN_DIR_OR_CKPT [--task rotten_tomatoes|DIR] [--out DIR]
                       [--config TOML] [--set KEY=VALUE ...] [--init pretrained|none]
    python -m finetune --init none --manifest manifests/tiny.toml     # the no-pre-training floor
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.checkpoint import CheckpointUnreadable, IncompatibleInputs
from common.config import ConfigError
from common.io import DamagedFile, DiskFull, FolderLocked, require_folder
from finetune.config import resolve_config
from finetune.finetuner import finetune, load_backbone
from finetune.glue import TaskError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None, help="trainer checkpoint (step-*.pt) or run folder")
    parser.add_argument("--init", default="pretrained", choices=("pretrained", "none"),
                        help="none: a random model of the same shape (the no-pre-training floor)")
    parser.add_argument("--manifest", default="manifests/tiny.toml",
                        help="shape and tokenizer when no --checkpoint is given (--init none)")
    parser.add_argument("--corpus", default=None, help="corpus folder whose tokenizer the run used (default: the run's corpus)")
    parser.add_argument("--task", default=None, help="task folder (GLUE TSV layout) or 'rotten_tomatoes'")
    parser.add_argument("--tasks-dir", default="work/tasks", help="where built-in tasks are prepared")
    parser.add_argument("--config", default=None, help="TOML file with a [finetune] table")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a [finetune] key, e.g. --set grid.lr=[1e-4] --set seeds=[1,2,3]")
    parser.add_argument("--out", default=None,
                        help="output folder (default: RUN/finetune/<task>-pretrained, WORK_DIR/finetune/<task>-none)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    args = parser.parse_args(argv)
    try:
        cfg = resolve_config(args.config, args.set, args.task)
        backbone = load_backbone(args.checkpoint, args.manifest, args.init, args.corpus)
        out = Path(args.out) if args.out else backbone.home / f"{Path(cfg.task.path).name}-{args.init}"
        require_folder(out)
        finetune(cfg, backbone, out, Path(args.tasks_dir), progress=not args.no_progress)
    except (ConfigError, TaskError, IncompatibleInputs, FileNotFoundError, DamagedFile, DiskFull, FolderLocked,
            CheckpointUnreadable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((out / "results.md").read_text())
    print(f"finetune: {out / 'results.md'}, results.json and each run's seed-*.json in {out / 'runs'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
