"""common/attention.py: the fused attention with a learned bias and dropout. Its kernels run on the CPU under
Triton's interpreter (float32: the interpreter's bfloat16 matmul is not a bfloat16 matmul) and on a GPU in
bfloat16 where one is present; the CPU trainer keeps SDPA."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from common import attention
from common.config import ConfigError, config_from_dict
from tests.conftest import ROOT


def reference(q, k, v, bias, dropout_p, keep):
    """softmax(q k^T / sqrt(d) + bias) v in float64, dropout by the kernel's own keep mask."""
    probs = torch.softmax(q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias.double(), -1)
    if dropout_p > 0:  # the kernel's rate: dropout_p to 1 / 2^16
        probs = probs * keep * attention._dropout_args(dropout_p)[1]
    return probs @ v.double()


def compare(B, H, L, D, dropout_p, padded, dtype, device, seed=1234) -> dict:
    """The kernel against `reference` on the model's layout (q, k, v views of one (B, L, 3, H, D) projection):
    relative errors of the output and of the gradients of the projection and of a (1, H, L, L) bias table, which
    reaches the kernel broadcast over the batch, or per row with -inf on padded keys."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, L, 3, H, D, generator=g).to(device, dtype).requires_grad_()
    table = torch.randn(1, H, L, L, generator=g).to(device, dtype).requires_grad_()
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    bias = table
    if padded:  # the encoder's per-row bias: the last keys of row 0 are padding
        pad = torch.zeros(B, 1, 1, L, device=device, dtype=dtype)
        pad[0, ..., L - 5:] = float("-inf")
        bias = table + pad
    seed_tensor = torch.tensor([seed], dtype=torch.int64, device=device)
    out = attention.attention(q, k, v, bias, dropout_p, seed=seed_tensor)
    keep = attention.dropout_keep_mask(seed_tensor, B, H, L, dropout_p)
    ref = reference(q, k, v, bias, dropout_p, keep)
    grad = torch.randn(ref.shape, generator=g).to(device)
    got = [out, *torch.autograd.grad(out, (qkv, table), grad.to(dtype))]
    want = [ref, *torch.autograd.grad(ref, (qkv, table), grad.double())]
    errors = [float((a.double() - b).norm() / b.norm()) for a, b in zip(got, want)]
    again = attention.dropout_keep_mask(seed_tensor, B, H, L, dropout_p)
    other = attention.dropout_keep_mask(seed_tensor + 1, B, H, L, dropout_p)
    return {"out": errors[0], "dqkv": errors[1], "dbias": errors[2], "keep_fraction": float(keep.float().mean()),
            "mask_repeats": bool(torch.equal(keep, again)), "mask_differs_by_seed": not torch.equal(keep, other),
            "finite": bool(torch.isfinite(out).all()),
            "neighbours_agree": float((keep[..., 1:] == keep[..., :-1]).float().mean())}


SHAPES = [  # (B, H, L, D, dropout_p, padded): lengths off the tiles' multiples, each head dim family, then on
    (2, 2, 48, 16, 0.0, False), (2, 3, 80, 32, 0.25, True), (3, 2, 40, 64, 0.1, False),
    (2, 2, 128, 16, 0.1, True)]  # a multiple of every tile: the kernels' unmasked path, a per-row bias


def edge_checks(device="cpu") -> dict:
    """What `compare` does not reach: a row whose keys are all padding (output 0, gradients 0, no NaN); a
    gradient expanded from a sum (stride 0 along d) against the reference's; masks of neighbouring seeds that
    are not one another's shifted by a head; the custom op's own consistency (torch.library.opcheck: fakes,
    autograd registration, traced dispatch)."""
    B, H, L, D, p = 2, 2, 40, 16, 0.2
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, L, D, generator=g).to(device).requires_grad_() for _ in range(3))
    table = torch.randn(1, H, L, L, generator=g).to(device).requires_grad_()
    pad = torch.zeros(B, 1, 1, L, device=device)
    pad[1] = float("-inf")  # row 1: every key padding
    seed = torch.tensor([99], dtype=torch.int64, device=device)
    out = attention.attention(q, k, v, table + pad, p, seed=seed)
    out.sum().backward()  # dO expanded from a scalar: stride 0 everywhere
    empty_row = {"out_zero": bool((out[1] == 0).all()), "grads_zero": all(bool((t.grad[1] == 0).all()) for t in (q, k, v)),
                 "finite": all(bool(torch.isfinite(t).all()) for t in (out, q.grad, k.grad, v.grad, table.grad))}
    got = [t.grad.clone() for t in (q, k, v, table)]
    for t in (q, k, v, table):
        t.grad = None
    keep = attention.dropout_keep_mask(seed, B, H, L, p)
    ref = reference(q[:1], k[:1], v[:1], table, p, keep[:1])  # row 0 alone: row 1 contributes nothing
    ref.sum().backward()
    expanded = max(float((a[:1].double() - b[:1].double()).norm() / b[:1].double().norm())
                   for a, b in zip(got[:3], (q.grad, k.grad, v.grad)))
    expanded = max(expanded, float((got[3].double() - table.grad.double()).norm() / table.grad.double().norm()))
    shifted = attention.dropout_keep_mask(seed + 1, B, H, L, p)
    checks = torch.library.opcheck(torch.ops.fast_electra.attention_forward.default,
                                   (q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_(),
                                    table.detach().requires_grad_(), seed, p))
    return {"empty_row": empty_row, "expanded_grad_error": expanded,
            "next_seed_is_a_head_shift": bool(torch.equal(shifted[:, :-1], keep[:, 1:])),
            "opcheck": {name: result for name, result in checks.items()}}


def fallback_checks() -> list[dict]:
    """`compare` with each of the fallback tiles a GPU short of shared memory takes (`FWD_FALLBACK`, `BWD_FALLBACK`,
    paired in turn), on a padded length off every tile with dropout."""
    A, out = attention, []
    kept = (A.FWD_BLOCK_M, A.FWD_BLOCK_N, A.FWD_WARPS, A.FWD_STAGES, A.BWD_BLOCK_M, A.BWD_BLOCK_N, A.BWD_WARPS,
            A.BWD_STAGES)
    try:
        for i, bwd in enumerate(A.BWD_FALLBACK):
            fwd = A.FWD_FALLBACK[min(i, len(A.FWD_FALLBACK) - 1)]
            (A.FWD_BLOCK_M, A.FWD_BLOCK_N, A.FWD_WARPS, A.FWD_STAGES), (A.BWD_BLOCK_M, A.BWD_BLOCK_N, A.BWD_WARPS,
                                                                        A.BWD_STAGES) = fwd, bwd
            out.append({"tiles": [fwd, bwd], **compare(1, 2, 40, 16, 0.2, True, torch.float32, "cpu")})
    finally:
        (A.FWD_BLOCK_M, A.FWD_BLOCK_N, A.FWD_WARPS, A.FWD_STAGES, A.BWD_BLOCK_M, A.BWD_BLOCK_N, A.BWD_WARPS,
         A.BWD_STAGES) = kept
    return out


def interpreted_checks() -> dict:
    """Run in a process of its own with TRITON_INTERPRET=1 (read when the kernels are defined)."""
    return {"shapes": [compare(*shape, torch.float32, "cpu") for shape in SHAPES], "edges": edge_checks(),
            "fallbacks": fallback_checks()}


def tile_sweep_with_a_refusal() -> dict:
    """bench.gpu's tile sweep on a GPU whose shared memory refuses forward tiles with BLOCK_M 128 (Triton raises
    before the kernel runs; simulated here around the real kernel, run by the interpreter): those tiles must be
    reported as refused, not timed as the fallback that ran in their place."""
    from triton.runtime.errors import OutOfResources
    from bench import gpu
    from common.config import ModelConfig
    real = attention._forward_kernel

    class Refusing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if kwargs["BLOCK_M"] == 128:
                    raise OutOfResources(280576, 232448, "shared memory")
                return real[grid](*args, **kwargs)
            return launch
    attention._forward_kernel = Refusing()
    config = SimpleNamespace(model=ModelConfig(hidden_size=32, num_heads=2, num_layers=1, ffn_size=64),
                             corpus=SimpleNamespace(max_seq_len=64))  # what measure_fused_tiles reads
    gpu.FWD_TILES, gpu.BWD_TILES = ((64, 64, 4, 3), (128, 64, 8, 3)), ((64, 64, 4, 3),)
    out = gpu.measure_fused_tiles(config, rows=1, repeats=1, device=torch.device("cpu"))
    return {"timed": sorted(out["fwd_bwd_ms"]), "errors": out["errors"], "best_fwd": out["best_fwd"],
            "fitted_after": len(attention._fitted)}


def _interpreter_works() -> bool:
    try:
        import numpy as np
        import triton  # noqa: F401
        int(np.array([1]))  # Triton < 3.7's interpreter needs this of numpy (an error from numpy 2.4 on)
        return True
    except (ImportError, TypeError):
        import triton
        return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)


def interpreted(function: str) -> dict:
    """This module's `function()` in a process of its own under Triton's interpreter (TRITON_INTERPRET=1 is read
    when the kernels are defined), its JSON result; skips where the interpreter cannot run here."""
    if not _interpreter_works():
        pytest.skip("this Triton's interpreter does not run with this numpy (Triton >= 3.7 does)")
    code = f"import json, tests.test_attention as t; print(json.dumps(t.{function}()))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not attention.available(), reason="Triton is not installed (the test extra installs it)")
def test_kernels_compute_attention_with_the_bias_gradient_and_the_dropout_they_say():
    checks = interpreted("interpreted_checks")
    edges = checks["edges"]
    assert edges["empty_row"] == {"out_zero": True, "grads_zero": True, "finite": True}, edges
    assert edges["expanded_grad_error"] < 1e-5, edges
    assert not edges["next_seed_is_a_head_shift"], edges  # the seed keys Philox; the head is a counter word
    assert set(edges["opcheck"].values()) == {"SUCCESS"}, edges["opcheck"]
    for shape, r in zip(SHAPES, checks["shapes"]):
        assert max(r["out"], r["dqkv"], r["dbias"]) < 1e-5, (shape, r)  # float32 against float64
        assert r["finite"] and r["mask_repeats"], (shape, r)
        if shape[4] > 0:
            assert r["mask_differs_by_seed"], (shape, r)
            assert abs(r["keep_fraction"] - (1 - shape[4])) < 0.03, (shape, r)
            # neighbouring keys, 16 bits of one draw apart or two draws, are independent
            assert abs(r["neighbours_agree"] - (shape[4] ** 2 + (1 - shape[4]) ** 2)) < 0.03, (shape, r)
        else:
            assert r["keep_fraction"] == 1.0
    assert len(checks["fallbacks"]) == len(attention.BWD_FALLBACK)
    for r in checks["fallbacks"]:  # the smaller tiles compute the same function, dropout mask included
        assert max(r["out"], r["dqkv"], r["dbias"]) < 1e-5 and r["finite"], r


def test_the_fused_kernel_takes_gpu_training_calls_only():
    """On the CPU a model given the kernel keeps SDPA, bit for bit; a bias without a gradient (the aux forward,
    evaluation under no_grad) goes to SDPA on any device."""
    from common.config import ModelConfig
    from common.model import ReplacedTokenDetector
    cfg = ModelConfig(hidden_size=32, num_heads=2, num_layers=2, ffn_size=64)
    torch.manual_seed(0)
    plain = ReplacedTokenDetector(cfg, 100)
    fused = ReplacedTokenDetector(cfg, 100)
    fused.load_state_dict(plain.state_dict())
    taken = attention.use_fused(fused)
    assert taken == (2 if attention.available() else 0)
    ids = torch.randint(5, 100, (3, 16))
    mask = torch.ones(3, 16, dtype=torch.bool)
    torch.manual_seed(1)
    a = plain(ids, mask)
    torch.manual_seed(1)
    b = fused(ids, mask)
    assert torch.equal(a, b)
    q = torch.zeros(1, 2, 16, 16)
    assert not attention.applies(q, torch.zeros(1, 2, 16, 16, requires_grad=True))  # CPU
    assert not attention.applies(q, torch.zeros(1, 2, 16, 16))  # CPU, a bias without a gradient
    if torch.cuda.is_available() and attention.available():
        qc = q.cuda().bfloat16()
        assert attention.applies(qc, torch.zeros(1, 2, 16, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True))
        assert not attention.applies(qc, torch.zeros(1, 2, 16, 16, device="cuda", dtype=torch.bfloat16))


def test_train_attention_setting_is_checked():
    with pytest.raises(ConfigError, match="train.attention"):
        config_from_dict({"train": {"attention": "flash"}})
    assert config_from_dict({"train": {"attention": "sdpa"}}).train.attention == "sdpa"


gpu = pytest.mark.skipif(not (torch.cuda.is_available() and attention.available()), reason="needs CUDA and Triton")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(4, 12, 512, 64, 0.1, False), (4, 12, 200, 64, 0.1, True),
                                   (2, 4, 128, 32, 0.0, True), (2, 2, 96, 128, 0.2, False)])
def test_gpu_kernels_in_bfloat16_against_float64(shape):
    r = compare(*shape, torch.bfloat16, "cuda")
    assert max(r["out"], r["dqkv"], r["dbias"]) < 2e-2, r  # bfloat16 operands: 1e-3 to 1e-2
    assert r["finite"] and r["mask_repeats"], r


@pytest.mark.gpu
@gpu
def test_gpu_trainer_update_with_the_kernel_matches_sdpa_and_compiles():
    """The base layer's shape, dropout off: one forward and backward of the detector under bf16 autocast through
    the kernel and through SDPA, and the kernel's under torch.compile (the trainer's default on a GPU, with the
    token lookup of common/embedding.py, as the trainer compiles it)."""
    from common.config import ModelConfig
    from common.embedding import use_eager_backward
    from common.model import ReplacedTokenDetector
    cfg = ModelConfig(hidden_size=768, num_heads=12, num_layers=2, ffn_size=3072, dropout=0.0)
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (4, 512), device="cuda")
    results = []
    for way in ("sdpa", "fused", "compiled"):
        torch.manual_seed(0)
        model = ReplacedTokenDetector(cfg, 1000).cuda()
        if way != "sdpa":
            assert attention.use_fused(model) == 2
        if way == "compiled":
            assert use_eager_backward(model) == 2
        run = torch.compile(model) if way == "compiled" else model
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = run(ids, None)
        logits.float().square().mean().backward()
        results.append((logits.float(), model.encoder.rel_bias.bias.weight.grad.clone(),
                        model.encoder.layers[0].qkv.weight.grad.clone(), model.encoder.embed.weight.grad.clone()))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert float((a - b).norm() / b.norm()) < 3e-2


def test_the_trainer_routes_attention_through_the_kernel_on_a_gpu_only(tmp_path):
    """`[train] attention = "auto"`: the kernel on a GPU (where Triton is), SDPA on the CPU; "sdpa": SDPA anywhere."""
    from tests.conftest import tiny_config
    from train.trainer import build_model
    for setting in ("auto", "sdpa"):
        config = tiny_config(tmp_path, train={"attention": setting})
        devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
        for device in devices:
            model, _ = build_model(config, 100, 0.1, device)
            routed = {layer.fused_attention is not None for layer in model.encoder.layers}
            assert routed == {setting == "auto" and device.type == "cuda" and attention.available()}


@pytest.mark.skipif(not attention.available(), reason="Triton is not installed (the test extra installs it)")
def test_tiles_too_large_for_the_gpu_fall_back_to_smaller_ones_once(monkeypatch):
    """A GPU without the shared memory for the measured tiles (an H200 at head dim 128 asked 274 KiB of its 227 for
    the backward's; Triton raises before the kernel runs) takes the first fallback that fits, remembered per key;
    where none fits the error names the file and the head dim. The kernels themselves: the GPU tests above."""
    from triton.runtime.errors import OutOfResources
    monkeypatch.setattr(attention, "_fitted", {})
    tried = []

    def launch(tiles):  # a GPU whose shared memory holds tiles of 64 x 64 in 2 stages and less
        tried.append(tiles)
        if tiles[0] * tiles[1] * tiles[3] > 64 * 64 * 2:
            raise OutOfResources(280576, 232448, "shared memory")
    measured = (128, 64, 8, 3)
    attention._with_tiles(("backward", 128, torch.bfloat16, "cuda:0"), measured, attention.BWD_FALLBACK, launch)
    assert tried == [measured, (64, 64, 4, 3), (64, 64, 4, 2)]
    tried.clear()
    attention._with_tiles(("backward", 128, torch.bfloat16, "cuda:0"), measured, attention.BWD_FALLBACK, launch)
    assert tried == [(64, 64, 4, 2)]  # remembered: no second failed compile
    attention._with_tiles(("backward", 64, torch.bfloat16, "cuda:0"), (64, 32, 4, 2), attention.BWD_FALLBACK, launch)
    assert tried[-1] == (64, 32, 4, 2)  # another head dim, tiles that fit: taken as they are
    tried.clear()

    def tighter(tiles):  # another variant of the kernel (dropout on, say), compiled apart, needing more
        tried.append(tiles)
        if tiles[0] * tiles[1] * tiles[3] > 32 * 64 * 2:
            raise OutOfResources(280576, 232448, "shared memory")
    attention._with_tiles(("backward", 128, torch.bfloat16, "cuda:0"), measured, attention.BWD_FALLBACK, tighter)
    assert tried == [(64, 64, 4, 2), measured, (64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 2)], tried
    assert attention._fitted[("backward", 128, torch.bfloat16, "cuda:0", measured)] == (32, 64, 4, 2)

    def never(tiles):
        raise OutOfResources(1 << 20, 232448, "shared memory")
    with pytest.raises(RuntimeError, match="common/attention.py.*head dim 256"):
        attention._with_tiles(("forward", 256, torch.bfloat16, "cuda:0"), (64, 64, 4, 3), attention.FWD_FALLBACK, never)


@pytest.mark.skipif(not attention.available(), reason="Triton is not installed (the test extra installs it)")
def test_the_tile_sweep_reports_a_refused_tile_instead_of_timing_its_fallback():
    r = interpreted("tile_sweep_with_a_refusal")
    assert r["timed"] == ["bwd (64, 64, 4, 3)", "fwd (64, 64, 4, 3)"], r
    assert list(r["errors"]) == ["fwd (128, 64, 8, 3)"] and "fallback" in r["errors"]["fwd (128, 64, 8, 3)"], r
    assert r["best_fwd"] == [64, 64, 4, 3] and r["fitted_after"] == 0, r
