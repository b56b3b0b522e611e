"""Record a fresh-clone `make train` in bench/results/make-train.json, the file the README's example
summary is checked against (tests/test_layout.py), so the example cannot go stale unnoticed.

    git clone REPO /tmp/fresh && cd /tmp/fresh && time make train
    python -m bench.record_train --clone /tmp/fresh --real 11m52s [--append]

Each record holds the clone's commit, the date, the wall time `time` printed, the sha256 of the manifest
the run used and its summary.json as written. Without --append the file starts over (a new preset).
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

from common.io import atomic_write_json, sha256_file

RECORD = Path(__file__).resolve().parent / "results" / "make-train.json"
MANIFEST = "manifests/tiny.toml"
RUN = "work/tiny/runs/default"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.record_train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clone", required=True, help="the fresh clone `make train` ran in")
    parser.add_argument("--real", required=True, help="the wall time `time make train` printed, e.g. 11m52s")
    parser.add_argument("--append", action="store_true", help="add to the runs already recorded")
    args = parser.parse_args(argv)
    clone = Path(args.clone)
    summary_path = clone / RUN / "summary.json"
    if not summary_path.is_file():
        print(f"error: {summary_path} does not exist: run `time make train` in {clone} first", file=sys.stderr)
        return 2
    commit = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    summary = json.loads(summary_path.read_text())
    finished = datetime.datetime.fromtimestamp(summary_path.stat().st_mtime, datetime.timezone.utc)
    run = {"command": "git clone ... && cd ... && time make train", "commit": commit,
           "date": finished.strftime("%Y-%m-%d"), "real": args.real,
           "manifest": MANIFEST, "manifest_sha256": sha256_file(clone / MANIFEST), "summary": summary}
    runs = json.loads(RECORD.read_text())["runs"] if args.append and RECORD.is_file() else []
    atomic_write_json(RECORD, {"runs": runs + [run]})
    print(f"recorded run {len(runs) + 1} ({commit[:7]}, {args.real}) in {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
