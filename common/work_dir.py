"""The work folder a manifest resolves to: its `work_dir`, or the one of the manifest it `extends`, or the
default. For the Makefile, which needs it before the venv exists: run as a script by the system's python3
(`python3 common/work_dir.py MANIFEST`; nothing printed and exit 1 for a manifest that does not read).
common.config imports only the standard library at load (common.storage imports pyarrow lazily)."""
from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info < (3, 11):  # the line make prints: not "does not read", which would send one to the manifest
    print(f"python3 is {sys.version.split()[0]}; the Makefile reads manifests with python3 >= 3.11 (tomllib)",
          file=sys.stderr)
    sys.exit(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.config import ConfigError, RunConfig, read_toml  # noqa: E402 - after the repository is on the path

if __name__ == "__main__":
    try:
        print(read_toml(sys.argv[1]).get("work_dir", RunConfig.work_dir))
    except (ConfigError, IndexError) as e:
        print(e, file=sys.stderr)
        sys.exit(1)
