"""Trainer pieces without torchrun: the data manifest checks, rank slices, metrics."""
import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.checkpoint import IncompatibleInputs
from common.shards import SHARD_SCHEMA
from tests.conftest import tiny_config
from train.data import DataError, load_data_manifest, rank_slice
from train.metrics import roc_auc, rtd_metrics


def _manifest(folder, **changes):
    data = {"vocab_size": 320, "max_seq_len": 32, "epochs": [], "valid": {"shards": []},
            "schema": [{"name": f.name, "type": str(f.type)} for f in SHARD_SCHEMA], **changes}
    folder.mkdir(exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps(data))
    return folder


def test_data_manifest_must_match_the_model_config(tmp_path):
    config = tiny_config(tmp_path)
    load_data_manifest(_manifest(tmp_path / "ok"), config)
    with pytest.raises(IncompatibleInputs, match="vocabulary 999 but the manifest config has tokenizer.vocab_size = 320"):
        load_data_manifest(_manifest(tmp_path / "v", vocab_size=999), config)
    with pytest.raises(IncompatibleInputs, match="sequence length 512"):
        load_data_manifest(_manifest(tmp_path / "s", max_seq_len=512), config)
    with pytest.raises(IncompatibleInputs, match="schema"):
        load_data_manifest(_manifest(tmp_path / "c", schema=[{"name": "input_ids", "type": "list<item: int64>"}]), config)
    with pytest.raises(DataError, match="make generate-epochs"):
        load_data_manifest(tmp_path / "missing", config)


def test_shards_made_with_another_tokenizer_than_the_runs_corpus_are_refused_naming_both(tmp_path):
    config = tiny_config(tmp_path)
    config.corpus_dir.mkdir(parents=True)
    (config.corpus_dir / "corpus.json").write_text(json.dumps({"tokenizer_sha256": "a" * 64}))
    load_data_manifest(_manifest(tmp_path / "same", tokenizer_sha256="a" * 64), config)
    with pytest.raises(IncompatibleInputs, match=rf"made with tokenizer b{{12}}, but this run's corpus "
                                                 rf"{config.corpus_dir} has tokenizer a{{12}}"):
        load_data_manifest(_manifest(tmp_path / "other", tokenizer_sha256="b" * 64), config)


def test_rank_slices_partition_the_global_batch():
    for world in (1, 2, 4):
        rows = [r for step in range(3) for rank in range(world) for r in range(*rank_slice(step, 8, rank, world))]
        assert rows == list(range(24))


def test_auc_matches_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=200).astype(float)
    labels = (rng.random(200) < 0.3).astype(int)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairwise = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg))
    assert roc_auc(scores, labels) == pytest.approx(pairwise)


def test_rtd_metrics_ignore_padding():
    logits = torch.tensor([[3.0, -3.0, 3.0, 9.0], [-3.0, 3.0, -3.0, 9.0]])
    labels = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    m = rtd_metrics(logits, labels, mask)
    assert m["tokens"] == 6 and m["accuracy"] == pytest.approx(5 / 6)
    assert m["recall"] == 1.0 and m["precision"] == pytest.approx(2 / 3)


def _update_harness(tmp_path):
    """The trainer's model, optimizer and schedule for the tiny config, and one update's rows (two micro-batches)."""
    from common.model import ReplacedTokenDetector
    from common.optim import build_optimizer, build_scheduler
    config = tiny_config(tmp_path)
    tc = config.train
    torch.manual_seed(0)
    model = ReplacedTokenDetector(config.model, 320)
    optimizer = build_optimizer(model, tc.lr, tc.betas, tc.eps, tc.weight_decay)
    scheduler = build_scheduler(optimizer, tc.warmup_steps, 10)
    rng = np.random.default_rng(0)
    rows = [{"input_ids": [rng.integers(5, 320, n) for n in (20, 32, 17, 9)],
             "labels": [rng.random(n) < 0.15 for n in (20, 32, 17, 9)]} for _ in range(2)]
    return model, optimizer, scheduler, rows, tc


def test_an_update_never_waits_for_the_device_and_a_nonfinite_one_leaves_every_state_untouched(tmp_path, monkeypatch):
    """`train.trainer.update` reads no tensor on the host (no .item(), float(), bool(), .tolist(): on a GPU each
    is a sync), counted on the real update; the skip of a non-finite update is decided on the device by the fused
    AdamW kernel (found_inf), which leaves weights, moments and step count as they were."""
    import contextlib
    from train import trainer
    from train.data import to_tensors
    model, optimizer, scheduler, rows, tc = _update_harness(tmp_path)
    reads = []
    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name, **k: (reads.append(_name),
                                                                                                 _real(self, *a, **k))[1])
    assert float(torch.ones(())) == 1.0 and reads == ["__float__"]  # the counting sees a host read
    reads.clear()
    run = lambda: trainer.update(model, model, optimizer, scheduler, rows, to_tensors, torch.device("cpu"),
                                 contextlib.nullcontext(), 1, tc)
    results = [run() for _ in range(3)]
    assert reads == [], reads
    monkeypatch.undo()
    loss, _, tokens, grad_norm, stepped = results[-1]
    assert loss.dtype == torch.float64 and tokens == 2 * (20 + 32 + 17 + 9)
    assert bool(stepped) and 0 < float(grad_norm) < float("inf") and 0.2 < float(loss) < 2.0

    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    poisoned = lambda r: {**(b := to_tensors(r)), "labels": torch.full(b["labels"].shape, float("nan"))}
    loss, _, _, grad_norm, stepped = trainer.update(model, model, optimizer, scheduler, rows, poisoned,
                                                    torch.device("cpu"), contextlib.nullcontext(), 1, tc)
    assert not bool(stepped) and torch.isnan(loss) and torch.isnan(grad_norm)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, moments[id(p)][k]) for p, s in optimizer.state.items() for k, v in s.items())
    assert int(next(iter(optimizer.state.values()))["step"]) == 3  # the skipped update did not count


def test_a_fast_offline_update_has_no_data_dependent_shape(tmp_path):
    """The whole update (batch to tensors, forward, RTD loss, backward, clip, fused AdamW, schedule) runs on fake
    tensors, which carry shapes and no values: nothing in it has a size that depends on the data (a boolean
    index would: on a GPU its size is read back, a host sync per micro-batch) and nothing reads a value."""
    import contextlib
    from torch._subclasses.fake_tensor import FakeTensorMode
    from train import trainer
    from train.data import to_tensors
    with FakeTensorMode(allow_non_fake_inputs=True):  # the batches are made on the host, as in the trainer
        model, optimizer, scheduler, rows, tc = _update_harness(tmp_path)
        loss, _, tokens, grad_norm, stepped = trainer.update(model, model, optimizer, scheduler, rows, to_tensors,
                                                             torch.device("cpu"), contextlib.nullcontext(), 1, tc)
    assert tokens == 2 * (20 + 32 + 17 + 9) and loss.shape == grad_norm.shape == stepped.shape == ()


def test_the_rtd_loss_is_over_non_pad_tokens_only_and_pads_get_no_gradient():
    """The RTD sum equals the loss over the non-pad tokens alone (within float32 summation order), and a pad's
    logit, even a non-finite one, gets gradient 0 and changes nothing."""
    from train.objectives import forward_losses

    class Fixed(torch.nn.Module):  # stands for the detector: returns the logits it holds
        def __init__(self, logits):
            super().__init__()
            self.logits = torch.nn.Parameter(logits)

        def forward(self, input_ids, attention_mask):
            return self.logits

    torch.manual_seed(0)
    mask = torch.arange(64)[None] < torch.tensor([64, 40, 7, 33])[:, None]
    labels = (torch.rand(4, 64) < 0.15).to(torch.uint8) * mask
    logits = torch.randn(4, 64)
    reference = F.binary_cross_entropy_with_logits(logits[mask].double(), labels[mask].double(), reduction="sum")
    logits[~mask] = float("nan")
    model = Fixed(logits)
    batch = {"input_ids": torch.zeros(4, 64, dtype=torch.int32), "labels": labels, "attention_mask": mask}
    rtd = forward_losses(model, batch, torch.device("cpu"), False)[0]
    assert torch.isclose(rtd.double(), reference, rtol=1e-6)
    rtd.backward()
    assert torch.all(model.logits.grad[~mask] == 0) and torch.all(model.logits.grad[mask] != 0)


def test_compact_batches_give_the_losses_of_long_and_float_ones(tmp_path):
    """to_tensors' int32 ids and uint8 labels: the same loss, bitwise, as int64 ids and float32 labels."""
    from train.data import to_tensors
    from train.objectives import forward_losses
    model, _, _, rows, _ = _update_harness(tmp_path)
    model.eval()
    compact = to_tensors(rows[0])
    assert compact["input_ids"].dtype == torch.int32 and compact["labels"].dtype == torch.uint8
    wide = {**compact, "input_ids": compact["input_ids"].long(), "labels": compact["labels"].float()}
    with torch.no_grad():
        a, b = (forward_losses(model, batch, torch.device("cpu"), False)[0] for batch in (compact, wide))
    assert torch.equal(a, b)


def test_a_read_that_times_out_is_the_trainers_error_not_a_wait_for_sigterm(tmp_path):
    """StopRequest.wait_for polls a step's read so a SIGTERM can end a wait for the generator; the read's own
    TimeoutError (object storage, a network file system) must come out as the error it is, not be taken for
    the poll's."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from train.trainer import StopRequest

    def read():
        raise TimeoutError("read timed out")
    outcome = []
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(read)
        waiter = threading.Thread(target=lambda: outcome.append(_raised(StopRequest().wait_for, future, "x",
                                                                         tmp_path, False)), daemon=True)
        waiter.start()
        waiter.join(timeout=10)
    assert outcome == ["TimeoutError: read timed out"]


def _raised(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the test names what came out
        return f"{type(e).__name__}: {e}"
    return "nothing"


@pytest.mark.slow
def test_the_logged_peak_memory_is_the_trainers_own_not_its_launchers(generated, tmp_path, env_with_repo):
    """metrics.jsonl's `peak_memory_mb` on CPU under a launcher that holds 2 GiB: the trainer's own peak
    (getrusage's ru_maxrss, read before, kept the launcher's RSS at the fork across exec: over 2,048 MB here)."""
    import subprocess
    import sys
    from tests.conftest import ROOT
    manifest, data, _ = generated
    run = tmp_path / "run"
    launcher = ("import subprocess, sys\n"
                "held = bytearray(2 << 30)\n"
                "held[::4096] = b'x' * len(range(0, len(held), 4096))  # resident\n"
                f"sys.exit(subprocess.run(sys.argv[1:]).returncode)\n")
    result = subprocess.run([sys.executable, "-c", launcher, sys.executable, "-m", "train", "--manifest", str(manifest),
                             "--data", str(data), "--out", str(run), "--set", "train.max_steps=2",
                             "--set", "train.warmup_steps=8"], cwd=ROOT,
                            env=env_with_repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    peaks = [json.loads(line)["peak_memory_mb"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert peaks and all(100 < peak < 1500 for peak in peaks), peaks
    # 2 steps of a stream made for more: said, since its rows' temperatures were set for the whole stream
    assert re.search(r"train: note: this run reads \d+% of a stream made for \d+ steps of 8 rows", result.stdout), \
        result.stdout[-2000:]
    # and a warm-up longer than the run: the peak learning rate is never reached
    assert ("train: note: warmup_steps = 8 > the run's 2 updates: the learning rate reaches 0.00025 at most, 25% of "
            "its peak 0.001") in result.stdout, result.stdout[-2000:]


def test_a_micro_batch_with_no_padded_row_runs_the_model_without_a_mask(monkeypatch):
    """The batch says whether a row is padded (`padded`, from the lengths where it is made: no host read in the
    update); if none is, forward_losses gives the model no mask (one attention bias for the micro-batch,
    `common.model.Encoder.forward`), RTD and ELECTRA alike, and the RTD loss is the same. A padded micro-batch,
    or one that does not say, keeps its mask."""
    import common.model as model_module
    from common.config import ModelConfig
    from common.model import ReplacedTokenDetector
    from train.data import to_tensors
    from train.objectives import ElectraPair, electra_tensors, forward_losses
    shapes, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        shapes.append(attn_mask.shape[0])
        return real(q, k, v, attn_mask=attn_mask, **kw)
    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy)
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, rel_buckets=8, rel_max_distance=16,
                      dropout=0.0)
    torch.manual_seed(0)
    model, cpu = ReplacedTokenDetector(cfg, 100), torch.device("cpu")
    rng = np.random.default_rng(0)
    rows = {"input_ids": [rng.integers(5, 100, 16) for _ in range(3)],
            "labels": [rng.random(16) < 0.15 for _ in range(3)]}
    full = to_tensors(rows)
    assert full["padded"] is False
    rtd = forward_losses(model, full, cpu, False)[0]
    assert shapes == [1, 1]  # one bias, broadcast over the rows, in each layer
    assert torch.equal(rtd, forward_losses(model, {**full, "padded": True}, cpu, False)[0])
    assert shapes == [1, 1, 3, 3]
    shapes.clear()
    short = to_tensors({k: [*v[:2], v[2][:9]] for k, v in rows.items()})
    assert short["padded"] is True
    forward_losses(model, short, cpu, False)
    forward_losses(model, {k: v for k, v in full.items() if k != "padded"}, cpu, False)
    assert shapes == [3, 3] * 2
    shapes.clear()
    electra = electra_tensors({"input_ids": rows["input_ids"][:2], "row_id": [0, 1], "epoch": [0, 0]})
    assert electra["padded"] is False
    forward_losses(ElectraPair(cfg, 100, 1), electra, cpu, True)  # the generator's layer, then the detector's
    assert shapes == [1] * (1 + cfg.num_layers)
