"""`make corpus`: raw text -> tokenizer + packed sequences, streamed and parallel on Ray (`corpus/build.py`).

    python -m corpus --manifest manifests/tiny.toml [--source PATH] [--out DIR] [--workers N]
                     [--address ADDR] [--force] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import os
import sys

from common.config import ConfigError, add_manifest_argument, add_set_argument, load_manifest
from common.io import DamagedFile, DiskFull, FolderLocked, upload_folder
from common.parallel import NodeProblem, available_cpus
from common.corpus import CORPUS_META
from common.sources import CorpusError
from common.storage import cache_folder, is_remote, location
from corpus.build import build_corpus, corpus_is_current, parts_present


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m corpus", description=__doc__.split("\n\n")[0])
    add_manifest_argument(parser)
    add_set_argument(parser)
    parser.add_argument("--source", default=None,
                        help="override [corpus] source: a file or folder of .txt(.gz|.zst), .jsonl(.gz|.zst), .parquet")
    parser.add_argument("--out", default=None, help="output folder (default: WORK_DIR/corpus)")
    parser.add_argument("--workers", type=int, default=None,
                        help="Ray workers (default: one per core of this machine, or of the --address cluster)")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help="join this Ray cluster")
    parser.add_argument("--force", action="store_true", help="rebuild even if an identical corpus exists")
    args = parser.parse_args(argv)
    try:
        config = load_manifest(args.manifest, args.sets)
        if args.source:
            config.corpus.source = args.source
        if args.workers is not None and args.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {args.workers}")
        # joining a cluster: its cores, counted once Ray is up (0 here)
        workers = args.workers if args.workers is not None else 0 if args.address else available_cpus()
        out = location(args.out) if args.out else config.corpus_dir
        if not args.force and corpus_is_current(config, out, config.corpus.source):
            print(f"corpus: {out} is up to date")
            return 0
        # object storage: built in this machine's cache, then uploaded, corpus.json last (common/storage.py)
        local = cache_folder(out, "builds") if is_remote(out) else out
        if (is_remote(out) and not args.force and corpus_is_current(config, local, config.corpus.source)
                and parts_present(local)):
            print(f"corpus: {local} is built; uploading it")  # an upload that was interrupted
        else:
            build_corpus(config, local, workers=workers, address=args.address)
        if is_remote(out):
            put, skipped = upload_folder(local, out, last=CORPUS_META)
            print(f"corpus: uploaded to {out} ({put} files put{f', {skipped} already there' if skipped else ''})")
    except (ConfigError, CorpusError, FolderLocked, DamagedFile, DiskFull, NodeProblem) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from common.process import stacks_on_sigusr1
    stacks_on_sigusr1()
    sys.exit(main())
