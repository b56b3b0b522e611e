"""Artifacts people share load without running code, and their bytes are a pure function of their inputs."""
import json
import os
from pathlib import Path

import pytest
import torch

from auxiliary.mlm import train_aux
from common.checkpoint import (AUX_FILE, AUX_META, IncompatibleInputs, latest_checkpoint, load_aux, save_checkpoint)
from common.io import sha256_file
from finetune.finetuner import read_checkpoint


class WritesAMarker:
    """A pickle that creates a file when it is loaded: what a malicious aux model or checkpoint could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_an_aux_model_whose_pickle_would_run_code_is_refused(built, tmp_path):
    aux_dir = tmp_path / "aux"
    aux_dir.mkdir()
    marker = tmp_path / "marker"
    torch.save({"state_dict": {}, "payload": WritesAMarker(marker)}, aux_dir / AUX_FILE)
    meta = json.loads((built.aux_dir / AUX_META).read_text())
    (aux_dir / AUX_META).write_text(json.dumps({**meta, "sha256": sha256_file(aux_dir / AUX_FILE)}))
    with pytest.raises(IncompatibleInputs, match="refusing to load it"):
        load_aux(aux_dir / AUX_FILE)
    assert not marker.exists()


def test_a_checkpoint_whose_pickle_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "marker"
    folder = tmp_path / "checkpoints"
    save_checkpoint({"step": 1, "model": {"w": torch.ones(2)}}, folder, keep=3)  # a good, older one
    torch.save({"step": 2, "model": {}, "extra": WritesAMarker(marker)}, folder / "step-00000002.pt")
    with pytest.raises(IncompatibleInputs, match=r"step-00000002\.pt holds objects other than tensors"):
        latest_checkpoint(folder)
    with pytest.raises(IncompatibleInputs, match="refusing to load it"):
        read_checkpoint(folder / "step-00000002.pt")
    assert not marker.exists()


class RunsAShellCommand:
    """A pickle that runs `touch MARKER` when loaded (os.system: a module torch's loader blocks by name)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_would_run_a_shell_command_is_refused_as_code(tmp_path):
    marker = tmp_path / "marker"
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({"step": 2, "model": {}, "extra": RunsAShellCommand(marker)}, folder / "step-00000002.pt")
    with pytest.raises(IncompatibleInputs, match=r"step-00000002\.pt holds objects other than tensors.*pickled code"):
        latest_checkpoint(folder)
    assert not marker.exists()


def test_a_plain_checkpoint_still_loads(tmp_path):
    state = {"step": 3, "model": {"w": torch.arange(4.0)}, "rng": [(torch.get_rng_state(), None)],
             "history": {"start": {"auc": 0.5}}, "config": {"train": {"betas": [0.9, 0.98]}}}
    save_checkpoint(state, tmp_path, keep=1)
    path, loaded = latest_checkpoint(tmp_path)
    assert path.name == "step-00000003.pt" and torch.equal(loaded["model"]["w"], state["model"]["w"])


def test_two_aux_trainings_give_one_file(built, tmp_path):
    """The aux file holds no timing (that goes to aux.json), so the same inputs give the same bytes and
    the generation key built on its sha256 stays put."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the fixture's: CPU float sums depend on the thread count
    first = train_aux(built, built.corpus_dir, tmp_path / "a", log=lambda *_: None, env=env)
    second = train_aux(built, built.corpus_dir, tmp_path / "b", log=lambda *_: None, env=env)
    assert sha256_file(first) == sha256_file(second) == sha256_file(built.aux_dir / AUX_FILE)
    assert "tokens_per_s" in json.loads((tmp_path / "a" / AUX_META).read_text())["metrics"]
