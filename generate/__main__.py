"""`make generate-epochs`: the Ray job that writes each epoch's corrupted rows and labels as
Parquet shards (`generate/generator.py`).

    python -m generate --manifest PATH --out DIR|s3://BUCKET/PREFIX [--workers N] [--address ADDR] [--force] [--verify]
                       [--corpus DIR] [--aux PATH] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import os
import sys

from common.checkpoint import AUX_FILE, IncompatibleInputs
from common.config import ConfigError, add_manifest_argument, add_set_argument, load_manifest
from common.distributed import unusable_gpus
from common.io import DamagedFile, DiskFull, FolderLocked
from common.sources import CorpusError
from common.storage import location
from common.parallel import ActorDied, NodeProblem, default_workers
from generate.generator import OutputConflict, generate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m generate", description=__doc__.split("\n\n")[0])
    add_manifest_argument(parser)
    add_set_argument(parser)
    parser.add_argument("--out", default=None, help="output folder (default: WORK_DIR/epochs)")
    parser.add_argument("--workers", type=int, default=None,
                        help="actors (default: one per GPU, else per core, of this machine or of the --address cluster)")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help="join this Ray cluster")
    parser.add_argument("--force", action="store_true", help="replace an output folder of another generation")
    parser.add_argument("--verify", action="store_true",
                        help="hash every shard, even those unchanged (size, time) since they were last hashed")
    parser.add_argument("--corpus", default=None, help="corpus folder (default: WORK_DIR/corpus)")
    parser.add_argument("--aux", default=None, help="auxiliary model (default: WORK_DIR/aux/aux.pt)")
    args = parser.parse_args(argv)
    try:
        config = load_manifest(args.manifest, args.sets)
        if args.workers is not None and args.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {args.workers}")
        if not args.address and (problem := unusable_gpus("generation")):  # a cluster's nodes: each actor checks
            raise ConfigError(problem)
        # joining a cluster: its GPUs (or cores), counted once Ray is up (0 here)
        workers = args.workers if args.workers is not None else 0 if args.address else default_workers()
        # folders or object storage URIs (s3://bucket/prefix: common/storage.py)
        out = location(args.out) if args.out else config.epochs_dir
        corpus = location(args.corpus) if args.corpus else config.corpus_dir
        aux = location(args.aux) if args.aux else config.aux_dir / AUX_FILE
        if not (args.aux or args.corpus) and aux.is_file():
            check_aux_current(config)
        generate(config, out, corpus, aux, workers, args.address, args.force, verify=args.verify)
    except (ConfigError, CorpusError, IncompatibleInputs, OutputConflict, FileNotFoundError, FolderLocked,
            DamagedFile, DiskFull, NodeProblem, PermissionError) as e:  # PermissionError: names the path
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ActorDied as e:  # not the user's input: exit 1, as a crash, in one line
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def check_aux_current(config) -> None:
    """The manifest's own aux model (no --aux): the one its [aux] settings, corpus and hf: source make, not one
    left by other settings (its shards would be described by a manifest that did not make them)."""
    from common.aux_record import aux_is_current
    from common.corpus import local_corpus
    # a corpus on object storage: this machine's copy of its corpus.json and tokenizer (the generator's own)
    if not aux_is_current(config, local_corpus(config.corpus_dir, splits=()), config.aux_dir):
        raise IncompatibleInputs(f"{config.aux_dir / AUX_FILE} was not made by this manifest's [aux] settings, "
                                 f"corpus and source ({config.aux.source or 'trained here'}): `make aux` "
                                 f"(python -m auxiliary) makes it, or name an aux model with --aux")


if __name__ == "__main__":
    from common.process import stacks_on_sigusr1
    stacks_on_sigusr1()
    sys.exit(main())
