"""`make sweep`: several trainer configs over the same dumped shards. The shards' sha256 and
mtimes are unchanged afterwards and the generator never ran (issue: sweep reuse)."""
import json
import subprocess

import pytest

from common.config import config_from_dict, config_to_dict, dump_toml, load_manifest
from common.io import sha256_file
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _snapshot(folder):
    """Every file of the data folder (shards, manifest, plan, progress journal): sha256 and mtime."""
    return {str(p.relative_to(folder)): (sha256_file(p), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_make_sweep_reuses_the_shards_and_never_runs_the_generator(generated, tmp_path, env_with_repo):
    if not (ROOT / ".venv" / ".installed").is_file():
        pytest.skip("`make sweep` needs the project venv; run the suite with `make test`")
    manifest, data, _ = generated
    values = config_to_dict(load_manifest(manifest))
    values["train"].update({"max_steps": 6, "eval_every": 3, "ckpt_every": 3})
    values["sweep"] = {"train": {"lr": [1e-3, 4e-3]}}
    sweep_manifest = tmp_path / "sweep.toml"
    sweep_manifest.write_text(dump_toml(config_from_dict(values)))
    before = _snapshot(data)
    assert any(name.endswith(".parquet") for name in before) and "manifest.json" in before

    out = tmp_path / "sweep"
    result = subprocess.run(["make", "--no-print-directory", "sweep", f"MANIFEST={sweep_manifest}", f"DATA={data}",
                             f"SWEEP={out}", "NPROC=1"], cwd=ROOT, env=env_with_repo, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "-m generate" not in result.stdout and "generate:" not in result.stdout  # make did not call it
    assert _snapshot(data) == before  # no shard, manifest or journal rewritten, not even touched

    summary = json.loads((out / "sweep.json").read_text())
    assert [r["grid"] for r in summary["runs"]] == [{"lr": 1e-3}, {"lr": 4e-3}]
    assert all(r["status"] == "done" and r["steps"] == 6 for r in summary["runs"])
    for r in summary["runs"]:  # each run trained with its own lr, on the same data
        resolved = load_manifest(f"{r['run_dir']}/resolved_manifest.toml")
        assert resolved.train.lr == r["grid"]["lr"] and resolved.sweep.train == {}
    end_losses = [r["end"]["loss"] for r in summary["runs"]]
    assert end_losses[0] != end_losses[1]
    table = (out / "sweep.md").read_text()
    assert table.count("| 0.001 |") == 1 and table.count("| 0.004 |") == 1
    assert summary["best_by_val_auc"] in ("lr=0.001", "lr=0.004")
