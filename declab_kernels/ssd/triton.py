"""Triton kernels for the Mamba-2 (SSD) ops; same signatures and semantics as ref.py.

Chunked scan, four kernels (the split of mamba-ssm, with C @ B^T recomputed per head instead of
stored, so there is no `[B, nc, G, L, L]` buffer):
1. `_chunk_cumsum_kernel`: dt -> dt + bias, softplus, clamp; dA_cs = cumsum(dt * A) within each chunk.
2. `_chunk_state_kernel`: each chunk's contribution to the state, x^T @ (decay * dt * B) via tl.dot.
3. `_state_passing_kernel`: the state entering each chunk, a sequential pass over chunks.
4. `_chunk_scan_kernel`: y = exp(dA_cs) C @ state_in + causal (C B^T * decay * dt) @ x, then D and gate.

`_causal_conv1d_kernel`: depthwise causal conv over `[B, T, C]` with a carried window.
`_decode_step_kernel`: one fused token step (conv over the ring window + SiLU + SSM update + output).
It alone takes a `PDL` constexpr (`declab_kernels.pdl`, launched with launch_pdl at every batch size):
gdc_launch_dependents() and gdc_wait() before its first load, so the states and rings are touched
only after the previous kernel has finished; with `state_ready=True` (constexpr STATE_READY) the SSM
state tile, the positions, the conv rings, the conv weights and the per-head constants are loaded
before the wait (see `mamba2_decode_step`).
With `norm=` (constexpr HAS_NORM) it also writes each head's sum of squares of the gated output and
multiplies that output by the norm weight, so the RMSNorm after it needs no kernel of its own
(`declab_kernels.gemv.fusions.RMSScale`).

Base offsets are int64 (a 512k-token prompt times H*P overflows int32); in-tile offsets stay int32.
"""

import os

import torch
import triton
import triton.language as tl

from declab_kernels import pdl
from declab_kernels.ssd.ref import DEFAULT_DT_LIMIT, check_decode_conv, check_decode_norm

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _configs(configs):
    """Autotune candidates; the interpreter cannot autotune over several, so it gets the first."""
    return configs[:1] if INTERPRET else configs


def _dot_precision(dtype):
    """fp32 inputs use exact fp32 products (tests compare at fp32 tolerance); bf16/fp16 are native."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _softplus(x):
    # log1p(exp(x)) without log1p: log(w) * u / (w - 1) keeps the digits that 1 + u rounds away.
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    lp = tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _chunk_cumsum_kernel(
    dt_ptr, A_ptr, bias_ptr, dt_out_ptr, cs_ptr,
    T, nc, s_db, s_dt, s_dh, lim_lo, lim_hi,
    H: tl.constexpr, L: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
):
    pid_bc = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = pid_bc // nc
    c = pid_bc % nc
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, L)
    mask = (offs_h[:, None] < H) & (offs_l[None, :] < T - c * L)
    # [BLOCK_H, L]
    dt_base = dt_ptr + b.to(tl.int64) * s_db + c.to(tl.int64) * L * s_dt
    dt = tl.load(dt_base + offs_h[:, None] * s_dh + offs_l[None, :] * s_dt, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + offs_h, mask=offs_h < H, other=0.0).to(tl.float32)[:, None]
    if SOFTPLUS:
        dt = _softplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, lim_lo), lim_hi)
    # Tokens past T get dt = 0: no decay and no input, so the chunk's last dA_cs is the true total.
    dt = tl.where(mask, dt, 0.0)
    A = tl.load(A_ptr + offs_h, mask=offs_h < H, other=0.0).to(tl.float32)
    cs = tl.cumsum(dt * A[:, None], axis=1)
    # [B, H, nc, L]
    out = ((b.to(tl.int64) * H + offs_h[:, None]) * nc + c) * L + offs_l[None, :]
    hmask = offs_h[:, None] < H
    tl.store(dt_out_ptr + out, dt, mask=hmask)
    tl.store(cs_ptr + out, cs, mask=hmask)


@triton.autotune(
    configs=_configs([
        triton.Config({"BLOCK_P": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_P": 64}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_P": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_P": 32}, num_warps=4, num_stages=3),
    ]),
    key=["P", "N", "L", "BLOCK_N"],
)
@triton.jit
def _chunk_state_kernel(
    x_ptr, B_ptr, dt_ptr, cs_ptr, st_ptr,
    T, nc,
    s_xb, s_xt, s_xh, s_xp,
    s_Bb, s_Bt, s_Bg, s_Bn,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, L: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_bch = tl.program_id(0)
    pid_pn = tl.program_id(1)
    h = pid_bch % H
    c = (pid_bch // H) % nc
    b = pid_bch // (H * nc)
    g = h // (H // G)
    n_nblk = tl.cdiv(N, BLOCK_N)
    offs_p = (pid_pn // n_nblk) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = (pid_pn % n_nblk) * BLOCK_N + tl.arange(0, BLOCK_N)
    chunk_len = tl.minimum(L, T - c * L)
    b64 = b.to(tl.int64)
    t0 = c.to(tl.int64) * L
    x_base = x_ptr + b64 * s_xb + t0 * s_xt + h * s_xh
    B_base = B_ptr + b64 * s_Bb + t0 * s_Bt + g * s_Bg
    dcs = ((b64 * H + h) * nc + c) * L
    cs_last = tl.load(cs_ptr + dcs + L - 1)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for l0 in range(0, chunk_len, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        l_mask = offs_l < chunk_len
        # [BLOCK_P, BLOCK_L]
        xT = tl.load(x_base + offs_p[:, None] * s_xp + offs_l[None, :] * s_xt,
                     mask=(offs_p[:, None] < P) & l_mask[None, :], other=0.0)
        # [BLOCK_L, BLOCK_N]
        Bl = tl.load(B_base + offs_l[:, None] * s_Bt + offs_n[None, :] * s_Bn,
                     mask=l_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        scale = tl.exp(cs_last - tl.load(cs_ptr + dcs + offs_l)) * tl.load(dt_ptr + dcs + offs_l)
        acc += tl.dot(xT, (Bl * scale[:, None]).to(xT.dtype), input_precision=DOT_PREC)
    # [B, nc, H, P, N]
    st = st_ptr + ((b64 * nc + c) * H + h) * (P * N)
    tl.store(st + offs_p[:, None] * N + offs_n[None, :], acc, mask=(offs_p[:, None] < P) & (offs_n[None, :] < N))


@triton.jit
def _state_passing_kernel(
    st_ptr, out_ptr, final_ptr, init_ptr, cs_ptr, nc,
    H: tl.constexpr, PN: tl.constexpr, L: tl.constexpr, BLOCK: tl.constexpr, HAS_INIT: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PN
    b64 = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    if HAS_INIT:
        s = tl.load(init_ptr + pid_bh.to(tl.int64) * PN + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BLOCK,), dtype=tl.float32)
    # [B, nc, H, PN]: chunk c of (b, h) sits at ((b * nc + c) * H + h) * PN; step H * PN per chunk.
    st = st_ptr + (b64 * nc * H + h) * PN + offs
    out = out_ptr + (b64 * nc * H + h) * PN + offs
    cs = cs_ptr + pid_bh.to(tl.int64) * nc * L + L - 1
    for _ in range(nc):
        tl.store(out, s.to(out_ptr.dtype.element_ty), mask=mask)
        s = tl.exp(tl.load(cs)) * s + tl.load(st, mask=mask, other=0.0)
        st += H * PN
        out += H * PN
        cs += L
    tl.store(final_ptr + pid_bh.to(tl.int64) * PN + offs, s, mask=mask)


@triton.autotune(
    configs=_configs([
        triton.Config({"BLOCK_P": 64}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_P": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_P": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_P": 32}, num_warps=4, num_stages=2),
    ]),
    key=["P", "N", "L", "BLOCK_N", "HAS_Z", "HAS_D"],
)
@triton.jit
def _chunk_scan_kernel(
    y_ptr, x_ptr, z_ptr, D_ptr, B_ptr, C_ptr, dt_ptr, cs_ptr, st_ptr,
    T, nc,
    s_xb, s_xt, s_xh, s_xp,
    s_zb, s_zt, s_zh, s_zp,
    s_yb, s_yt, s_yh, s_yp,
    s_Bb, s_Bt, s_Bg, s_Bn,
    s_Cb, s_Ct, s_Cg, s_Cn,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, L: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_bch = tl.program_id(0)
    pid_mp = tl.program_id(1)
    h = pid_bch % H
    c = (pid_bch // H) % nc
    b = pid_bch // (H * nc)
    g = h // (H // G)
    n_pblk = tl.cdiv(P, BLOCK_P)
    pid_m = pid_mp // n_pblk
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = (pid_mp % n_pblk) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    chunk_len = tl.minimum(L, T - c * L)
    m_mask = offs_m < chunk_len
    p_mask = offs_p < P
    n_mask = offs_n < N
    b64 = b.to(tl.int64)
    t0 = c.to(tl.int64) * L
    x_base = x_ptr + b64 * s_xb + t0 * s_xt + h * s_xh
    B_base = B_ptr + b64 * s_Bb + t0 * s_Bt + g * s_Bg
    C_base = C_ptr + b64 * s_Cb + t0 * s_Ct + g * s_Cg
    dcs = ((b64 * H + h) * nc + c) * L
    cs_m = tl.load(cs_ptr + dcs + offs_m)

    # State to output: exp(dA_cs_m) * C_m @ state_in^T. [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_P]
    Cm = tl.load(C_base + offs_m[:, None] * s_Ct + offs_n[None, :] * s_Cn,
                 mask=m_mask[:, None] & n_mask[None, :], other=0.0)
    st = st_ptr + ((b64 * nc + c) * H + h) * (P * N)
    stT = tl.load(st + offs_n[:, None] + offs_p[None, :] * N, mask=n_mask[:, None] & p_mask[None, :], other=0.0)
    acc = tl.dot(Cm, stT, input_precision=DOT_PREC) * tl.exp(cs_m)[:, None]

    # Intra-chunk causal part: only key blocks at or before this row block.
    hi = tl.minimum((pid_m + 1) * BLOCK_M, chunk_len)
    for k0 in range(0, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < chunk_len
        BT = tl.load(B_base + offs_n[:, None] * s_Bn + offs_k[None, :] * s_Bt,
                     mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        cb = tl.dot(Cm, BT, input_precision=DOT_PREC)
        cs_k = tl.load(cs_ptr + dcs + offs_k)
        dt_k = tl.load(dt_ptr + dcs + offs_k)
        # exp(-inf) = 0 above the diagonal, without ever forming exp of a positive difference.
        causal = offs_m[:, None] >= offs_k[None, :]
        cb = cb * tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf"))) * dt_k[None, :]
        xk = tl.load(x_base + offs_k[:, None] * s_xt + offs_p[None, :] * s_xp,
                     mask=k_mask[:, None] & p_mask[None, :], other=0.0)
        acc += tl.dot(cb.to(xk.dtype), xk, input_precision=DOT_PREC)

    mp_mask = m_mask[:, None] & p_mask[None, :]
    if HAS_D:
        xm = tl.load(x_base + offs_m[:, None] * s_xt + offs_p[None, :] * s_xp, mask=mp_mask, other=0.0).to(tl.float32)
        acc += tl.load(D_ptr + h).to(tl.float32) * xm
    if HAS_Z:
        z_base = z_ptr + b64 * s_zb + t0 * s_zt + h * s_zh
        zm = tl.load(z_base + offs_m[:, None] * s_zt + offs_p[None, :] * s_zp, mask=mp_mask, other=0.0).to(tl.float32)
        acc = acc * zm * tl.sigmoid(zm)
    y_base = y_ptr + b64 * s_yb + t0 * s_yt + h * s_yh
    tl.store(y_base + offs_m[:, None] * s_yt + offs_p[None, :] * s_yp, acc.to(y_ptr.dtype.element_ty), mask=mp_mask)


def _check_scan_inputs(x, dt, A, B, C, chunk_size):
    Bsz, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    if dt.shape != (Bsz, T, H) or B.shape != (Bsz, T, G, N) or C.shape != B.shape or A.shape != (H,):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)} dt {tuple(dt.shape)} A {tuple(A.shape)} "
                         f"B {tuple(B.shape)} C {tuple(C.shape)}")
    if H % G:
        raise ValueError(f"heads {H} not a multiple of groups {G}")
    if not (x.dtype == B.dtype == C.dtype):
        raise ValueError(f"x, B, C must share a dtype, got {x.dtype}, {B.dtype}, {C.dtype}")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    if T < 1:
        raise ValueError("empty sequence")


def ssd_chunk_scan(x, dt, A, B, C, *, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=DEFAULT_DT_LIMIT, initial_state=None):
    """Chunked SSD scan (see ref.ssd_chunk_scan). Returns y `[B, T, H, P]` and final state `[B, H, P, N]` fp32."""
    _check_scan_inputs(x, dt, A, B, C, chunk_size)
    Bsz, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    L = chunk_size
    nc = triton.cdiv(T, L)
    dev = x.device
    f32 = torch.float32
    has_limit = tuple(dt_limit) != DEFAULT_DT_LIMIT

    dt_out = torch.empty(Bsz, H, nc, L, device=dev, dtype=f32)
    dA_cs = torch.empty(Bsz, H, nc, L, device=dev, dtype=f32)
    block_h = min(8, triton.next_power_of_2(H))
    _chunk_cumsum_kernel[(Bsz * nc, triton.cdiv(H, block_h))](
        dt, A, dt_bias if dt_bias is not None else A, dt_out, dA_cs,
        T, nc, dt.stride(0), dt.stride(1), dt.stride(2), float(dt_limit[0]), float(dt_limit[1]) if has_limit else 0.0,
        H=H, L=L, BLOCK_H=block_h, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit,
    )

    block_n = max(16, triton.next_power_of_2(N))
    prec = _dot_precision(x.dtype)
    # [B, nc, H, P, N] fp32: what each chunk adds to the state.
    states = torch.empty(Bsz, nc, H, P, N, device=dev, dtype=f32)
    _chunk_state_kernel[lambda meta: (Bsz * nc * H, triton.cdiv(P, meta["BLOCK_P"]) * triton.cdiv(N, block_n))](
        x, B, dt_out, dA_cs, states, T, nc,
        *x.stride(), *B.stride(),
        H=H, P=P, N=N, G=G, L=L, BLOCK_N=block_n, BLOCK_L=min(64, L), DOT_PREC=prec,
    )

    # [B, nc, H, P, N] in C's dtype (the tl.dot operand of the output kernel), and the final state fp32.
    entering = torch.empty(Bsz, nc, H, P, N, device=dev, dtype=C.dtype)
    final = torch.empty(Bsz, H, P, N, device=dev, dtype=f32)
    init = initial_state.to(f32).contiguous() if initial_state is not None else final
    block = min(512, triton.next_power_of_2(P * N))
    _state_passing_kernel[(Bsz * H, triton.cdiv(P * N, block))](
        states, entering, final, init, dA_cs, nc,
        H=H, PN=P * N, L=L, BLOCK=block, HAS_INIT=initial_state is not None, num_warps=4,
    )

    y = torch.empty(Bsz, T, H, P, device=dev, dtype=x.dtype)
    zz = z if z is not None else x
    block_m = min(64, L)
    _chunk_scan_kernel[lambda meta: (Bsz * nc * H, (L // block_m) * triton.cdiv(P, meta["BLOCK_P"]))](
        y, x, zz, D if D is not None else A, B, C, dt_out, dA_cs, entering, T, nc,
        *x.stride(), *zz.stride(), *y.stride(), *B.stride(), *C.stride(),
        H=H, P=P, N=N, G=G, L=L, HAS_D=D is not None, HAS_Z=z is not None,
        BLOCK_M=block_m, BLOCK_K=block_m, BLOCK_N=block_n, DOT_PREC=prec,
    )
    return y, final


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, bias_ptr, init_ptr, y_ptr, fin_ptr,
    T, Cdim,
    s_xb, s_xt, s_xc, s_wc, s_wk, s_ib, s_ic, s_ik, s_yb, s_yt, s_yc, s_fb, s_fc, s_fk,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    b64 = tl.program_id(2).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < Cdim
    x_row = x_ptr + b64 * s_xb
    i_row = init_ptr + b64 * s_ib
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(W):
        # Input position t - (W-1) + k; negative positions come from the carried window.
        pos = offs_t - (W - 1) + k
        xv = tl.load(x_row + pos.to(tl.int64)[:, None] * s_xt + offs_c[None, :] * s_xc,
                     mask=((pos >= 0) & (pos < T))[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        if HAS_INIT:
            xv += tl.load(i_row + offs_c[None, :] * s_ic + (pos + W - 1)[:, None] * s_ik,
                          mask=((pos < 0) & (offs_t < T))[:, None] & c_mask[None, :], other=0.0).to(tl.float32)
        wk = tl.load(w_ptr + offs_c * s_wc + k * s_wk, mask=c_mask, other=0.0).to(tl.float32)
        acc += xv * wk[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    y_row = y_ptr + b64 * s_yb
    tl.store(y_row + offs_t.to(tl.int64)[:, None] * s_yt + offs_c[None, :] * s_yc, acc.to(y_ptr.dtype.element_ty),
             mask=(offs_t < T)[:, None] & c_mask[None, :])
    # The last W-1 inputs (from the carried window when T < W-1), written once per channel block.
    if pid_t == 0:
        offs_j = tl.arange(0, BLOCK_W)
        tail = T - (W - 1) + offs_j
        j_mask = offs_j < W - 1
        fv = tl.load(x_row + tail.to(tl.int64)[None, :] * s_xt + offs_c[:, None] * s_xc,
                     mask=((tail >= 0) & j_mask)[None, :] & c_mask[:, None], other=0.0).to(tl.float32)
        if HAS_INIT:
            fv += tl.load(i_row + offs_c[:, None] * s_ic + (tail + W - 1)[None, :] * s_ik,
                          mask=((tail < 0) & j_mask)[None, :] & c_mask[:, None], other=0.0).to(tl.float32)
        tl.store(fin_ptr + b64 * s_fb + offs_c[:, None] * s_fc + offs_j[None, :] * s_fk,
                 fv.to(fin_ptr.dtype.element_ty), mask=j_mask[None, :] & c_mask[:, None])


def causal_conv1d(x, weight, bias=None, *, initial_state=None, activation="silu"):
    """Depthwise causal conv (see ref.causal_conv1d). Returns y `[B, T, C]` and the last W-1 inputs `[B, C, W-1]`."""
    if activation not in ("silu", None):
        raise ValueError(f"unknown activation {activation!r}: expected 'silu' or None")
    Bsz, T, Cdim = x.shape
    W = weight.shape[1]
    if weight.shape != (Cdim, W) or W < 2 or (initial_state is not None and initial_state.shape != (Bsz, Cdim, W - 1)):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)} weight {tuple(weight.shape)} "
                         f"initial_state {None if initial_state is None else tuple(initial_state.shape)}")
    y = torch.empty(Bsz, T, Cdim, device=x.device, dtype=x.dtype)
    final = torch.empty(Bsz, Cdim, W - 1, device=x.device, dtype=x.dtype)
    init = initial_state if initial_state is not None else final
    block_t, block_c = 64, 128
    _causal_conv1d_kernel[(triton.cdiv(T, block_t), triton.cdiv(Cdim, block_c), Bsz)](
        x, weight, bias if bias is not None else weight, init, y, final, T, Cdim,
        *x.stride(), *weight.stride(), *init.stride(), *y.stride(), *final.stride(),
        W=W, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(W),
        HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None, SILU=activation == "silu", num_warps=4,
    )
    return y, final


@triton.jit
def _conv_window(cst_row, w_ptr, cb_ptr, ch, ch_mask, s_cc, s_ck, s_wc, s_wk,
                 W: tl.constexpr, BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Loads of channels `ch` that do not depend on this token: their ring of W slots `[BLOCK_CH,
    BLOCK_W]`, the conv weights and the bias."""
    offs_w = tl.arange(0, BLOCK_W)[None, :]
    wmask = ch_mask[:, None] & (offs_w < W)
    ring = tl.load(cst_row + ch[:, None] * s_cc + offs_w * s_ck, mask=wmask, other=0.0)
    w = tl.load(w_ptr + ch[:, None] * s_wc + offs_w * s_wk, mask=wmask, other=0.0)
    if HAS_BIAS:
        cb = tl.load(cb_ptr + ch, mask=ch_mask, other=0.0)
    else:
        cb = tl.zeros_like(ch).to(w.dtype)
    return ring, w, cb


@triton.jit
def _conv_token(ring, w, cb, new, slot_t, W: tl.constexpr, BLOCK_W: tl.constexpr):
    """One token's conv + SiLU `[BLOCK_CH]` from `_conv_window`'s loads and the token's inputs `new`
    `[BLOCK_CH]`, and the ring tile with them in slot `slot_t` (this position's), in the layout of
    the ring's load, so its store needs no other copy of the inputs."""
    offs_w = tl.arange(0, BLOCK_W)
    # Slot s holds tap (s - t - 1) mod W of the window (tap W - 1, slot t % W, is this token): the
    # weights are rolled to the slots in registers, so no load waits for the position.
    tap = (offs_w + (W - 1) - slot_t) % W
    w32 = w.to(tl.float32)
    w_rolled = tl.zeros_like(w32)
    for j in tl.static_range(W):
        # Sums over the W axis, which each thread holds whole: no exchange between threads.
        w_j = tl.sum(tl.where(offs_w[None, :] == j, w32, 0.0), axis=1)
        w_rolled += tl.where(tap[None, :] == j, w_j[:, None], 0.0)
    win = tl.where(offs_w[None, :] == slot_t, new[:, None], ring).to(tl.float32)
    acc = tl.sum(win * w_rolled, axis=1) + cb.to(tl.float32)
    return acc * tl.sigmoid(acc), win


@triton.jit
def _decode_step_kernel(
    xbc_ptr, dt_ptr, cst_ptr, w_ptr, cb_ptr, st_ptr, A_ptr, D_ptr, dtb_ptr, z_ptr, y_ptr, pos_ptr,
    s_xb, s_xc, s_db, s_dh, s_cb, s_cc, s_ck, s_wc, s_wk,
    s_sb, s_sh, s_sp, s_sn, s_zb, s_zh, s_zp, s_yb, s_yh, s_yp, s_pos,
    lim_lo, lim_hi,
    H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, W: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, HAS_LIMIT: tl.constexpr, PDL: tl.constexpr = False,
    STATE_READY: tl.constexpr = False,
    nw_ptr=None, ss_ptr=None, s_qb=0, s_qh=0, HAS_NORM: tl.constexpr = False,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_p = tl.program_id(2)
    g = h // (H // G)
    b64 = b.to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_mask = offs_p < P
    n_mask = offs_n < N
    xbc_row = xbc_ptr + b64 * s_xb
    cst_row = cst_ptr + b64 * s_cb
    offs_w = tl.arange(0, BLOCK_W)

    # 1. Every load first, the state tile [BLOCK_P, BLOCK_N] (most of the bytes) leading, so one memory
    #    round trip covers all of them. With STATE_READY the state tile, the position and the conv rings
    #    (last written by the previous step), the conv weights and the per-head constants are loaded
    #    before the wait, overlapping the kernel before; after it only the in-projection's outputs
    #    (this token's x/B/C inputs, dt, z), which it has just written to L2.
    st = st_ptr + b64 * s_sb + h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
    pn_mask = p_mask[:, None] & n_mask[None, :]
    if PDL and not STATE_READY:
        tl.extra.cuda.gdc_wait()
    s = tl.load(st, mask=pn_mask, other=0.0, cache_modifier=".cg")
    # The position, with the state: the previous step's last kernel wrote it, long enough ago for it
    # to have left L2, so after the wait it would be the one load of the token's round trip from HBM.
    slot_t = tl.load(pos_ptr + b64 * s_pos) % W
    # Conv + SiLU of this program's x channels and of its group's B and C channels.
    ch_x = h * P + offs_p
    ch_B = H * P + g * N + offs_n
    ch_C = H * P + G * N + g * N + offs_n
    x_ring, x_w, x_cb = _conv_window(cst_row, w_ptr, cb_ptr, ch_x, p_mask, s_cc, s_ck, s_wc, s_wk, W, BLOCK_W, HAS_BIAS)
    B_ring, B_w, B_cb = _conv_window(cst_row, w_ptr, cb_ptr, ch_B, n_mask, s_cc, s_ck, s_wc, s_wk, W, BLOCK_W, HAS_BIAS)
    C_ring, C_w, C_cb = _conv_window(cst_row, w_ptr, cb_ptr, ch_C, n_mask, s_cc, s_ck, s_wc, s_wk, W, BLOCK_W, HAS_BIAS)
    A = tl.load(A_ptr + h).to(tl.float32)
    Dh = tl.load(D_ptr + h).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    if HAS_NORM:
        # A weight: no kernel of the step writes it, so it is loaded with the state.
        nw = tl.load(nw_ptr + ch_x, mask=p_mask, other=0.0).to(tl.float32)
    if PDL and STATE_READY:
        tl.extra.cuda.gdc_wait()
    # All of this token's loads before any reduction, so they share one round trip.
    dt = tl.load(dt_ptr + b64 * s_db + h * s_dh).to(tl.float32) + dt_bias
    if HAS_Z:
        zv = tl.load(z_ptr + b64 * s_zb + h * s_zh + offs_p * s_zp, mask=p_mask, other=0.0).to(tl.float32)
    x_new = tl.load(xbc_row + ch_x * s_xc, mask=p_mask, other=0.0)
    B_new = tl.load(xbc_row + ch_B * s_xc, mask=n_mask, other=0.0)
    C_new = tl.load(xbc_row + ch_C * s_xc, mask=n_mask, other=0.0)
    x, x_win = _conv_token(x_ring, x_w, x_cb, x_new, slot_t, W, BLOCK_W)
    Bv, B_win = _conv_token(B_ring, B_w, B_cb, B_new, slot_t, W, BLOCK_W)
    Cv, C_win = _conv_token(C_ring, C_w, C_cb, C_new, slot_t, W, BLOCK_W)

    # 2. This token's inputs into its slot, the one holding the input W positions back, which no
    #    program's window includes: nothing another program reads this step is overwritten, so the
    #    programs need no ordering among them. The x channels belong to this program; the group's B
    #    and C are written by the group's first program.
    cdt = cst_ptr.dtype.element_ty
    slot = offs_w[None, :] == slot_t
    tl.store(cst_row + ch_x[:, None] * s_cc + offs_w[None, :] * s_ck, x_win.to(cdt), mask=p_mask[:, None] & slot)
    if (h % (H // G) == 0) & (pid_p == 0):
        tl.store(cst_row + ch_B[:, None] * s_cc + offs_w[None, :] * s_ck, B_win.to(cdt), mask=n_mask[:, None] & slot)
        tl.store(cst_row + ch_C[:, None] * s_cc + offs_w[None, :] * s_ck, C_win.to(cdt), mask=n_mask[:, None] & slot)

    # 3. state = exp(dt A) state + dt x B^T, in place.
    dt = _softplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, lim_lo), lim_hi)
    s = s * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
    tl.store(st, s, mask=pn_mask)

    # 4. y = state C + D x, gated by silu(z).
    y = tl.sum(s * Cv[None, :], axis=1) + Dh * x
    if HAS_Z:
        y = y * zv * tl.sigmoid(zv)
    if HAS_NORM:
        # The gated norm's statistics: this head's sum of g^2, g rounded as the unfused norm reads it,
        # and g * norm_weight; the 1 / rms of the whole row is applied by the GEMV after (ref.py).
        g = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(ss_ptr + b64 * s_qb + h * s_qh, tl.sum(tl.where(p_mask, g * g, 0.0), axis=0))
        y = g * nw
    tl.store(y_ptr + b64 * s_yb + h * s_yh + offs_p * s_yp, y.to(y_ptr.dtype.element_ty), mask=p_mask)


def decode_block_p(headdim):
    """Rows of P per program: the whole head, up to 64 rows. Measured on the H200 at the 1.3b shape
    (results/ssd.jsonl), 64 rows with 8 warps beat 8, 16 and 32 rows at every batch from 1 to 128
    (4.98 us per layer at batch 1; 75-78% of copy bandwidth at batch 64-128)."""
    return min(64, triton.next_power_of_2(headdim))


def mamba2_decode_step(xBC, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias, *, positions, ngroups,
                       headdim, dt_limit=DEFAULT_DT_LIMIT, z=None, out=None, block_p=None, state_ready=False, norm=None):
    """One fused token step (see ref.mamba2_decode_step); conv_state and ssm_state are updated in place.

    conv_state `[B, C, W]` is a ring (ref.mamba2_decode_step): the token at `positions` `[B]` reads the
    W-1 slots before it and writes its input into slot positions % W, so no program of the grid
    overwrites what another reads and the step needs no ordering among its programs.

    `state_ready=True` promises that ssm_state, conv_state and positions were last written before a
    kernel launched without PDL (in a decode step: the states by this layer's step in the previous
    step, the positions by its sampling, which ends with kernels launched without PDL), so under PDL
    the state tile, the position and the conv rings are loaded before gdc_wait(), overlapping the
    in-projection GEMV before it. Without that promise (the default) a value written by the kernel
    just before would be read stale.

    `norm=(norm_weight, sumsq)` (with z): as ref.mamba2_decode_step, one program a head (a `block_p`
    below the head's P is refused).

    Launches one kernel and allocates nothing when `out` is given. `block_p` overrides
    `decode_block_p` (the benchmark sweeps it).
    """
    Bsz, Cdim = xBC.shape
    H, P, G = dt.shape[1], headdim, ngroups
    N = ssm_state.shape[-1]
    W = conv_weight.shape[1]
    if ssm_state.shape != (Bsz, H, P, N) or Cdim != H * P + 2 * G * N or H % G:
        raise ValueError(f"shape mismatch: xBC {tuple(xBC.shape)} dt {tuple(dt.shape)} "
                         f"ssm_state {tuple(ssm_state.shape)} G={G} P={P}")
    check_decode_conv(xBC, conv_state, conv_weight, positions)
    if ssm_state.dtype != torch.float32:
        raise ValueError(f"ssm_state must be float32, got {ssm_state.dtype}")
    if out is None:
        out = torch.empty(Bsz, H, P, device=xBC.device, dtype=xBC.dtype)
    zz = z if z is not None else out
    has_limit = tuple(dt_limit) != DEFAULT_DT_LIMIT
    norm_args = {}
    if norm is not None:
        norm_weight, sumsq = check_decode_norm(norm, z, Bsz, H, P)
        if block_p is not None and block_p < P:
            raise ValueError(f"mamba2_decode_step: norm takes one program a head, block_p {block_p} < P {P}")
        block_p = triton.next_power_of_2(P)
        norm_args = dict(nw_ptr=norm_weight, ss_ptr=sumsq, s_qb=sumsq.stride(0), s_qh=sumsq.stride(1), HAS_NORM=True)
    block_p = block_p or decode_block_p(P)
    block_n = triton.next_power_of_2(N)
    use_pdl = pdl(xBC.device, __name__)
    _decode_step_kernel[(Bsz, H, triton.cdiv(P, block_p))](
        xBC, dt, conv_state, conv_weight, conv_bias if conv_bias is not None else conv_weight, ssm_state,
        A, D, dt_bias, zz, out, positions,
        *xBC.stride(), *dt.stride(), *conv_state.stride(), *conv_weight.stride(),
        *ssm_state.stride(), *zz.stride(), *out.stride(), positions.stride(0),
        float(dt_limit[0]), float(dt_limit[1]) if has_limit else 0.0,
        H=H, P=P, G=G, N=N, W=W, BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_W=triton.next_power_of_2(W),
        HAS_BIAS=conv_bias is not None, HAS_Z=z is not None, HAS_LIMIT=has_limit, PDL=use_pdl,
        STATE_READY=bool(state_ready), num_warps=4 if block_p * block_n <= 4096 else 8, launch_pdl=use_pdl,
        **norm_args,
    )
    return out
