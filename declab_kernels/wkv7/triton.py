"""WKV-7 Triton kernels: the one-token decode step and the two-pass chunked prefill.

- `_step_kernel`: one token, state `[B, H, K, V]` float32 updated in place. A program owns one
  (batch, head, V-block): the columns S[:, vblock] are independent, since both a^T S and the
  update act column by column. No allocation when `out` is given, no host sync: CUDA-graph safe.
  The only kernel here with a `PDL` constexpr (`declab_kernels.pdl`, launched with launch_pdl):
  gdc_launch_dependents() and gdc_wait() before its first load; with `state_ready=True`
  (constexpr STATE_READY) the state block is loaded before the wait (see `wkv7_step_triton`).
- `_chunk_prep_kernel` (pass 1, parallel over every chunk of every head): everything in a chunk
  that does not depend on the state entering it. With X = (I - A_ab)^-1 it writes
  W = X (a * exp(gp)) and U = X A_ak v (so that u = a^T S_{t-1} = W S + U), R = scale * (r * exp(g)
  + A_rb W) and O = scale * (A_rk v + A_rb U) (so that o = R S + O), the decayed keys and b's
  k * exp(g_L - g), b * exp(g_L - g), and the chunk decay exp(g_L). All float32.
- `_chunk_pass_kernel` (pass 2, sequential over chunks): a program owns one (batch, head, V-block)
  of the state in registers and walks the chunks: u = W S + U, o = R S + O,
  S <- exp(g_L) S + Kd^T v + Bd^T u.
- `_chunk_local` is pass 1's body.

The sequence is processed in segments so that pass 1's buffers stay bounded at long contexts;
the state is carried from segment to segment in the final-state buffer. Offsets are 64-bit.
"""

import functools

import torch
import triton
import triton.language as tl

from declab_kernels import pdl
from declab_kernels.wkv7 import CHUNK

# Pass-1 buffers per segment are capped at this many float32 values (1 GiB).
SEGMENT_FLOATS = 1 << 28
# tl.dot's input precision for the float32 products inside a chunk: one TF32 product, 3.5e-4
# relative error in the state after 1000 tokens (fla chunk_rwkv7: 1.3e-3), 1.6x the speed of
# float32-grade tf32x3 on an H200 (results/wkv7.jsonl).
PRECISION = "tf32"
# Launch shape, from sm_90 register reports: pass 1 needs 8 warps to stay in registers; pass 2
# runs 4 warps with its loads double-buffered.
PREP_WARPS, PASS_WARPS, PASS_STAGES = 8, 4, 2


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    if device_index is None:
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(t: torch.Tensor) -> int:
    return _num_sms(t.device.index if t.device.type == "cuda" else None)


@triton.jit
def _step_kernel(
    r, w, k, v, a, b, state, out,
    s_xb, s_xh, s_vb, s_vh, s_sb, s_sh, s_sk, s_ob, s_oh,
    H, K, V, scale,
    BK: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False, STATE_READY: tl.constexpr = False,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    i_v = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk = ck < K
    mv = cv < V
    # [BK, BV] block of the state (read from L2): with STATE_READY loaded before the wait
    s_ptr = state + i_b * s_sb + i_h * s_sh + ck[:, None].to(tl.int64) * s_sk + cv[None, :]
    m_s = mk[:, None] & mv[None, :]
    if PDL and not STATE_READY:
        tl.extra.cuda.gdc_wait()
    S = tl.load(s_ptr, mask=m_s, other=0.0, cache_modifier=".cg")
    if PDL and STATE_READY:
        tl.extra.cuda.gdc_wait()
    x_off = i_b * s_xb + i_h * s_xh + ck
    rr = tl.load(r + x_off, mask=mk, other=0.0).to(tl.float32)
    ww = tl.load(w + x_off, mask=mk, other=0.0).to(tl.float32)
    kk = tl.load(k + x_off, mask=mk, other=0.0).to(tl.float32)
    aa = tl.load(a + x_off, mask=mk, other=0.0).to(tl.float32)
    bb = tl.load(b + x_off, mask=mk, other=0.0).to(tl.float32)
    vv = tl.load(v + i_b * s_vb + i_h * s_vh + cv, mask=mv, other=0.0).to(tl.float32)
    # a^T S_{t-1}: [BV]
    sa = tl.sum(aa[:, None] * S, axis=0)
    S = tl.exp(ww)[:, None] * S + bb[:, None] * sa[None, :] + kk[:, None] * vv[None, :]
    tl.store(s_ptr, S, mask=m_s)
    o = tl.sum(rr[:, None] * S, axis=0) * scale
    tl.store(out + i_b * s_ob + i_h * s_oh + cv, o.to(out.dtype.element_ty), mask=mv)


def _step_block_v(V):
    """V-block of the step: 32 wide (or all of V when narrower).

    Measured on H200 at H=32, K=V=64 (µs per layer-step, widths 8/16/32/64): batch 1
    2.60/2.58/2.06/3.27, batch 16 9.42/6.95/6.87/10.0, batch 128 65.6/44.6/42.4/60.9; 32 wide
    (an 8 KiB block per program, 4 warps) is the fastest at every batch.
    """
    return min(32, triton.next_power_of_2(V))


def wkv7_step_triton(r, w, k, v, a, b, state, *, scale=1.0, out=None, block_v=None, num_warps=None,
                     state_ready=False):
    """One token: r, w, k, a, b `[B, H, K]` (same strides), v `[B, H, V]`, state `[B, H, K, V]`
    float32 updated in place. Returns o `[B, H, V]` (written into `out` when given). `block_v` and
    `num_warps` override the launch shape (defaults: `_step_block_v`, one warp per 512 values).

    `state_ready=True` promises that the state was last written before a kernel launched without
    PDL (in a decode step: by this layer's step in the previous step, which ended with PyTorch
    sampling kernels), so under PDL the state block is loaded before gdc_wait(), overlapping the
    kernels before it. Without that promise (the default) a state written by the kernel just
    before would be read stale."""
    B, H, K = r.shape
    V = v.shape[-1]
    for name, x in (("w", w), ("k", k), ("a", a), ("b", b)):
        if x.shape != r.shape or x.stride() != r.stride():
            raise ValueError(f"wkv7_step: {name} must have r's shape and strides, got {tuple(x.shape)} {x.stride()}")
    if state.dtype != torch.float32 or state.shape != (B, H, K, V) or state.stride(-1) != 1:
        raise ValueError(f"wkv7_step: state must be float32 [B, H, K, V] with unit last stride, got {state.dtype} {tuple(state.shape)}")
    if r.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("wkv7_step: inputs need a unit last stride")
    if out is None:
        out = torch.empty(B, H, V, dtype=r.dtype, device=r.device)
    elif out.shape != (B, H, V) or out.stride(-1) != 1:
        raise ValueError(f"wkv7_step: out must be [B, H, V] with unit last stride, got {tuple(out.shape)}")
    BK = triton.next_power_of_2(K)
    BV = block_v or _step_block_v(V)
    grid = (triton.cdiv(V, BV), H, B)
    use_pdl = pdl(r.device, __name__)
    _step_kernel[grid](
        r, w, k, v, a, b, state, out,
        r.stride(0), r.stride(1), v.stride(0), v.stride(1),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        H, K, V, scale,
        BK=BK, BV=BV, PDL=use_pdl, STATE_READY=bool(state_ready), num_warps=num_warps or max(1, min(8, BK * BV // 512)), launch_pdl=use_pdl,
    )
    return out


@triton.jit
def _chunk_local(
    r, w, k, v, a, b, i_n, i_bh, t0, T, H, K, V, scale,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, PREC: tl.constexpr,
):
    """Steps 1-5 of chunk i_n of (batch, head) i_bh without the state: returns W, U, R, O, Kd, Bd
    ([C, BK] / [C, BVF]), v ([C, BVF]) and g_L ([BK])."""
    # inputs [B, T, H, K] / [B, T, H, V] contiguous
    i_b = i_bh // H
    i_h = i_bh % H
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BVF)
    t = t0 + i_n * C + rows
    m_t = t < T
    m_k = m_t[:, None] & (ck < K)[None, :]
    m_v = m_t[:, None] & (cv < V)[None, :]
    tok = (i_b * T + t) * H + i_h
    off_k = tok[:, None] * K + ck[None, :]
    rr = tl.load(r + off_k, mask=m_k, other=0.0).to(tl.float32)
    ww = tl.load(w + off_k, mask=m_k, other=0.0).to(tl.float32)
    kk = tl.load(k + off_k, mask=m_k, other=0.0).to(tl.float32)
    aa = tl.load(a + off_k, mask=m_k, other=0.0).to(tl.float32)
    bb = tl.load(b + off_k, mask=m_k, other=0.0).to(tl.float32)
    vv = tl.load(v + tok[:, None] * V + cv[None, :], mask=m_v, other=0.0).to(tl.float32)

    # 1. cumulative log-decay; rows past T have w = 0, so the last row holds g_L
    g = tl.cumsum(ww, axis=0)
    gp = g - ww
    g_last = tl.sum(tl.where((rows == C - 1)[:, None], g, 0.0), axis=0)
    # why: exp(g_t - g_s) is split as exp(g_t - g_mid) * exp(g_mid - g_s) so that it becomes a
    # matrix product; the midpoint keeps both factors within exp(C/2 * max|w|)
    g_mid = tl.sum(tl.where((rows == C // 2)[:, None], g, 0.0), axis=0)
    a_up = aa * tl.exp(gp - g_mid[None, :])
    r_up = rr * tl.exp(g - g_mid[None, :])
    k_dn = kk * tl.exp(g_mid[None, :] - g)
    b_dn = bb * tl.exp(g_mid[None, :] - g)

    # 2. pairwise decayed products [C, C]
    strict = rows[:, None] > rows[None, :]
    incl = rows[:, None] >= rows[None, :]
    A_ak = tl.where(strict, tl.dot(a_up, tl.trans(k_dn), input_precision=PREC), 0.0)
    A_ab = tl.where(strict, tl.dot(a_up, tl.trans(b_dn), input_precision=PREC), 0.0)
    A_rk = tl.where(incl, tl.dot(r_up, tl.trans(k_dn), input_precision=PREC), 0.0)
    A_rb = tl.where(incl, tl.dot(r_up, tl.trans(b_dn), input_precision=PREC), 0.0)

    # 3. X = (I - A_ab)^-1
    # why: A_ab is strictly lower triangular (A_ab^C = 0), so (I - A_ab)^-1 =
    # (I + A)(I + A^2)(I + A^4)...(I + A^(C/2)): 2 log2(C) - 1 tensor-core products instead of
    # C dependent row updates, each with cross-warp reductions
    X = A_ab + tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    P = A_ab
    for j in tl.static_range(1, 8):
        if (1 << j) < C:
            P = tl.dot(P, P, input_precision=PREC)
            X = X + tl.dot(X, P, input_precision=PREC)

    # u = W S + U
    Wm = tl.dot(X, aa * tl.exp(gp), input_precision=PREC)
    U = tl.dot(X, tl.dot(A_ak, vv, input_precision=PREC), input_precision=PREC)
    # 4. o = R S + O
    R = scale * (rr * tl.exp(g) + tl.dot(A_rb, Wm, input_precision=PREC))
    O = scale * (tl.dot(A_rk, vv, input_precision=PREC) + tl.dot(A_rb, U, input_precision=PREC))
    # 5. decayed keys and b's for the state update
    Kd = kk * tl.exp(g_last[None, :] - g)
    Bd = bb * tl.exp(g_last[None, :] - g)
    return Wm, U, R, O, Kd, Bd, vv, g_last


@triton.jit
def _chunk_prep_kernel(
    r, w, k, v, a, b,
    Wb, Ub, Rb, Ob, Kb, Bb, Gb,
    t0, T, NC, H, K, V, scale,
    C: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, PREC: tl.constexpr,
):
    # outputs [B*H, NC, C, *] (Kb, Bb [B*H, NC, K, C]) and Gb [B*H, NC, K]
    i_n = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    Wm, U, R, O, Kd, Bd, vv, g_last = _chunk_local(
        r, w, k, v, a, b, i_n, i_bh, t0, T, H, K, V, scale, C=C, BK=BK, BVF=BVF, PREC=PREC)
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BVF)
    row = (i_bh * NC + i_n) * C + rows
    m_kc = (ck < K)[None, :]
    m_vc = (cv < V)[None, :]
    o_k = row[:, None] * K + ck[None, :]
    o_v = row[:, None] * V + cv[None, :]
    tl.store(Wb + o_k, Wm, mask=m_kc)
    tl.store(Rb + o_k, R, mask=m_kc)
    # why: Kd and Bd are stored transposed, [K, C] per chunk, so that pass 2 reads them contiguously
    o_kT = (i_bh * NC + i_n) * C * K + ck[None, :] * C + rows[:, None]
    tl.store(Kb + o_kT, Kd, mask=m_kc)
    tl.store(Bb + o_kT, Bd, mask=m_kc)
    tl.store(Ub + o_v, U, mask=m_vc)
    tl.store(Ob + o_v, O, mask=m_vc)
    tl.store(Gb + (i_bh * NC + i_n) * K + ck, tl.exp(g_last), mask=ck < K)


@triton.jit
def _chunk_pass_kernel(
    v, o, h0, ht,
    Wb, Ub, Rb, Ob, Kb, Bb, Gb,
    t0, T, NC, H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, PREC: tl.constexpr,
):
    # v, o [B, T, H, V] contiguous; h0, ht [B, H, K, V] contiguous float32
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    rows = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k = ck < K
    m_v = cv < V
    m_s = m_k[:, None] & m_v[None, :]
    s_off = i_bh * K * V + ck[:, None].to(tl.int64) * V + cv[None, :]
    if HAS_H0:
        S = tl.load(h0 + s_off, mask=m_s, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    for n in range(NC):
        c = i_bh * NC + n
        row = c * C + rows
        o_k = row[:, None] * K + ck[None, :]
        # [BK, C]: the decayed keys and b's, stored transposed
        o_kT = c * C * K + ck[:, None] * C + rows[None, :]
        o_v = row[:, None] * V + cv[None, :]
        Wm = tl.load(Wb + o_k, mask=m_k[None, :], other=0.0)
        R = tl.load(Rb + o_k, mask=m_k[None, :], other=0.0)
        KdT = tl.load(Kb + o_kT, mask=m_k[:, None], other=0.0)
        BdT = tl.load(Bb + o_kT, mask=m_k[:, None], other=0.0)
        U = tl.load(Ub + o_v, mask=m_v[None, :], other=0.0)
        O = tl.load(Ob + o_v, mask=m_v[None, :], other=0.0)
        gl = tl.load(Gb + c * K + ck, mask=m_k, other=0.0)
        t = t0 + n * C + rows
        m_t = t < T
        tok = (i_b * T + t) * H + i_h
        m_tv = m_t[:, None] & m_v[None, :]
        vv = tl.load(v + tok[:, None] * V + cv[None, :], mask=m_tv, other=0.0).to(tl.float32)
        u = tl.dot(Wm, S, input_precision=PREC) + U
        out = tl.dot(R, S, input_precision=PREC) + O
        tl.store(o + tok[:, None] * V + cv[None, :], out.to(o.dtype.element_ty), mask=m_tv)
        S = gl[:, None] * S + tl.dot(KdT, vv, input_precision=PREC) + tl.dot(BdT, u, input_precision=PREC)
    tl.store(ht + s_off, S, mask=m_s)


def _chunk_block_v(B, H, V, n_sm):
    """Widest V-block (16..64, tl.dot needs >= 16) that still gives a program per SM."""
    bv = min(64, max(16, triton.next_power_of_2(V)))
    while bv > 16 and B * H * triton.cdiv(V, bv) < n_sm:
        bv //= 2
    return bv


def wkv7_chunk_triton(
    r, w, k, v, a, b, *, scale=1.0, initial_state=None, chunk_size=CHUNK,
    out=None, final_state=None, block_v=None, segment_floats=SEGMENT_FLOATS,
):
    """Chunked prefill. r, w, k, a, b `[B, T, H, K]`, v `[B, T, H, V]`, initial_state
    `[B, H, K, V]` float32 or None. Returns (o `[B, T, H, V]` in r's dtype, final state float32),
    written into `out` / `final_state` when given.

    The products inside a chunk run in TF32 (`PRECISION`). Stable while chunk_size / 2 * max|w|
    stays below ~80 (float32 exp range); RWKV-7 has |w| <= 0.61.
    `block_v` and `segment_floats` override the launch shape (defaults: `_chunk_block_v`,
    `SEGMENT_FLOATS`); the benchmark sweeps them.
    """
    B, T, H, K = r.shape
    V = v.shape[-1]
    C = chunk_size
    if C < 16 or C & (C - 1):
        raise ValueError(f"wkv7_chunk: chunk_size must be a power of two >= 16, got {C}")
    for name, x in (("w", w), ("k", k), ("a", a), ("b", b)):
        if x.shape != r.shape:
            raise ValueError(f"wkv7_chunk: {name} must have r's shape {tuple(r.shape)}, got {tuple(x.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"wkv7_chunk: v must be [B, T, H, V], got {tuple(v.shape)}")
    r, w, k, v, a, b = (x.contiguous() for x in (r, w, k, v, a, b))
    if out is None:
        out = torch.empty(B, T, H, V, dtype=r.dtype, device=r.device)
    if final_state is None:
        final_state = torch.empty(B, H, K, V, dtype=torch.float32, device=r.device)
    h0 = None
    if initial_state is not None:
        if initial_state.shape != (B, H, K, V) or initial_state.dtype != torch.float32:
            raise ValueError(f"wkv7_chunk: initial_state must be float32 [B, H, K, V], got {initial_state.dtype} {tuple(initial_state.shape)}")
        h0 = initial_state.contiguous()
    if T == 0:
        final_state.copy_(h0 if h0 is not None else torch.zeros_like(final_state))
        return out, final_state

    BK = max(16, triton.next_power_of_2(K))
    BVF = max(16, triton.next_power_of_2(V))
    BV = block_v or _chunk_block_v(B, H, V, _sms(r))
    f32 = dict(dtype=torch.float32, device=r.device)
    per_chunk = B * H * (C * (4 * K + 2 * V) + K)
    NC = max(1, min(triton.cdiv(T, C), segment_floats // per_chunk))
    Wb, Rb = (torch.empty(B * H, NC, C, K, **f32) for _ in range(2))
    Kb, Bb = (torch.empty(B * H, NC, K, C, **f32) for _ in range(2))
    Ub, Ob = (torch.empty(B * H, NC, C, V, **f32) for _ in range(2))
    Gb = torch.empty(B * H, NC, K, **f32)
    bufs = (Wb, Ub, Rb, Ob, Kb, Bb, Gb)
    for t0 in range(0, T, NC * C):
        nc = min(NC, triton.cdiv(T - t0, C))
        # why: the final-state buffer carries the state between segments; each program of pass 2
        # reads its own block before writing it, so reading and writing the same buffer is safe
        s_in = h0 if h0 is not None else final_state
        _chunk_prep_kernel[(nc, B * H)](
            r, w, k, v, a, b, *bufs, t0, T, nc, H, K, V, scale,
            C=C, BK=BK, BVF=BVF, PREC=PRECISION, num_warps=PREP_WARPS,
        )
        _chunk_pass_kernel[(triton.cdiv(V, BV), B * H)](
            v, out, s_in, final_state, *bufs, t0, T, nc, H, K, V,
            C=C, BK=BK, BV=BV, HAS_H0=h0 is not None, PREC=PRECISION, num_warps=PASS_WARPS, num_stages=PASS_STAGES,
        )
        h0 = final_state
    return out, final_state
