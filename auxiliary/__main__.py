"""`make aux`: train the auxiliary masked LM (`auxiliary/mlm.py`).

    python -m auxiliary --manifest manifests/tiny.toml [--nproc N] [--corpus DIR] [--out DIR] [--force] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import sys

from auxiliary.mlm import AuxRunError, train_aux, use_hf_aux
from common.aux_record import aux_is_current
from common.process import Interrupted
from common.checkpoint import AUX_FILE, AUX_META, CheckpointUnreadable
from common.config import ConfigError, add_manifest_argument, add_set_argument, load_manifest
from common.corpus import local_corpus
from common.io import DiskFull, FolderLocked, require_folder
from common.sources import CorpusError
from common.storage import cache_folder, is_remote, location


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m auxiliary", description="Train the auxiliary MLM.")
    add_manifest_argument(parser)
    add_set_argument(parser)
    parser.add_argument("--corpus", default=None, help="corpus folder (default: WORK_DIR/corpus)")
    parser.add_argument("--out", default=None, help="output folder (default: WORK_DIR/aux)")
    parser.add_argument("--force", action="store_true", help="retrain from step 0 even if aux.pt or a run exists")
    parser.add_argument("--nproc", type=int, default=1, help="ranks (devices) to train on, under torchrun (default 1)")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    try:
        config = load_manifest(args.manifest, args.sets)
        corpus = location(args.corpus) if args.corpus else config.corpus_dir
        out = location(args.out) if args.out else config.aux_dir
        if not is_remote(out):
            require_folder(out)
        corpus = local_corpus(corpus)  # on object storage: this machine's copy
        if not args.force and aux_is_current(config, corpus, out):
            print(f"aux: {out / AUX_FILE} is up to date (use --force to retrain)")
            return 0
        # object storage: trained in this machine's cache, then uploaded, aux.json last (common/storage.py)
        local = cache_folder(out, "builds") if is_remote(out) else out
        if config.aux.source:
            use_hf_aux(config, corpus, local)
        else:
            train_aux(config, corpus, local, nproc=args.nproc, force=args.force)
        if is_remote(out):
            for name in ("resolved_manifest.toml", AUX_FILE, AUX_META):
                (out / name).upload(local / name)
            print(f"aux: uploaded to {out}")
    except Interrupted as e:
        print(f"aux: {e}", file=sys.stderr)
        return 130
    except AuxRunError as e:  # the trainer has printed its own error
        print(f"error: {e}", file=sys.stderr)
        return e.code if 0 < e.code < 256 else 1
    except (ConfigError, CorpusError, FileNotFoundError, ValueError, DiskFull, FolderLocked,
            CheckpointUnreadable) as e:  # ValueError: HFError
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from common.process import stacks_on_sigusr1
    stacks_on_sigusr1()
    sys.exit(main())
