"""`make export`: a trained model as a Hugging Face model directory (`export/exporter.py`, docs/export.md).

    python -m export --run RUN --out DIR [--corpus DIR] [--data DIR] [--force]
    python -m export --aux WORK/aux/aux.pt --out DIR [--corpus DIR] [--force]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.checkpoint import local_aux
from common.io import FolderLocked
from common.storage import location
from export.exporter import check_output, export, from_aux, from_run, require_transformers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export",
                                     description="Export a trained model as a Hugging Face model directory.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="run folder (its newest checkpoint) or a step-XXXXXXXX.pt file")
    source.add_argument("--aux", help="our auxiliary model's aux.pt (exported as a masked LM)")
    parser.add_argument("--out", required=True, help="model directory to write (must not exist or be empty)")
    parser.add_argument("--corpus", default=None, help="corpus folder of the tokenizer (default: the run's)")
    parser.add_argument("--data", default=None, help="the run's shard folder, for the tokens seen (default: the run's)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    try:
        require_transformers()
        out = Path(args.out)
        check_output(out, args.force)  # before reading anything large
        corpus = location(args.corpus) if args.corpus else None  # a folder or an s3:// prefix
        if args.run:
            trained = from_run(Path(args.run), corpus, location(args.data) if args.data else None)
        else:
            trained = from_aux(local_aux(args.aux), corpus)
        export(trained, out, force=args.force)
    except (ValueError, OSError, FolderLocked) as e:  # ExportError; config, corpus, checkpoint, hf:, file errors
        print(f"error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2
    except KeyError as e:  # a file of the right kind without an entry the export reads
        print(f"error: {args.run or args.aux} has no entry {e}: not a file this project wrote", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
