"""Non-finite losses (docs/design.md trainer contract, issue: "a non-finite loss skips the step and
is counted; K in a row stop the run with the step, the rows and the last good checkpoint named").

The real trainer runs in-process on real shards; the only change is a detector whose
training-time output is NaN at chosen steps, the way an overflow would surface. The same harness
checks how often the trainer redraws its curves."""
import argparse
import copy
import json
import math
import re

import pytest
import torch

import train.trainer as trainer
from common.checkpoint import latest_checkpoint
from common.config import config_from_dict, config_to_dict, dump_toml, load_manifest
from common.model import ReplacedTokenDetector

pytestmark = pytest.mark.slow


def _poisoning(poisoned_steps):
    """A ReplacedTokenDetector whose training forward returns NaN at the given (0-based) steps."""
    class Poisoned(ReplacedTokenDetector):
        calls = 0
        initial_state = None

        def forward(self, input_ids, attention_mask):
            out = super().forward(input_ids, attention_mask)
            if self.training:  # evaluation stays clean
                if Poisoned.calls == 0:
                    Poisoned.initial_state = copy.deepcopy(self.state_dict())
                step = Poisoned.calls  # one micro-batch per update: one training forward per step
                Poisoned.calls += 1
                if poisoned_steps(step):
                    out = out * float("nan")
            return out
    return Poisoned


def _run(generated, tmp_path, monkeypatch, poisoned_steps, **train):
    manifest, data, _ = generated
    values = config_to_dict(load_manifest(manifest))
    values["train"].update({"max_steps": 8, "ckpt_every": 4, "eval_every": 4, **train})
    path = tmp_path / "m.toml"
    path.write_text(dump_toml(config_from_dict(values)))
    model_class = _poisoning(poisoned_steps)
    monkeypatch.setattr(trainer, "ReplacedTokenDetector", model_class)
    torch.set_num_threads(1)
    args = argparse.Namespace(manifest=str(path), data=str(data), out=str(tmp_path / "run"), resume=False)
    return args, model_class


def _records(tmp_path):
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_a_nonfinite_loss_skips_the_step_and_is_counted(generated, tmp_path, monkeypatch):
    args, _ = _run(generated, tmp_path, monkeypatch, lambda s: s == 2)
    summary = trainer.train(args)
    records = {r["step"]: r for r in _records(tmp_path)}
    assert math.isnan(records[3]["loss"]) and math.isnan(records[3]["grad_norm"])  # step index 2 = logged step 3
    assert all(math.isfinite(records[s]["loss"]) for s in (1, 2, 4, 5, 6, 7, 8))
    assert records[2]["nonfinite_steps"] == 0 and records[8]["nonfinite_steps"] == 1
    assert summary["nonfinite_steps"] == 1 and summary["steps"] == 8
    png = (tmp_path / "run" / "curves.png").read_bytes()  # the training curves beside metrics.jsonl
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_skipped_steps_leave_the_weights_untouched(generated, tmp_path, monkeypatch):
    args, model_class = _run(generated, tmp_path, monkeypatch, lambda s: True, max_steps=4, max_nonfinite_steps=100)
    trainer.train(args)
    _, state = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert state["step"] == 4 and state["nonfinite_total"] == 4
    assert state["model"].keys() == model_class.initial_state.keys()
    assert all(torch.equal(state["model"][k].cpu(), v.cpu()) for k, v in model_class.initial_state.items())


def test_k_nonfinite_losses_in_a_row_stop_the_run_naming_step_rows_and_checkpoint(generated, tmp_path, monkeypatch):
    args, _ = _run(generated, tmp_path, monkeypatch, lambda s: s >= 4, max_nonfinite_steps=3)
    real, drawn = trainer.plot_curves, []
    monkeypatch.setattr(trainer, "plot_curves", lambda run_dir: (drawn.append(len(_records(tmp_path))), real(run_dir)))
    with pytest.raises(FloatingPointError) as error:
        trainer.train(args)
    message = str(error.value)
    assert "3 non-finite losses in a row, last at step 7" in message  # update 6 (0-based): metrics.jsonl's step 7
    assert "stream rows 48..55" in message  # batch 8: update 6 reads rows 48..55
    assert message.endswith("step-00000004.pt")  # the last good checkpoint, written after step 4
    assert drawn == [4, 6]  # curves drawn at the evaluation after step 4, and at the stop with all 6 logged steps


def test_with_sparse_logging_k_nonfinite_losses_in_a_row_stop_the_run_at_most_k_updates_late(generated, tmp_path,
                                                                                                monkeypatch):
    """The trainer reads the skipped flags from the device at log, evaluation and checkpoint steps, and after
    `max_nonfinite_steps` unread updates: with nothing logged for 100 steps, poisoned from update 2 on, the
    flags of updates 0-2 are read after update 2, those of 3-5 after update 5, and the stop names update 4
    (0-based: step 5, as metrics.jsonl counts)."""
    args, _ = _run(generated, tmp_path, monkeypatch, lambda s: s >= 2, max_nonfinite_steps=3, max_steps=100,
                   log_every=100, eval_every=100, ckpt_every=100)
    after = []
    with pytest.raises(FloatingPointError, match=r"3 non-finite losses in a row, last at step 5 \(stream rows 32\.\.39\)"):
        trainer.train(args, after_step=after.append)
    assert after == [1, 2, 3, 4, 5]  # update 5 (0-based) ran before the read that stopped the run after it
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_curves_are_redrawn_at_most_once_a_minute_and_at_the_end(generated, tmp_path, monkeypatch):
    """A redraw costs ~0.5-1 s of rank 0's time; evaluations every 2 steps must not each pay it, nor the end twice."""
    args, _ = _run(generated, tmp_path, monkeypatch, lambda s: False, max_steps=12, eval_every=2, ckpt_every=12)
    real, drawn = trainer.plot_curves, []

    def counting(run_dir):
        records = (run_dir / "metrics.jsonl").read_text().splitlines()
        drawn.append(json.loads(records[-1])["step"])  # the step whose record was written last
        real(run_dir)
    monkeypatch.setattr(trainer, "plot_curves", counting)
    trainer.train(args)
    assert [r["step"] for r in _records(tmp_path) if "val_loss" in r] == [2, 4, 6, 8, 10, 12]
    assert drawn == [2, 12]  # the first evaluation, then the end of the run (well within a minute)
    assert (tmp_path / "run" / "curves.png").read_bytes()[:4] == b"\x89PNG"

    drawn.clear()  # the interval is what holds the redraws back
    monkeypatch.setattr(trainer, "PLOT_INTERVAL_S", 0.0)
    args.out = str(tmp_path / "every")
    trainer.train(args)
    assert drawn == [2, 4, 6, 8, 10, 12]  # the last evaluation leaves the drawing to the end of the run


class _InfiniteGradient(torch.autograd.Function):
    """The identity forward; an infinite gradient backward (a bf16 overflow in the backward pass)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def test_a_finite_loss_with_an_infinite_gradient_skips_the_step(generated, tmp_path, monkeypatch):
    """Only the gradient overflows: the loss is finite, but the clip would turn every gradient into NaN
    (max_norm / inf = 0, and inf x 0 = NaN) and the optimizer step every weight after it."""
    class GradientBlowsUp(ReplacedTokenDetector):
        initial_state = None

        def forward(self, input_ids, attention_mask):
            if self.training and GradientBlowsUp.initial_state is None:
                GradientBlowsUp.initial_state = copy.deepcopy(self.state_dict())
            out = super().forward(input_ids, attention_mask)
            return _InfiniteGradient.apply(out) if self.training else out
    args, _ = _run(generated, tmp_path, monkeypatch, lambda s: False, max_steps=4, max_nonfinite_steps=100)
    monkeypatch.setattr(trainer, "ReplacedTokenDetector", GradientBlowsUp)
    summary = trainer.train(args)
    records = _records(tmp_path)
    assert all(math.isfinite(r["loss"]) and not math.isfinite(r["grad_norm"]) for r in records)
    assert summary["nonfinite_steps"] == 4
    _, state = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert all(torch.equal(state["model"][k].cpu(), v.cpu()) for k, v in GradientBlowsUp.initial_state.items())


def test_a_diverging_command_line_run_ends_with_one_error_line_and_exit_code_2(generated, tmp_path, env_with_repo):
    """`python -m train` as make runs it, diverging for real (lr 1e30): the stop is an `error:` line naming the
    step and the checkpoint, exit code 2 like every other refusal, not a traceback."""
    import subprocess
    import sys
    from tests.conftest import ROOT
    manifest, data, _ = generated
    result = subprocess.run([sys.executable, "-m", "train", "--manifest", str(manifest), "--data", str(data),
                             "--out", str(tmp_path / "run"), "--set", "train.lr=1e30", "--set", "train.max_steps=8",
                             "--set", "train.max_nonfinite_steps=2"],
                            cwd=ROOT, env=env_with_repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert re.search(r"^error: 2 non-finite losses in a row, last at step \d+ .*last good checkpoint: ",
                     result.stderr, re.M), result.stderr[-2000:]
