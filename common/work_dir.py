"""The work folder a manifest resolves to: its `work_dir`, or the one of the manifest it `extends`, or the
default. For the Makefile, which needs it before the venv exists: standard library only, run as a script
(`python3 common/work_dir.py MANIFEST`; nothing printed and exit 1 for a manifest that does not read)."""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

DEFAULT = "work/tiny"  # common.config.RunConfig.work_dir


def work_dir(path: Path, seen: tuple = ()) -> str:
    """As common.config.read_toml resolves `extends` (relative to the file that names it)."""
    if path.resolve() in seen:
        raise ValueError(f"{path} extends itself")
    with path.open("rb") as f:
        data = tomllib.load(f)
    if "work_dir" in data:
        return str(data["work_dir"])
    base = data.get("extends")
    return work_dir(path.parent / base, seen + (path.resolve(),)) if isinstance(base, str) else DEFAULT


if __name__ == "__main__":
    try:
        print(work_dir(Path(sys.argv[1])))
    except (OSError, ValueError, IndexError):  # tomllib.TOMLDecodeError is a ValueError
        sys.exit(1)
