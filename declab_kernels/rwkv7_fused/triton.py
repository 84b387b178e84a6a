"""Fused elementwise kernels of the RWKV-7 decode step (see ref.py for the math of each).

Every kernel reads and writes rows of `[B, C]` activations (channels contiguous, a row stride per
tensor) and computes in float32. None allocates inside a launch, none synchronises with the host:
a decode step built from them can be captured in a CUDA graph.

- `_add_norm_shift_kernel`, grid (B,): one program per row holds the whole row (LayerNorm needs it).
- `_lora_hidden_kernel`, grid (B,): writes the B rows of every LoRA block of the block-diagonal
  hidden matrix.
- `_time_mix_inputs_kernel` and `_gate_output_kernel`, grid (H, B): one program per head, since the
  key normalisation, the group norm and the r_k bonus reduce over a head.
- `_sqrelu_kernel`, grid (cdiv(n, BLOCK),).

PDL (constexpr of every kernel, see `declab_kernels.pdl`): gdc_launch_dependents() and gdc_wait() before
the first load of an activation; weights (norm weights and biases, mixes, k_k, k_a, r_k) are loaded
before the wait, and so is the token-shift row of `add_norm_shift` when its caller promises
`state_ready` (constexpr STATE_READY). Every kernel issues all its activation loads before its
first store or reduction, so the loads share one memory round trip (results/LOG.md, rwkv7_fused).
"""

import torch
import triton
import triton.language as tl

from declab_kernels import pdl
from declab_kernels.rwkv7_fused.ref import ACTS, W_SCALE

# why: a jitted kernel may only read globals that are constexpr
_W_SCALE = tl.constexpr(W_SCALE)


def _row_warps(n):
    """One warp per 256 values of a row, 1..8."""
    return max(1, min(8, triton.next_power_of_2(n) // 256))


def _check_rows(name, t, C):
    if t.dim() != 2 or t.shape[1] != C or t.stride(1) != 1:
        raise ValueError(f"rwkv7_fused: {name} must be [B, {C}] with unit last stride, got {tuple(t.shape)} {t.stride()}")


@triton.jit
def _add_norm_shift_kernel(
    x, delta, weight, bias, prev, mix, out,
    s_x, s_d, s_p, B, C, eps,
    M: tl.constexpr, M_PAD: tl.constexpr, BC: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SHIFT: tl.constexpr, PDL: tl.constexpr = False, STATE_READY: tl.constexpr = False,
):
    i_b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BC)
    m = c < C
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # The norm's weight and bias and the mixes are no kernel's output: under PDL they are fetched while
    # the previous kernel finishes.
    wv = tl.load(weight + c, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bv = tl.load(bias + c, mask=m, other=0.0).to(tl.float32)
    if HAS_SHIFT:
        j = tl.arange(0, M_PAD)[:, None]
        jm = (j < M) & m[None, :]
        # [M_PAD, BC]
        mx = tl.load(mix + j * C + c[None, :], mask=jm, other=0.0)
        if STATE_READY:
            # The previous token's row, written by this kernel a step earlier (see add_norm_shift_triton).
            p = tl.load(prev + i_b * s_p + c, mask=m, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    # why: every activation is loaded before the first store; a load after a store to another
    # buffer is not moved above it (the compiler cannot rule out aliasing), so each would wait its
    # own memory round trip behind the store before it
    xv = tl.load(x + i_b * s_x + c, mask=m, other=0.0)
    if HAS_DELTA:
        dv = tl.load(delta + i_b * s_d + c, mask=m, other=0.0).to(tl.float32)
    if HAS_SHIFT and not STATE_READY:
        p = tl.load(prev + i_b * s_p + c, mask=m, other=0.0).to(tl.float32)
    if HAS_DELTA:
        # why: rounded to the residual's dtype before the norm, as the unfused x = x + out is
        xv = (xv.to(tl.float32) + dv).to(xv.dtype)
        tl.store(x + i_b * s_x + c, xv, mask=m)
    xf = xv.to(tl.float32)
    mean = tl.sum(xf, axis=0) / C
    xc = tl.where(m, xf - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / C
    h = xc * tl.rsqrt(var + eps) * wv
    if HAS_BIAS:
        h += bv
    hq = h.to(out.dtype.element_ty)
    if HAS_SHIFT:
        tl.store(prev + i_b * s_p + c, hq.to(prev.dtype.element_ty), mask=m)
        hf = hq.to(tl.float32)
        d = p - hf
        tl.store(out + (j * B + i_b) * C + c[None, :], (hf[None, :] + d[None, :] * mx.to(tl.float32)).to(out.dtype.element_ty),
                 mask=jm)
    else:
        tl.store(out + i_b * C + c, hq, mask=m)


def add_norm_shift_triton(x, delta, weight, bias, prev=None, mixes=None, *, eps, out=None, state_ready=False):
    """See `add_norm_shift_ref`. Returns `[M, B, C]` (with prev) or h `[B, C]`, contiguous (written
    into `out` when given).

    `state_ready=True` promises that prev was last written before a kernel launched without PDL (in a
    decode step: by this call a step earlier, the step ending with sampling kernels launched without
    PDL), so under PDL the row is loaded before gdc_wait(), overlapping the kernel before, as the
    recurrent steps load their state (`declab_kernels.pdl`)."""
    B, C = x.shape
    _check_rows("x", x, C)
    if delta is not None:
        _check_rows("delta", delta, C)
    if prev is not None:
        _check_rows("prev", prev, C)
        if mixes.shape[-1] != C or not mixes.is_contiguous():
            raise ValueError(f"rwkv7_fused: mixes must be contiguous [M, {C}], got {tuple(mixes.shape)}")
    shape = (mixes.shape[0], B, C) if prev is not None else (B, C)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif out.shape != shape or not out.is_contiguous():
        raise ValueError(f"rwkv7_fused: out must be contiguous {list(shape)}, got {tuple(out.shape)}")
    BC = triton.next_power_of_2(C)
    use_pdl = pdl(x.device, __name__)
    _add_norm_shift_kernel[(B,)](
        x, x if delta is None else delta, weight, weight if bias is None else bias,
        x if prev is None else prev, weight if mixes is None else mixes, out,
        x.stride(0), 0 if delta is None else delta.stride(0), 0 if prev is None else prev.stride(0), B, C, eps,
        M=1 if mixes is None else mixes.shape[0], M_PAD=1 if mixes is None else triton.next_power_of_2(mixes.shape[0]), BC=BC,
        HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, HAS_SHIFT=prev is not None, PDL=use_pdl,
        STATE_READY=bool(state_ready),
        num_warps=_row_warps(C), launch_pdl=use_pdl,
    )
    return out


@triton.jit
def _hidden_block(src, s_src, i_b, lo, hi, cols):
    """One row of one block, loaded (float32): src[i_b, :] in columns [lo, hi)."""
    return tl.load(src + i_b * s_src + (cols - lo), mask=(cols >= lo) & (cols < hi), other=0.0).to(tl.float32)


@triton.jit
def _store_hidden(y, lo, hi, dst, cols, D, ACT: tl.constexpr):
    """act(y) in columns [lo, hi) of a row of dst, zeros elsewhere."""
    if ACT == 1:
        # why: tanh(y) = 2 sigmoid(2y) - 1, one exp, no libdevice call
        y = 2.0 * tl.sigmoid(2.0 * y) - 1.0
    if ACT == 2:
        y = tl.sigmoid(y)
    tl.store(dst + cols, tl.where((cols >= lo) & (cols < hi), y, 0.0).to(dst.dtype.element_ty), mask=cols < D)


@triton.jit
def _lora_hidden_kernel(
    p0, p1, p2, p3, out,
    s0, s1, s2, s3, B, o1, o2, o3, D,
    NB: tl.constexpr, A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr, BD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i_b = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    # why: all blocks are loaded before the first store; a load after a store to another buffer is
    # not moved above it (the compiler cannot rule out aliasing), so it would wait behind it
    y0 = _hidden_block(p0, s0, i_b, 0, o1, cols)
    y1 = _hidden_block(p1, s1, i_b, o1, o2, cols)
    y2 = _hidden_block(p2, s2, i_b, o2, o3, cols)
    if NB == 4:
        y3 = _hidden_block(p3, s3, i_b, o3, D, cols)
    _store_hidden(y0, 0, o1, out + i_b * D, cols, D, A0)
    _store_hidden(y1, o1, o2, out + (B + i_b) * D, cols, D, A1)
    _store_hidden(y2, o2, o3, out + (2 * B + i_b) * D, cols, D, A2)
    if NB == 4:
        _store_hidden(y3, o3, D, out + (3 * B + i_b) * D, cols, D, A3)


def lora_hidden_triton(blocks, acts, *, out=None):
    """See `lora_hidden_ref`; 3 or 4 blocks, each `[B, D_j]` with unit last stride (any row stride)."""
    NB = len(blocks)
    if NB not in (3, 4) or len(acts) != NB:
        raise ValueError(f"rwkv7_fused: lora_hidden takes 3 or 4 blocks with an activation each, got {NB}, {len(acts)}")
    B = blocks[0].shape[0]
    for blk in blocks:
        if blk.dim() != 2 or blk.shape[0] != B or blk.stride(1) != 1:
            raise ValueError(f"rwkv7_fused: LoRA blocks must be [B, D_j] with unit last stride, got {tuple(blk.shape)}")
    offs = [0]
    for blk in blocks:
        offs.append(offs[-1] + blk.shape[1])
    D = offs[-1]
    if out is None:
        out = torch.empty(NB * B, D, dtype=blocks[0].dtype, device=blocks[0].device)
    elif out.shape != (NB * B, D) or not out.is_contiguous():
        raise ValueError(f"rwkv7_fused: out must be contiguous [{NB * B}, {D}], got {tuple(out.shape)}")
    p = list(blocks) + [blocks[0]] * (4 - NB)
    codes = [ACTS.index(a) for a in acts] + [0] * (4 - NB)
    o3 = offs[3] if NB == 4 else D
    use_pdl = pdl(out.device, __name__)
    _lora_hidden_kernel[(B,)](
        *p, out, *(t.stride(0) for t in p), B, offs[1], offs[2], o3, D,
        NB=NB, A0=codes[0], A1=codes[1], A2=codes[2], A3=codes[3], BD=triton.next_power_of_2(D), PDL=use_pdl,
        num_warps=_row_warps(D), launch_pdl=use_pdl,
    )
    return out


@triton.jit
def _time_mix_inputs_kernel(
    r, k, v, u_v, u_w, u_a, bias_w, bias_a, bias_v, k_k, k_a, v_first, x, w_out,
    s_r, s_k, s_v, s_vf, B, C, D,
    HAS_VLORA: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False,
):
    i_h = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BD)
    m = d < D
    c = i_h * D + d
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # Biases, k_k and k_a are no kernel's output: under PDL fetched while the previous kernel finishes
    # (k_a would otherwise be loaded only after the key norm's reduction, a round trip of its own).
    bw = tl.load(bias_w + c, mask=m, other=0.0).to(tl.float32)
    ba = tl.load(bias_a + c, mask=m, other=0.0).to(tl.float32)
    kkw = tl.load(k_k + c, mask=m, other=0.0).to(tl.float32)
    kaw = tl.load(k_a + c, mask=m, other=0.0).to(tl.float32)
    if HAS_VLORA:
        bv = tl.load(bias_v + c, mask=m, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    rr = tl.load(r + i_b * s_r + c, mask=m, other=0.0).to(tl.float32)
    kf = tl.load(k + i_b * s_k + c, mask=m, other=0.0).to(tl.float32)
    vf = tl.load(v + i_b * s_v + c, mask=m, other=0.0).to(tl.float32)
    # u_v, u_w, u_a: row blocks of the contiguous LoRA up-projection output, row stride C
    uw = tl.load(u_w + i_b * C + c, mask=m, other=0.0).to(tl.float32)
    ua = tl.load(u_a + i_b * C + c, mask=m, other=0.0).to(tl.float32)
    w = -_W_SCALE * tl.sigmoid(uw + bw)
    iclr = tl.sigmoid(ua + ba)
    if HAS_VLORA:
        uv = tl.load(u_v + i_b * C + c, mask=m, other=0.0).to(tl.float32)
        t = tl.sigmoid(uv + bv)
        vfirst = tl.load(v_first + i_b * s_vf + c, mask=m, other=0.0).to(tl.float32)
        vf = vf + (vfirst - vf) * t
    kk = kf * kkw
    # F.normalize: divide by max(||kk||, 1e-12)
    kk = kk / tl.maximum(tl.sqrt(tl.sum(kk * kk, axis=0)), 1e-12)
    kf = kf * (1.0 + (iclr - 1.0) * kaw)
    row = i_b * C + c
    dt = x.dtype.element_ty
    tl.store(x + row, rr.to(dt), mask=m)
    tl.store(x + B * C + row, kf.to(dt), mask=m)
    tl.store(x + 2 * B * C + row, vf.to(dt), mask=m)
    tl.store(x + 3 * B * C + row, (-kk).to(dt), mask=m)
    tl.store(x + 4 * B * C + row, (kk * iclr).to(dt), mask=m)
    tl.store(w_out + row, w, mask=m)


def time_mix_inputs_triton(r, k, v, u, bias_w, bias_a, bias_v, k_k, k_a, v_first, *, head_dim, out=None, w_out=None):
    """See `time_mix_inputs_ref`; written into `out` `[5, B, C]` and `w_out` `[B, C]` float32 when given."""
    B, C = r.shape
    for name, t in (("r", r), ("k", k), ("v", v)) + ((("v_first", v_first),) if v_first is not None else ()):
        _check_rows(name, t, C)
    NB = 4 if v_first is not None else 3
    if not u.is_contiguous() or u.shape[0] < (NB - 1) * B or u.shape[1] != C:
        raise ValueError(f"rwkv7_fused: u must be contiguous [{NB} * B, {C}], got {tuple(u.shape)}")
    x = torch.empty(5, B, C, dtype=r.dtype, device=r.device) if out is None else out
    w = torch.empty(B, C, dtype=torch.float32, device=r.device) if w_out is None else w_out
    if x.shape != (5, B, C) or not x.is_contiguous() or w.shape != (B, C) or w.dtype != torch.float32 or not w.is_contiguous():
        raise ValueError("rwkv7_fused: out must be contiguous [5, B, C] and w_out float32 [B, C]")
    H = C // head_dim
    BD = triton.next_power_of_2(head_dim)
    # u's row blocks: (v, w, a, g), or (w, a, g) without a value LoRA
    jw = 1 if v_first is not None else 0
    u_v, u_w, u_a = u[:B], u[jw * B : (jw + 1) * B], u[(jw + 1) * B : (jw + 2) * B]
    use_pdl = pdl(r.device, __name__)
    _time_mix_inputs_kernel[(H, B)](
        r, k, v, u_v, u_w, u_a, bias_w, bias_a, bias_w if bias_v is None else bias_v, k_k, k_a,
        r if v_first is None else v_first, x, w,
        r.stride(0), k.stride(0), v.stride(0), 0 if v_first is None else v_first.stride(0), B, C, head_dim,
        HAS_VLORA=v_first is not None, BD=BD, PDL=use_pdl, num_warps=max(1, min(4, BD // 32)), launch_pdl=use_pdl,
    )
    return x, w


@triton.jit
def _gate_output_kernel(
    o, r, k, v, g, r_k, norm_w, norm_b, out,
    s_o, s_x, s_g, C, D, eps,
    BD: tl.constexpr, PDL: tl.constexpr = False,
):
    i_h = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BD)
    m = d < D
    c = i_h * D + d
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # The group norm's weight and bias and r_k are no kernel's output: under PDL fetched before the wait.
    nw = tl.load(norm_w + c, mask=m, other=0.0).to(tl.float32)
    nb = tl.load(norm_b + c, mask=m, other=0.0).to(tl.float32)
    rk = tl.load(r_k + c, mask=m, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    # why: every activation is loaded before the reductions; loads after them would each add a
    # memory round trip (the compiler does not move loads above the reductions' barriers)
    of = tl.load(o + i_b * s_o + c, mask=m, other=0.0).to(tl.float32)
    rr = tl.load(r + i_b * s_x + c, mask=m, other=0.0).to(tl.float32)
    kk = tl.load(k + i_b * s_x + c, mask=m, other=0.0).to(tl.float32)
    vv = tl.load(v + i_b * s_x + c, mask=m, other=0.0).to(tl.float32)
    gg = tl.load(g + i_b * s_g + c, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(of, axis=0) / D
    oc = tl.where(m, of - mean, 0.0)
    var = tl.sum(oc * oc, axis=0) / D
    y = oc * tl.rsqrt(var + eps) * nw + nb
    bonus = tl.sum(rr * kk * rk, axis=0)
    tl.store(out + i_b * C + c, ((y + bonus * vv) * gg).to(out.dtype.element_ty), mask=m)


def gate_output_triton(o, r, k, v, g, r_k, norm_weight, norm_bias, *, eps, out=None):
    """See `gate_output_ref`. o `[B, H, D]`; r, k, v `[B, H, D]` with one shared layout; g `[B, C]`.
    Written into `out` `[B, C]` when given."""
    B, H, D = o.shape
    C = H * D
    for name, t in (("o", o), ("r", r), ("k", k), ("v", v)):
        if t.shape != (B, H, D) or t.stride(1) != D or t.stride(2) != 1:
            raise ValueError(f"rwkv7_fused: {name} must be [B, H, D] with heads packed in a row, got {tuple(t.shape)} {t.stride()}")
    if not (r.stride() == k.stride() == v.stride()):
        raise ValueError("rwkv7_fused: r, k and v must share strides")
    _check_rows("g", g, C)
    if out is None:
        out = torch.empty(B, C, dtype=o.dtype, device=o.device)
    elif out.shape != (B, C) or not out.is_contiguous():
        raise ValueError(f"rwkv7_fused: out must be contiguous [{B}, {C}], got {tuple(out.shape)}")
    BD = triton.next_power_of_2(D)
    use_pdl = pdl(o.device, __name__)
    _gate_output_kernel[(H, B)](
        o, r, k, v, g, r_k, norm_weight, norm_bias, out,
        o.stride(0), r.stride(0), g.stride(0), C, D, eps,
        BD=BD, PDL=use_pdl, num_warps=max(1, min(4, BD // 32)), launch_pdl=use_pdl,
    )
    return out


@triton.jit
def _sqrelu_kernel(x, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    y = tl.maximum(tl.load(x + i, mask=m, other=0.0).to(tl.float32), 0.0)
    tl.store(x + i, (y * y).to(x.dtype.element_ty), mask=m)


def sqrelu_triton(x):
    """relu(x)^2 in place on a contiguous x. Returns x."""
    if not x.is_contiguous():
        raise ValueError("rwkv7_fused: sqrelu needs a contiguous tensor")
    BLOCK = 1024
    use_pdl = pdl(x.device, __name__)
    _sqrelu_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, x.numel(), BLOCK=BLOCK, PDL=use_pdl, num_warps=4,
                                                     launch_pdl=use_pdl)
    return x
