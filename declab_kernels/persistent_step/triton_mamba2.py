"""The persistent batch-1 Mamba-2 decode step in Triton: one launch runs the whole forward.

Grid (P,): program p runs work-list items p, p + P, ... in order (`schedule_mamba2.py` builds the
list and says what each stage computes). The machinery is the llama step's (`triton.py`): the same
waits on growing counters with the stall flag, the same release signal, the same epoch advanced by
the last program to finish, the same GEMV tile (`_gemv_item`: its first two weight chunks loaded
before the wait, two in flight through its K loop) for the in-projection, out-projection and head. The
SSM tile is the graphed step's kernel (`declab_kernels.ssd` decode step) cut to `BLOCK_P` rows of a
head: it loads its state tile, its conv rings, the conv weights and the head's constants before its
wait (none is written by this step's other items), then the in-projection's outputs with `.cg`.

Arithmetic follows the graphed step (`declab_arch.mamba2.Mixer.step` with the gate in the step): the
residual r is float32; the pre-norms round r * weight to the model dtype (the h the graphed out_proj
stores) and scale the products by 1/rms after the K loop; the SSM tile rounds
g = y silu(z) to the model dtype, keeps its sum of g^2 and stores g * norm weight; out_proj scales its
products by the row's 1/rms from those sums and adds them, rounded to the weight dtype, to r.

Per-layer tensors come through a pointer table [L, 9] int64 (in_proj, out_proj, conv weight, conv
bias, dt_bias, A, D, pre-norm weight, gated norm weight). The states are the decoder's own buffers:
conv [L, 1, conv_dim, W] (rings, the input at position p in slot p % W) and ssm [L, 1, H, P, N] fp32.
"""

import triton
import triton.language as tl

from declab_kernels.persistent_step import schedule
from declab_kernels.persistent_step.triton import (_delay, _embed_item, _gemv_item, _item, _item_end, _signal, _skip_met, _step_end,
                                                   _step_start, _wait, _weights)
from declab_kernels.ssd.triton import _conv_token, _conv_window, _softplus

EMBED = tl.constexpr(schedule.EMBED)
IN = tl.constexpr(schedule.IN)
SSM = tl.constexpr(schedule.SSM)
OUT = tl.constexpr(schedule.OUT)
HEAD = tl.constexpr(schedule.HEAD)
# Pointers a layer in the table.
WIDTH = tl.constexpr(9)


@triton.jit
def _ssm_item(layer, tile, tab_ptr, like_ptr, f32_ptr, zx_ptr, y_ptr, ss_ptr, conv_ptr, ssm_ptr, positions_ptr,
              stride_cl, stride_cc, stride_ck, stride_sl, stride_sh, stride_sp, lim_lo, lim_hi,
              cnt_ptr, wait_idx, target, seed,
              H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, W: tl.constexpr,
              BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_LIMIT: tl.constexpr, DELAY: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr, stall_ptr,
              MAX_POLLS: tl.constexpr):
    """Rows BLOCK_P * (tile % tiles a head) .. of head tile // (tiles a head): conv + SiLU of its x channels
    and its group's B and C, the state update in place, y = state C + D x gated by silu(z); stores
    g * norm weight into y and the tile's sum of g^2 into ss[tile]."""
    PB: tl.constexpr = (P + BLOCK_P - 1) // BLOCK_P
    D_INNER: tl.constexpr = H * P
    CONV_DIM: tl.constexpr = D_INNER + 2 * G * N
    h = tile // PB
    g = h // (H // G)
    offs_p = (tile % PB) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    p_mask = offs_p < P
    n_mask = offs_n < N
    conv_w = _weights(tab_ptr, layer, 2, like_ptr, WIDTH)
    conv_b = _weights(tab_ptr, layer, 3, like_ptr, WIDTH)
    cst_row = conv_ptr + layer.to(tl.int64) * stride_cl
    # 1. What no item of this step writes, loaded before the wait: the state tile [BLOCK_P, BLOCK_N]
    #    (most of the bytes), the position, the conv rings and weights, the head's constants.
    st = ssm_ptr + layer.to(tl.int64) * stride_sl + h * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :]
    pn_mask = p_mask[:, None] & n_mask[None, :]
    s = tl.load(st, mask=pn_mask, other=0.0)
    slot_t = (tl.load(positions_ptr) % W).to(tl.int32)
    ch_x = h * P + offs_p
    ch_B = D_INNER + g * N + offs_n
    ch_C = D_INNER + G * N + g * N + offs_n
    x_ring, x_w, x_cb = _conv_window(cst_row, conv_w, conv_b, ch_x, p_mask, stride_cc, stride_ck, W, 1, W, BLOCK_W, HAS_BIAS)
    B_ring, B_w, B_cb = _conv_window(cst_row, conv_w, conv_b, ch_B, n_mask, stride_cc, stride_ck, W, 1, W, BLOCK_W, HAS_BIAS)
    C_ring, C_w, C_cb = _conv_window(cst_row, conv_w, conv_b, ch_C, n_mask, stride_cc, stride_ck, W, 1, W, BLOCK_W, HAS_BIAS)
    dt_bias = tl.load(_weights(tab_ptr, layer, 4, f32_ptr, WIDTH) + h).to(tl.float32)
    A = tl.load(_weights(tab_ptr, layer, 5, f32_ptr, WIDTH) + h).to(tl.float32)
    Dh = tl.load(_weights(tab_ptr, layer, 6, f32_ptr, WIDTH) + h).to(tl.float32)
    nw = tl.load(_weights(tab_ptr, layer, 8, like_ptr, WIDTH) + ch_x, mask=p_mask, other=0.0).to(tl.float32)
    _delay(seed, DELAY)
    _wait(cnt_ptr, wait_idx, target, stamp_ptr, TIMELINE, stall_ptr, MAX_POLLS)
    # 2. This token's inputs, from the in-projection (rows z | x B C | dt), through L2.
    dt = tl.load(zx_ptr + D_INNER + CONV_DIM + h, cache_modifier=".cg").to(tl.float32) + dt_bias
    zv = tl.load(zx_ptr + ch_x, mask=p_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    x_new = tl.load(zx_ptr + D_INNER + ch_x, mask=p_mask, other=0.0, cache_modifier=".cg")
    B_new = tl.load(zx_ptr + D_INNER + ch_B, mask=n_mask, other=0.0, cache_modifier=".cg")
    C_new = tl.load(zx_ptr + D_INNER + ch_C, mask=n_mask, other=0.0, cache_modifier=".cg")
    x, x_win = _conv_token(x_ring, x_w, x_cb, x_new, slot_t, W, BLOCK_W)
    Bv, B_win = _conv_token(B_ring, B_w, B_cb, B_new, slot_t, W, BLOCK_W)
    Cv, C_win = _conv_token(C_ring, C_w, C_cb, C_new, slot_t, W, BLOCK_W)
    # 3. The token's inputs into its slot, which no item's window reads this step: the x channels are
    #    this tile's, the group's B and C are written by the group's first tile.
    cdt = conv_ptr.dtype.element_ty
    slot = offs_w[None, :] == slot_t
    tl.store(cst_row + ch_x[:, None] * stride_cc + offs_w[None, :] * stride_ck, x_win.to(cdt), mask=p_mask[:, None] & slot)
    if tile == g * (H // G) * PB:
        tl.store(cst_row + ch_B[:, None] * stride_cc + offs_w[None, :] * stride_ck, B_win.to(cdt), mask=n_mask[:, None] & slot)
        tl.store(cst_row + ch_C[:, None] * stride_cc + offs_w[None, :] * stride_ck, C_win.to(cdt), mask=n_mask[:, None] & slot)
    # 4. state = exp(dt A) state + dt x B^T, in place.
    dt = _softplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, lim_lo), lim_hi)
    s = s * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
    tl.store(st, s, mask=pn_mask)
    # 5. y = state C + D x, gated; g rounded as the unfused norm reads it, its sum of squares kept.
    y = tl.sum(s * Cv[None, :], axis=1) + Dh * x
    y = y * zv * tl.sigmoid(zv)
    gy = y.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(ss_ptr + tile, tl.sum(tl.where(p_mask, gy * gy, 0.0), axis=0))
    tl.store(y_ptr + ch_x, (gy * nw).to(y_ptr.dtype.element_ty), mask=p_mask)


@triton.jit
def mamba2_step_kernel(
    items_ptr, n_items, cnt_ptr, epoch_ptr, done_ptr, tab_ptr,
    embed_ptr, head_ptr, final_norm_ptr, tokens_ptr, positions_ptr,
    r_ptr, zx_ptr, y_ptr, ss_ptr, logits_ptr, conv_ptr, ssm_ptr,
    stride_cl, stride_cc, stride_ck, stride_sl, stride_sh, stride_sp,
    eps, lim_lo, lim_hi, time_ptr, stall_ptr,
    D_MODEL: tl.constexpr, VOCAB: tl.constexpr, H: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    G: tl.constexpr, W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr, N_SSM: tl.constexpr, SS_PAD: tl.constexpr,
    BN_IN: tl.constexpr, BK_IN: tl.constexpr, BN_OUT: tl.constexpr, BK_OUT: tl.constexpr,
    BN_HEAD: tl.constexpr, BK_HEAD: tl.constexpr, EMBED_BLOCK: tl.constexpr,
    DELAY: tl.constexpr = 0, TIMELINE: tl.constexpr = False, MAX_POLLS: tl.constexpr = 1 << 22,
):
    pid, n_prog, epoch, steps = _step_start(epoch_ptr)
    D_INNER: tl.constexpr = H * P
    N_IN: tl.constexpr = 2 * D_INNER + 2 * G * N + H
    met_idx = -1
    met_target = 0
    for i in range(pid, n_items, n_prog):
        row = items_ptr + i * 8
        stage, layer, tile, wait_idx, target, signal_idx, seed, stamp = _item(row, i, epoch, n_items, time_ptr, TIMELINE)
        wait_idx, met_idx, met_target = _skip_met(wait_idx, target, met_idx, met_target)
        if stage == EMBED:
            _embed_item(embed_ptr, tokens_ptr, r_ptr, D_MODEL, EMBED_BLOCK, stamp, TIMELINE)
            _signal(cnt_ptr, signal_idx)
        elif stage == IN:
            _gemv_item(_weights(tab_ptr, layer, 0, embed_ptr, WIDTH), N_IN, D_MODEL, tile, r_ptr, _weights(tab_ptr, layer, 7, embed_ptr, WIDTH),
                       eps, r_ptr, zx_ptr, cnt_ptr, wait_idx, target, seed, BN_IN, BK_IN, True, False, False, DELAY, stamp, TIMELINE,
                       stall_ptr, MAX_POLLS, ROUND_NORMED=True)
            _signal(cnt_ptr, signal_idx)
        elif stage == SSM:
            _ssm_item(layer, tile, tab_ptr, embed_ptr, r_ptr, zx_ptr, y_ptr, ss_ptr, conv_ptr, ssm_ptr, positions_ptr,
                      stride_cl, stride_cc, stride_ck, stride_sl, stride_sh, stride_sp, lim_lo, lim_hi,
                      cnt_ptr, wait_idx, target, seed, H, P, N, G, W, BLOCK_P, BLOCK_N, BLOCK_W, HAS_BIAS, HAS_LIMIT,
                      DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            _signal(cnt_ptr, signal_idx)
        elif stage == OUT:
            _gemv_item(_weights(tab_ptr, layer, 1, embed_ptr, WIDTH), D_MODEL, D_INNER, tile, y_ptr, y_ptr, eps, r_ptr, r_ptr,
                       cnt_ptr, wait_idx, target, seed, BN_OUT, BK_OUT, False, True, False, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS,
                       ss_ptr, N_SSM, SS_PAD)
            _signal(cnt_ptr, signal_idx)
        elif stage == HEAD:
            _gemv_item(head_ptr, VOCAB, D_MODEL, tile, r_ptr, final_norm_ptr, eps, r_ptr, logits_ptr,
                       cnt_ptr, wait_idx, target, seed, BN_HEAD, BK_HEAD, True, False, False, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS,
                       ROUND_NORMED=True)
        _item_end(time_ptr, i, TIMELINE)
    _step_end(done_ptr, epoch_ptr, n_prog, steps)
