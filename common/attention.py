"""Fused attention with an additive bias that learns (the T5 relative-position bias), with dropout, in Triton.

Paper section 4.1 takes T5's relative position bias; the bias is a parameter, so attention needs its
gradient. SDPA's fused GPU kernels either refuse a bias that needs a gradient (cuDNN, flash) or run it
slowly (the memory-efficient backend: 2.5 ms a base layer forward + backward on an H200, against 0.55 ms
without a bias; docs/benchmarks.md). This module is FlashAttention-2's schedule with the bias read tile by
tile in the forward and its gradient dS written once in the backward, where two cheap reductions of it
give the rest: dQ = scale * dS @ K (one batched matmul) and d(bias) = the sum of dS over the rows that
share the bias. Attention dropout draws its keep mask from Philox by (seed, batch-head, query, key), so
the backward recomputes the forward's mask instead of storing it.

GPU only, under the trainer (`use_fused`); the CPU keeps SDPA, so CPU results are unchanged. The kernels
also run on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`), which is how the tests check them.
"""
from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError:  # a CPU machine without Triton: SDPA everywhere
    triton = None

# Tiles, measured on an H200 at the base shape (docs/benchmarks.md); head dims 16-128.
FWD_BLOCK_M, FWD_BLOCK_N, FWD_WARPS, FWD_STAGES = 64, 64, 4, 3
BWD_BLOCK_M, BWD_BLOCK_N, BWD_WARPS, BWD_STAGES = 128, 64, 8, 3
# Smaller tiles, tried in turn where a GPU has too little shared memory for those (on an H200, head dim 128: the
# backward's 128 x 64 tiles in 3 stages asked for 274 KiB of its 227); the first that fits is kept per head dim.
FWD_FALLBACK = ((64, 64, 4, 2), (32, 64, 4, 2), (32, 32, 4, 1))
BWD_FALLBACK = ((64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 2), (32, 32, 4, 1))
_fitted: dict = {}  # (kernel, head dim, dtype, device, the measured tiles) -> the tiles that fit


def available() -> bool:
    """Whether Triton is installed (the kernels can be defined)."""
    return triton is not None


def applies(q: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether `attention` takes this call: a GPU, half precision, a head dim the tiles fit, a bias that
    needs its gradient (a bias without one goes to SDPA's cuDNN backend, faster there) of shape
    (1 or B, heads, L, L)."""
    return (triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[-1] in (16, 32, 64, 128) and bias.requires_grad and bias.dim() == 4
            and bias.shape[0] in (1, q.shape[0]) and bias.shape[1:] == (q.shape[1], q.shape[2], q.shape[2]))


if triton is not None:
    @triton.jit
    def _keep(seed, bh, offs_m, start_n, L, threshold, BLOCK_N: tl.constexpr):
        """The dropout keep mask of a tile of queries `offs_m` x keys start_n .. start_n + BLOCK_N (start_n a
        multiple of 8): one Philox call (the call's seed as the key; query * ceil(L / 8) + key // 8 and the
        batch-head index as the counter's first two words) gives 4 x 32 random bits, 16 for each of 8 keys,
        kept where they are >= `threshold`."""
        groups = start_n // 8 + tl.arange(0, BLOCK_N // 8)
        counter = offs_m[:, None] * ((L + 7) // 8) + groups[None, :]
        zero = counter * 0
        r0, r1, r2, r3 = tl.philox(seed, counter, zero + bh, zero, zero)
        lo = tl.join(tl.join(r0 & 0xFFFF, r0 >> 16), tl.join(r1 & 0xFFFF, r1 >> 16))
        hi = tl.join(tl.join(r2 & 0xFFFF, r2 >> 16), tl.join(r3 & 0xFFFF, r3 >> 16))
        # key 8g + 4k + 2j + i takes draw [i, j, k] of group g: the order in which joins stack them, no shuffle
        bits = tl.reshape(tl.join(lo, hi), (offs_m.shape[0], BLOCK_N))
        return bits >= threshold

    @triton.jit
    def _load(pointers, mask, other, EVEN: tl.constexpr):
        """A tile that lies inside the tensor where EVEN (L a multiple of both blocks): no mask to compute."""
        if EVEN:
            x = tl.load(pointers)
        else:
            x = tl.load(pointers, mask=mask, other=other)
        return x

    @triton.jit
    def _store(pointers, x, mask, EVEN: tl.constexpr):
        if EVEN:
            tl.store(pointers, x)
        else:
            tl.store(pointers, x, mask=mask)

    @triton.jit
    def _forward_kernel(Q, K, V, BIAS, O, LSE, SEED,
                        sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sbb, sbh, sbm, sob, soh, som,
                        H, L, scale, threshold, keep_scale,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr,
                        EVEN: tl.constexpr):
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)  # 64-bit bases: a per-row bias passes 2^31 elements
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        row_ok = offs_m < L
        q = _load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], row_ok[:, None], 0.0, EVEN)
        seed = 0
        if DROPOUT:
            seed = tl.load(SEED)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2 below: scores in log2 units
        for start in range(0, L, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            col_ok = offs_n < L
            k = _load(K + b * skb + h * skh + offs_n[None, :] * skn + offs_d[:, None], col_ok[None, :], 0.0, EVEN)
            v = _load(V + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :], col_ok[:, None], 0.0, EVEN)
            bias = _load(BIAS + b * sbb + h * sbh + offs_m[:, None] * sbm + offs_n[None, :],
                         row_ok[:, None] & col_ok[None, :], 0.0, EVEN)
            s = tl.dot(q, k) * qk_scale + bias.to(tl.float32) * 1.4426950408889634
            if not EVEN:
                s = tl.where(col_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row whose keys are all masked so far
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if DROPOUT:
                p = tl.where(_keep(seed, bh, offs_m, start, L, threshold, BLOCK_N), p * keep_scale, 0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        empty = l_i == 0.0  # every key masked: output 0, and +inf in the log-sum-exp so the backward's P is 0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        _store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :], o.to(O.dtype.element_ty),
               row_ok[:, None], EVEN)
        lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        _store(LSE + bh * L + offs_m, lse, row_ok, EVEN)

    @triton.jit
    def _delta_kernel(O, DO, DELTA, sob, soh, som, sdb, sdh, sdm, H, L, D: tl.constexpr, BLOCK_M: tl.constexpr):
        """rowsum(dO * O) = rowsum(dP * P) (dropout included), the backward's softmax term, in float32."""
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        row_ok = offs_m < L
        o = tl.load(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        tl.store(DELTA + bh * L + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=row_ok)

    @triton.jit
    def _backward_kernel(Q, K, V, BIAS, DO, LSE, DELTA, DK, DV, DS, SEED,
                         sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sbb, sbh, sbm, sdb, sdh, sdm,
                         H, L, scale, threshold, keep_scale,
                         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr,
                         EVEN: tl.constexpr):
        """One block of keys against every query: dK and dV accumulated here, dS written for dQ and the bias."""
        pid_n, bh = tl.program_id(0), tl.program_id(1)
        b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)  # 64-bit bases: a per-row bias passes 2^31 elements
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        col_ok = offs_n < L
        k = _load(K + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :], col_ok[:, None], 0.0, EVEN)
        v = _load(V + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :], col_ok[:, None], 0.0, EVEN)
        seed = 0
        if DROPOUT:
            seed = tl.load(SEED)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        qk_scale = scale * 1.4426950408889634
        for start in range(0, L, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            row_ok = offs_m < L
            q = _load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], row_ok[:, None], 0.0, EVEN)
            do = _load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], row_ok[:, None], 0.0, EVEN)
            lse = _load(LSE + bh * L + offs_m, row_ok, float("inf"), EVEN)
            delta = _load(DELTA + bh * L + offs_m, row_ok, 0.0, EVEN)
            bias = _load(BIAS + b * sbb + h * sbh + offs_m[:, None] * sbm + offs_n[None, :],
                         row_ok[:, None] & col_ok[None, :], 0.0, EVEN)
            s = tl.dot(q, tl.trans(k)) * qk_scale + bias.to(tl.float32) * 1.4426950408889634
            if not EVEN:
                s = tl.where(col_ok[None, :], s, float("-inf"))
            p = tl.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v))
            if DROPOUT:
                keep = _keep(seed, bh, offs_m, pid_n * BLOCK_N, L, threshold, BLOCK_N)
                dv += tl.dot(tl.trans(tl.where(keep, p * keep_scale, 0.0).to(do.dtype)), do)
                dp = tl.where(keep, dp * keep_scale, 0.0)
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            ds = (p * (dp - delta[:, None])).to(q.dtype)
            _store(DS + bh.to(tl.int64) * L * L + offs_m[:, None] * L + offs_n[None, :], ds,
                   row_ok[:, None] & col_ok[None, :], EVEN)
            dk += tl.dot(tl.trans(ds), q)
        base = bh.to(tl.int64) * L * D
        _store(DK + base + offs_n[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), col_ok[:, None],
               EVEN)
        _store(DV + base + offs_n[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty), col_ok[:, None], EVEN)


def _blocks(L: int, block: int) -> int:
    return triton.cdiv(L, block)


def _with_tiles(key: tuple, measured: tuple, fallbacks: tuple, launch) -> None:
    """`launch(tiles)` with the measured tiles, or where the GPU's shared memory cannot hold them (Triton says so
    before the kernel runs) with the first of `fallbacks` that fits; the tiles that fit are remembered per `key`."""
    key = (*key, measured)
    if key in _fitted:
        try:  # remembered; but another variant of the kernel (dropout on or off, a length off the tiles) is
            return launch(_fitted[key])  # compiled apart and may need more shared memory
        except OutOfResources:
            del _fitted[key]
    for tiles in (measured, *fallbacks):
        try:
            launch(tiles)
        except OutOfResources:
            continue
        _fitted[key] = tiles
        return None
    raise RuntimeError(f"common/attention.py: no tiles of {(measured, *fallbacks)} fit this GPU's shared memory "
                       f"for {key[0]} at head dim {key[1]}")


def _compiled_args(tiles: tuple, L: int, D: int, p_drop: float) -> dict:
    """A kernel launch's compile-time arguments for `tiles` (BLOCK_M, BLOCK_N, warps, stages)."""
    block_m, block_n, warps, stages = tiles
    return dict(D=D, BLOCK_M=block_m, BLOCK_N=block_n, DROPOUT=p_drop > 0.0,
                EVEN=L % block_m == 0 and L % block_n == 0, num_warps=warps, num_stages=stages)


def _dropout_args(p_drop: float) -> tuple[int, float]:
    """(threshold, scale): a probability is dropped where 16 random bits fall under round(p * 2^16), so the
    rate is p to 1 / 2^16 (0.1 drops 6,554 / 65,536 = 0.100006), and kept ones are scaled by 1 / (1 - that rate)."""
    threshold = round(p_drop * 65536)
    return threshold, 65536.0 / (65536 - threshold) if threshold < 65536 else 0.0


@torch.library.custom_op("fast_electra::attention_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, seed: torch.Tensor,
             p_drop: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, L, D = q.shape
    o = torch.empty((B, L, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)  # (B, H, L, D), rows' layout
    lse = torch.empty((B, H, L), dtype=torch.float32, device=q.device)
    sbb = bias.stride(0) if bias.shape[0] > 1 else 0

    def launch(tiles):  # a program per BLOCK_M queries
        _forward_kernel[(_blocks(L, tiles[0]), B * H)](
            q, k, v, bias, o, lse, seed,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), sbb, bias.stride(1), bias.stride(2),
            o.stride(0), o.stride(1), o.stride(2), H, L, 1.0 / math.sqrt(D), *_dropout_args(p_drop),
            **_compiled_args(tiles, L, D, p_drop))
    _with_tiles(("forward", D, q.dtype, q.device), (FWD_BLOCK_M, FWD_BLOCK_N, FWD_WARPS, FWD_STAGES), FWD_FALLBACK,
                launch)
    return o, lse


@_forward.register_fake
def _(q, k, v, bias, seed, p_drop):
    B, H, L, D = q.shape
    return (q.new_empty((B, L, H, D)).transpose(1, 2), q.new_empty((B, H, L), dtype=torch.float32))


@torch.library.custom_op("fast_electra::attention_backward", mutates_args=())
def _backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
              o: torch.Tensor, lse: torch.Tensor, seed: torch.Tensor, p_drop: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, L, D = q.shape
    delta = torch.empty((B, H, L), dtype=torch.float32, device=q.device)
    _delta_kernel[(_blocks(L, 128), B * H)](o, do, delta, o.stride(0), o.stride(1), o.stride(2),
                                           do.stride(0), do.stride(1), do.stride(2), H, L, D=D, BLOCK_M=128)
    dk = torch.empty((B, H, L, D), dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    ds = torch.empty((B, H, L, L), dtype=q.dtype, device=q.device)
    sbb = bias.stride(0) if bias.shape[0] > 1 else 0

    def launch(tiles):  # a program per BLOCK_N keys
        _backward_kernel[(_blocks(L, tiles[1]), B * H)](
            q, k, v, bias, do, lse, delta, dk, dv, ds, seed,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), sbb, bias.stride(1), bias.stride(2),
            do.stride(0), do.stride(1), do.stride(2), H, L, 1.0 / math.sqrt(D), *_dropout_args(p_drop),
            **_compiled_args(tiles, L, D, p_drop))
    _with_tiles(("backward", D, q.dtype, q.device), (BWD_BLOCK_M, BWD_BLOCK_N, BWD_WARPS, BWD_STAGES), BWD_FALLBACK,
                launch)
    dq = torch.empty_like(dk)  # contiguous, as the fake says, whatever layout k has
    torch.matmul(ds, k, out=dq).mul_(1.0 / math.sqrt(D))
    dbias = ds.sum(0, keepdim=True, dtype=torch.float32).to(bias.dtype) if bias.shape[0] == 1 else ds.to(bias.dtype)
    return dq, dk, dv, dbias


@_backward.register_fake
def _(do, q, k, v, bias, o, lse, seed, p_drop):
    grads = [q.new_empty(q.shape) for _ in range(3)]  # contiguous, as the kernel and the matmul make them
    return (*grads, torch.empty_like(bias, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    q, k, v, bias, seed, p_drop = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, bias, o, lse, seed)
    ctx.mark_non_differentiable(lse)
    ctx.p_drop = p_drop


def _backward_rule(ctx, do, _dlse):
    q, k, v, bias, o, lse, seed = ctx.saved_tensors
    if do.stride(-1) != 1:  # the kernels step along a row of dO by 1 (an expanded gradient has stride 0 there)
        do = do.contiguous()
    dq, dk, dv, dbias = _backward(do, q, k, v, bias, o, lse, seed, ctx.p_drop)
    return dq, dk, dv, dbias, None, None


_forward.register_autograd(_backward_rule, setup_context=_setup_context)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, dropout_p: float = 0.0,
              seed: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v, with dropout on the probabilities as SDPA's `dropout_p` does.
    q, k, v: (B, H, L, D), any strides with the last at 1; bias: (1 or B, H, L, L), last stride 1.
    Returns (B, H, L, D), laid out as (B, L, H, D) so the caller's transpose back to rows is free.
    `seed`: a one-element int64 tensor on q's device (drawn from torch's generator where None)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the kernels step along d by 1
    if seed is None:
        seed = torch.randint(0, 2**31 - 1, (1,), device=q.device, dtype=torch.int64)
    o, _ = _forward(q, k, v, bias.contiguous(), seed, float(dropout_p))
    return o


def dropout_keep_mask(seed: torch.Tensor, B: int, H: int, L: int, dropout_p: float) -> torch.Tensor:
    """The keep mask `attention` applies with this seed, (B, H, L, L) bool: for tests and checks."""
    keep = torch.empty((B, H, L, L), dtype=torch.int8, device=seed.device)
    block_n = max(8, triton.next_power_of_2(L))
    block_m = max(1, 4096 // block_n)  # a tile of queries a program: Triton's interpreter pays per program
    _mask_kernel[(triton.cdiv(L, block_m), B * H)](keep, seed, L, _dropout_args(dropout_p)[0], BLOCK_M=block_m,
                                                  BLOCK_N=block_n)
    return keep.bool()


if triton is not None:
    @triton.jit
    def _mask_kernel(KEEP, SEED, L, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        m, bh = tl.program_id(0), tl.program_id(1)
        offs_n = tl.arange(0, BLOCK_N)
        offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
        keep = _keep(tl.load(SEED), bh, offs_m, 0, L, threshold, BLOCK_N)
        tl.store(KEEP + bh.to(tl.int64) * L * L + offs_m[:, None] * L + offs_n[None, :], keep.to(tl.int8),
                 mask=(offs_m[:, None] < L) & (offs_n[None, :] < L))


def use_fused(model: torch.nn.Module) -> int:
    """Route the attention of every encoder layer in `model` through `attention` where `applies` says so
    (the layers keep SDPA otherwise). Returns how many layers take it; 0 without Triton."""
    if triton is None:
        return 0
    layers = [m for m in model.modules() if hasattr(m, "fused_attention")]
    for layer in layers:
        layer.fused_attention = _maybe_fused
    return len(layers)


def _maybe_fused(q, k, v, bias, dropout_p):
    """None where `attention` does not apply: the layer then calls SDPA."""
    return attention(q, k, v, bias, dropout_p) if applies(q, bias) else None
