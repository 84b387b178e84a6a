"""The persistent batch-1 RWKV-7 decode step in Triton: one launch runs the whole forward.

Grid (P,): program p runs work-list items p, p + P, ... in order (`schedule_rwkv7.py` builds the list
and says what each stage computes). The machinery is the llama step's (`triton.py`): the same waits on
growing counters with the stall flag, the same release signal, the same epoch advanced by the last
program to finish, the same GEMV tile (`_gemv_item`: its first two weight chunks loaded before the
wait, two in flight through its K loop) for the row-select r/k/v + LoRA down-projection, o_proj, the
channel mix's key and value (relu^2 on its input, `SQRELU`) and the head. Two items are the family's:
- `_norm_item`: a whole-row LayerNorm and the token shift with its mixes (`declab_kernels.rwkv7_fused`'s
  `add_norm_shift`), one item a norm; the norm's weights, mixes and shift row are loaded before the wait.
- `_mix_item`: one head's time mix after the down-projection: the LoRA activations and up-projections
  of the head's D channels (`lora_hidden` and the up GEMV), `time_mix_inputs`, the WKV-7 state update
  in place (`declab_kernels.wkv7` step), `gate_output`; the head's state is loaded before the wait.

Arithmetic follows the graphed step (`declab_arch.rwkv7.RWKV7.forward_step`): every tensor it stores
in the model dtype is rounded here where it is stored there (x after each residual add, h and the mixed
inputs, the projections, the LoRA activations and outputs, r, k, v, a, b, the WKV output, the gated
output, the key's output, relu^2 of it), the decay w stays float32, the states as they are.

Per-layer tensors come through a pointer table [L, 19] int64 (`rwkv7.RWKV7LayerWeights.tensors` order).
The states are the decoder's own buffers: shift [L, 2, 1, C] (model dtype) and wkv [L, 1, H, D, D] float32.
"""

import triton
import triton.language as tl

from declab_kernels.persistent_step import schedule
from declab_kernels.persistent_step.triton import (_delay, _embed_item, _gemv_item, _item, _item_end, _signal, _skip_met, _step_end,
                                                   _step_start, _wait, _weights)
from declab_kernels.rwkv7_fused.ref import W_SCALE

EMBED = tl.constexpr(schedule.EMBED)
TNORM = tl.constexpr(schedule.TNORM)
SEL = tl.constexpr(schedule.SEL)
MIX = tl.constexpr(schedule.MIX)
O = tl.constexpr(schedule.O)
CNORM = tl.constexpr(schedule.CNORM)
KEY = tl.constexpr(schedule.KEY)
VAL = tl.constexpr(schedule.VAL)
FNORM = tl.constexpr(schedule.FNORM)
HEAD = tl.constexpr(schedule.HEAD)
# Pointers a layer in the table.
WIDTH = tl.constexpr(19)
_W_SCALE = tl.constexpr(W_SCALE)


@triton.jit
def _norm_item(src_ptr, w_ptr, b_ptr, prev_ptr, mix_ptr, out_ptr, eps, cnt_ptr, wait_idx, target, seed,
               C: tl.constexpr, BC: tl.constexpr, M: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SHIFT: tl.constexpr,
               DELAY: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr, stall_ptr, MAX_POLLS: tl.constexpr):
    """h = LN(src) rounded to out's dtype; HAS_SHIFT: out[m] = h + (prev - h) mix[m] for the M mixes and
    prev = h, else out = h."""
    c = tl.arange(0, BC)
    m = c < C
    # 1. What no item of this step writes: the norm's weight and bias, the mixes, the shift row (this
    #    item's own, written by the launch before).
    wv = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bv = tl.load(b_ptr + c, mask=m, other=0.0).to(tl.float32)
    if HAS_SHIFT:
        p = tl.load(prev_ptr + c, mask=m, other=0.0).to(tl.float32)
    _delay(seed, DELAY)
    _wait(cnt_ptr, wait_idx, target, stamp_ptr, TIMELINE, stall_ptr, MAX_POLLS)
    # 2. The row, through L2; the norm as `add_norm_shift` computes it.
    xf = tl.load(src_ptr + c, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    mean = tl.sum(xf, axis=0) / C
    xc = tl.where(m, xf - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / C
    h = xc * tl.rsqrt(var + eps) * wv
    if HAS_BIAS:
        h += bv
    dt = out_ptr.dtype.element_ty
    hq = h.to(dt)
    if HAS_SHIFT:
        tl.store(prev_ptr + c, hq.to(prev_ptr.dtype.element_ty), mask=m)
        hf = hq.to(tl.float32)
        d = p - hf
        for j in tl.static_range(M):
            mx = tl.load(mix_ptr + j * C + c, mask=m, other=0.0).to(tl.float32)
            tl.store(out_ptr + j * C + c, (hf + d * mx).to(dt), mask=m)
    else:
        tl.store(out_ptr + c, hq, mask=m)


@triton.jit
def _up_products(acc_v, acc_w, acc_a, acc_g, wt, lo, cols, o_w, o_a, o_g, dt: tl.constexpr):
    """One chunk of a head's LoRA up-projections: its columns `cols` of up rows wt [BD, BR] times the LoRA
    activations of the down-projection's outputs lo, each LoRA summed over its own columns."""
    lo = lo.to(tl.float32)
    is_w = (cols >= o_w) & (cols < o_a)
    is_g = cols >= o_g
    # why: tanh(y) = 2 sigmoid(2y) - 1, as `lora_hidden` computes it
    act = tl.where(is_w, 2.0 * tl.sigmoid(2.0 * lo) - 1.0, tl.where(is_g, tl.sigmoid(lo), lo))
    act = act.to(dt).to(tl.float32)
    prod = wt.to(tl.float32) * act[None, :]
    acc_v += tl.sum(tl.where((cols < o_w)[None, :], prod, 0.0), axis=1)
    acc_w += tl.sum(tl.where(is_w[None, :], prod, 0.0), axis=1)
    acc_a += tl.sum(tl.where(((cols >= o_a) & (cols < o_g))[None, :], prod, 0.0), axis=1)
    acc_g += tl.sum(tl.where(is_g[None, :], prod, 0.0), axis=1)
    return acc_v, acc_w, acc_a, acc_g


@triton.jit
def _mix_item(layer, h, tab_ptr, like_ptr, y_ptr, vf_ptr, mo_ptr, wkv_ptr, g_eps,
              cnt_ptr, wait_idx, target, seed,
              C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, RV: tl.constexpr, RW: tl.constexpr,
              RA: tl.constexpr, RG: tl.constexpr, BR: tl.constexpr,
              DELAY: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr, stall_ptr, MAX_POLLS: tl.constexpr):
    """Head h of layer `layer` from the down-projection y ([r | k | v | LoRA (v,) w, a, g] rows): its
    LoRA up-projections, time-mix inputs, WKV-7 state update in place, group norm, bonus and gate;
    stores the head's D channels of the gated output into mo (and, in layer 0, of v into v_first)."""
    d = tl.arange(0, BD)
    m = d < D
    c = h * D + d
    dt = y_ptr.dtype.element_ty
    has_v = layer > 0
    # [BD] masks of the layer's value residual (layers > 0) and of the v_first store (layer 0)
    layer_v = tl.zeros([BD], dtype=tl.int32) + layer
    v_res = m & (layer_v > 0)
    # 1. What no item of this step writes, loaded before the wait: the head's state [BD (K), BD (V)],
    #    the biases, k_k, k_a, r_k, the group norm's weight and bias, the first two chunks of its up rows.
    st = wkv_ptr + (layer * H + h).to(tl.int64) * D * D + d[:, None] * D + d[None, :]
    s_mask = m[:, None] & m[None, :]
    S = tl.load(st, mask=s_mask, other=0.0)
    bw = tl.load(_weights(tab_ptr, layer, 3, like_ptr, WIDTH) + c, mask=m, other=0.0).to(tl.float32)
    ba = tl.load(_weights(tab_ptr, layer, 4, like_ptr, WIDTH) + c, mask=m, other=0.0).to(tl.float32)
    bv = tl.load(_weights(tab_ptr, layer, 5, like_ptr, WIDTH) + c, mask=m, other=0.0).to(tl.float32)
    kkw = tl.load(_weights(tab_ptr, layer, 6, like_ptr, WIDTH) + c, mask=m, other=0.0).to(tl.float32)
    kaw = tl.load(_weights(tab_ptr, layer, 7, like_ptr, WIDTH) + c, mask=m, other=0.0).to(tl.float32)
    rk = tl.load(_weights(tab_ptr, layer, 8, like_ptr, WIDTH) + c, mask=m, other=0.0).to(tl.float32)
    gnw = tl.load(_weights(tab_ptr, layer, 9, like_ptr, WIDTH) + c, mask=m, other=0.0).to(tl.float32)
    gnb = tl.load(_weights(tab_ptr, layer, 10, like_ptr, WIDTH) + c, mask=m, other=0.0).to(tl.float32)
    # The LoRA columns of the packed up-projection: (v for layers > 0), w, a, g.
    o_w = tl.where(has_v, RV, 0)
    o_a = o_w + RW
    o_g = o_a + RA
    R = o_g + RG
    up_rows = _weights(tab_ptr, layer, 2, like_ptr, WIDTH) + c[:, None].to(tl.int64) * R
    offs_r = tl.arange(0, BR)
    # The head's first two [BD, BR] chunks of up rows, weights: in flight while the item waits.
    wt_a = tl.load(up_rows + offs_r[None, :], mask=m[:, None] & (offs_r < R)[None, :], other=0.0)
    wt_b = tl.load(up_rows + (offs_r + BR)[None, :], mask=m[:, None] & (offs_r + BR < R)[None, :], other=0.0)
    _delay(seed, DELAY)
    _wait(cnt_ptr, wait_idx, target, stamp_ptr, TIMELINE, stall_ptr, MAX_POLLS)
    # 2. The LoRA up-projections of the head's channels: up [C, R] times the block-diagonal activations,
    #    as one sum per LoRA over its own columns; two chunks an iteration, each buffer (up rows and the
    #    down-projection's outputs) reloaded in place after its products, as `_gemv_item` does.
    lo_a = tl.load(y_ptr + 3 * C + offs_r, mask=offs_r < R, other=0.0, cache_modifier=".cg")
    lo_b = tl.load(y_ptr + 3 * C + BR + offs_r, mask=offs_r + BR < R, other=0.0, cache_modifier=".cg")
    acc_v = tl.zeros([BD], dtype=tl.float32)
    acc_w = tl.zeros([BD], dtype=tl.float32)
    acc_a = tl.zeros([BD], dtype=tl.float32)
    acc_g = tl.zeros([BD], dtype=tl.float32)
    for r0 in range(0, R, 2 * BR):
        acc_v, acc_w, acc_a, acc_g = _up_products(acc_v, acc_w, acc_a, acc_g, wt_a, lo_a, r0 + offs_r, o_w, o_a, o_g, dt)
        nxt = r0 + 2 * BR + offs_r
        wt_a = tl.load(up_rows + nxt[None, :], mask=m[:, None] & (nxt < R)[None, :], other=0.0)
        lo_a = tl.load(y_ptr + 3 * C + nxt, mask=nxt < R, other=0.0, cache_modifier=".cg")
        acc_v, acc_w, acc_a, acc_g = _up_products(acc_v, acc_w, acc_a, acc_g, wt_b, lo_b, r0 + BR + offs_r, o_w, o_a, o_g, dt)
        nxt = r0 + 3 * BR + offs_r
        wt_b = tl.load(up_rows + nxt[None, :], mask=m[:, None] & (nxt < R)[None, :], other=0.0)
        lo_b = tl.load(y_ptr + 3 * C + nxt, mask=nxt < R, other=0.0, cache_modifier=".cg")
    u_v = acc_v.to(dt).to(tl.float32)
    u_w = acc_w.to(dt).to(tl.float32)
    u_a = acc_a.to(dt).to(tl.float32)
    u_g = acc_g.to(dt).to(tl.float32)
    # 3. The time-mix inputs (`time_mix_inputs`).
    rr = tl.load(y_ptr + c, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    kf = tl.load(y_ptr + C + c, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    vf = tl.load(y_ptr + 2 * C + c, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    v_first = tl.load(vf_ptr + c, mask=v_res, other=0.0, cache_modifier=".cg").to(tl.float32)
    w = -_W_SCALE * tl.sigmoid(u_w + bw)
    iclr = tl.sigmoid(u_a + ba)
    vf = tl.where(v_res, vf + (v_first - vf) * tl.sigmoid(u_v + bv), vf)
    kk = kf * kkw
    # F.normalize: divide by max(||kk||, 1e-12)
    kk = kk / tl.maximum(tl.sqrt(tl.sum(kk * kk, axis=0)), 1e-12)
    kf = kf * (1.0 + (iclr - 1.0) * kaw)
    rr = rr.to(dt).to(tl.float32)
    kf = kf.to(dt).to(tl.float32)
    vr = vf.to(dt)
    vv = vr.to(tl.float32)
    aa = (-kk).to(dt).to(tl.float32)
    bb = (kk * iclr).to(dt).to(tl.float32)
    tl.store(vf_ptr + c, vr, mask=m & (layer_v == 0))
    # 4. The WKV-7 step: S = exp(w) S + b (a^T S) + k v^T, in place; o = r^T S.
    sa = tl.sum(aa[:, None] * S, axis=0)
    S = tl.exp(w)[:, None] * S + bb[:, None] * sa[None, :] + kf[:, None] * vv[None, :]
    tl.store(st, S, mask=s_mask)
    o = tl.sum(rr[:, None] * S, axis=0).to(dt).to(tl.float32)
    # 5. Group norm of the head, the r_k bonus, the gate (`gate_output`).
    mean = tl.sum(o, axis=0) / D
    oc = tl.where(m, o - mean, 0.0)
    var = tl.sum(oc * oc, axis=0) / D
    yn = oc * tl.rsqrt(var + g_eps) * gnw + gnb
    bonus = tl.sum(rr * kf * rk, axis=0)
    tl.store(mo_ptr + c, ((yn + bonus * vv) * u_g).to(mo_ptr.dtype.element_ty), mask=m)


@triton.jit
def rwkv7_step_kernel(
    items_ptr, n_items, cnt_ptr, epoch_ptr, done_ptr, tab_ptr,
    embed_ptr, head_ptr, final_w_ptr, final_b_ptr, pre_w_ptr, pre_b_ptr, tokens_ptr,
    x_ptr, xs_ptr, y_ptr, vf_ptr, mo_ptr, xk_ptr, kv_ptr, hf_ptr, logits_ptr, shift_ptr, wkv_ptr,
    eps, g_eps, time_ptr, stall_ptr,
    C: tl.constexpr, VOCAB: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, INTER: tl.constexpr,
    RV: tl.constexpr, RW: tl.constexpr, RA: tl.constexpr, RG: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    HAS_PRE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BN_SEL: tl.constexpr, BK_SEL: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr, BN_KEY: tl.constexpr,
    BK_KEY: tl.constexpr, BN_VAL: tl.constexpr, BK_VAL: tl.constexpr, BN_HEAD: tl.constexpr, BK_HEAD: tl.constexpr,
    EMBED_BLOCK: tl.constexpr, DELAY: tl.constexpr = 0, TIMELINE: tl.constexpr = False, MAX_POLLS: tl.constexpr = 1 << 22,
):
    pid, n_prog, epoch, steps = _step_start(epoch_ptr)
    met_idx = -1
    met_target = 0
    for i in range(pid, n_items, n_prog):
        row = items_ptr + i * 8
        stage, layer, tile, wait_idx, target, signal_idx, seed, stamp = _item(row, i, epoch, n_items, time_ptr, TIMELINE)
        wait_idx, met_idx, met_target = _skip_met(wait_idx, target, met_idx, met_target)
        if stage == EMBED:
            if HAS_PRE:
                token = tl.load(tokens_ptr).to(tl.int64)
                _norm_item(embed_ptr + token * C, pre_w_ptr, pre_b_ptr, x_ptr, x_ptr, x_ptr, eps, cnt_ptr, -1, target, seed,
                           C, BC, 1, HAS_BIAS, False, 0, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            else:
                _embed_item(embed_ptr, tokens_ptr, x_ptr, C, EMBED_BLOCK, stamp, TIMELINE)
            _signal(cnt_ptr, signal_idx)
        elif stage == TNORM:
            _norm_item(x_ptr, _weights(tab_ptr, layer, 12, embed_ptr, WIDTH), _weights(tab_ptr, layer, 13, embed_ptr, WIDTH),
                       shift_ptr + layer * 2 * C, _weights(tab_ptr, layer, 0, embed_ptr, WIDTH), xs_ptr, eps,
                       cnt_ptr, wait_idx, target, seed, C, BC, 6, HAS_BIAS, True, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            _signal(cnt_ptr, signal_idx)
        elif stage == SEL:
            # The row block of the packed matrix this tile lies in picks its mixed input (r, k, v, w, a, g).
            row0 = tile * BN_SEL
            lora = 3 * C + tl.where(layer > 0, RV, 0)
            n_sel = lora + RW + RA + RG
            mixed = tl.where(row0 < C, 0, tl.where(row0 < 2 * C, 1, tl.where(row0 < lora, 2, tl.where(
                row0 < lora + RW, 3, tl.where(row0 < lora + RW + RA, 4, 5)))))
            _gemv_item(_weights(tab_ptr, layer, 1, embed_ptr, WIDTH), n_sel, C, tile, xs_ptr + mixed * C, xs_ptr, eps, y_ptr, y_ptr,
                       cnt_ptr, wait_idx, target, seed, BN_SEL, BK_SEL, False, False, False, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            _signal(cnt_ptr, signal_idx)
        elif stage == MIX:
            _mix_item(layer, tile, tab_ptr, embed_ptr, y_ptr, vf_ptr, mo_ptr, wkv_ptr, g_eps, cnt_ptr, wait_idx, target, seed,
                      C, H, D, BD, RV, RW, RA, RG, BR, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            _signal(cnt_ptr, signal_idx)
        elif stage == O:
            _gemv_item(_weights(tab_ptr, layer, 11, embed_ptr, WIDTH), C, C, tile, mo_ptr, mo_ptr, eps, x_ptr, x_ptr,
                       cnt_ptr, wait_idx, target, seed, BN_O, BK_O, False, True, False, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            _signal(cnt_ptr, signal_idx)
        elif stage == CNORM:
            _norm_item(x_ptr, _weights(tab_ptr, layer, 14, embed_ptr, WIDTH), _weights(tab_ptr, layer, 15, embed_ptr, WIDTH),
                       shift_ptr + (layer * 2 + 1) * C, _weights(tab_ptr, layer, 16, embed_ptr, WIDTH), xk_ptr, eps,
                       cnt_ptr, wait_idx, target, seed, C, BC, 1, HAS_BIAS, True, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            _signal(cnt_ptr, signal_idx)
        elif stage == KEY:
            _gemv_item(_weights(tab_ptr, layer, 17, embed_ptr, WIDTH), INTER, C, tile, xk_ptr, xk_ptr, eps, kv_ptr, kv_ptr,
                       cnt_ptr, wait_idx, target, seed, BN_KEY, BK_KEY, False, False, False, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            _signal(cnt_ptr, signal_idx)
        elif stage == VAL:
            _gemv_item(_weights(tab_ptr, layer, 18, embed_ptr, WIDTH), C, INTER, tile, kv_ptr, kv_ptr, eps, x_ptr, x_ptr,
                       cnt_ptr, wait_idx, target, seed, BN_VAL, BK_VAL, False, True, False, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS,
                       SQRELU=True)
            _signal(cnt_ptr, signal_idx)
        elif stage == FNORM:
            _norm_item(x_ptr, final_w_ptr, final_b_ptr, x_ptr, x_ptr, hf_ptr, eps, cnt_ptr, wait_idx, target, seed,
                       C, BC, 1, HAS_BIAS, False, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            _signal(cnt_ptr, signal_idx)
        elif stage == HEAD:
            _gemv_item(head_ptr, VOCAB, C, tile, hf_ptr, hf_ptr, eps, hf_ptr, logits_ptr,
                       cnt_ptr, wait_idx, target, seed, BN_HEAD, BK_HEAD, False, False, False, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
        _item_end(time_ptr, i, TIMELINE)
    _step_end(done_ptr, epoch_ptr, n_prog, steps)
