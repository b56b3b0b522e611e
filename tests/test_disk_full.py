"""A disk that fills while a stage writes (a shard, a checkpoint, a corpus part): one `error:` line that names
the file and the space left, never a traceback (torch.save's own is "unexpected pos", pyarrow's names no
file), and no temporary left behind. A real full file system: a small tmpfs mounted for the test, where this
machine allows mounting (root, or a mount namespace); elsewhere the tests are skipped."""
import subprocess
import sys

import pytest

from tests.conftest import ROOT, dump_toml, tiny_config, write_text_corpus


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs at tmp_path/"disk" (96 KiB, or the size a test marks with `disk_size`): room for logs and
    configs, not for a checkpoint or the shards."""
    marker = request.node.get_closest_marker("disk_size")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={marker.args[0] if marker else '96k'}", "tmpfs",
                              str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def _one_error_line(result, file_part: str) -> str:
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [l.rsplit("\r", 1)[-1] for l in result.stderr.splitlines()]  # after a progress bar's carriage return
    line = next((l for l in lines if l.startswith("error: ")), result.stderr[-3000:])
    assert "no space left writing" in line and file_part in line and "MiB free there now" in line, line
    return line


def _temporaries(folder):
    return [p for p in folder.rglob("*") if ".tmp-" in p.name]


@pytest.mark.slow
def test_a_checkpoint_that_does_not_fit_is_one_error_line(generated, small_disk, env_with_repo):
    manifest, data, _ = generated
    run = small_disk / "run"
    result = subprocess.run([sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(data),
                             "--out", str(run), "--set", "train.ckpt_every=2", "--set", "train.eval_every=1000"],
                            cwd=ROOT, env=env_with_repo, capture_output=True, text=True, timeout=300)
    _one_error_line(result, str(run / "checkpoints" / "step-00000002.pt"))
    assert not _temporaries(small_disk)


@pytest.mark.slow
@pytest.mark.disk_size("24k")
def test_a_shard_that_does_not_fit_is_one_error_line_from_the_ray_actor(generated, small_disk, env_with_repo):
    manifest, _, _ = generated
    out = small_disk / "epochs"
    result = subprocess.run([sys.executable, "-m", "generate", "--manifest", str(manifest), "--out", str(out),
                             "--workers", "1", "--set", "generate.rows_per_shard=400"],
                            cwd=ROOT, env=env_with_repo, capture_output=True, text=True, timeout=300)
    _one_error_line(result, ".parquet")
    assert not _temporaries(small_disk)


def test_a_corpus_that_does_not_fit_keeps_its_staging_and_says_so(tmp_path, small_disk, env_with_repo):
    write_text_corpus(tmp_path / "raw", num_docs=6)
    config = tiny_config(tmp_path)
    manifest = tmp_path / "m.toml"
    manifest.write_text(dump_toml(config))
    result = subprocess.run([sys.executable, "-m", "corpus", "--manifest", str(manifest), "--out",
                             str(small_disk / "corpus"), "--workers", "1"],
                            cwd=ROOT, env=env_with_repo, capture_output=True, text=True, timeout=300)
    _one_error_line(result, str(small_disk))
    assert (small_disk / ".corpus.staging").is_dir() and not (small_disk / "corpus").exists()


def test_only_a_full_disk_is_called_one(tmp_path):
    """The ENOSPC / EDQUOT anywhere in the chain is one; another error on a folder with room is not, torch's
    writer error included (it is taken for a full disk only when under 1 MiB is left, as on the tmpfs above)."""
    import errno
    from common.io import DiskFull, disk_full
    path = tmp_path / "step-00000002.pt"
    full = disk_full(OSError(errno.ENOSPC, "No space left on device"), path, tmp_path)
    assert isinstance(full, DiskFull) and str(full).startswith(f"no space left writing {path} (")
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    except RuntimeError as chained:
        assert isinstance(disk_full(chained, path, tmp_path), DiskFull)
    assert disk_full(RuntimeError("unexpected pos 576 vs 534"), path, tmp_path) is None  # room left here
    assert disk_full(OSError(errno.EACCES, "Permission denied"), path, tmp_path) is None
    assert disk_full(ValueError("not a write error"), path, tmp_path) is None
