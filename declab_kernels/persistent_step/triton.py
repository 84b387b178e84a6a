"""The persistent batch-1 llama decode step in Triton: one launch runs the whole forward.

Grid (P,): program p runs work-list items p, p + P, ... in order (`schedule.py` builds the list and
says what each stage computes). For each item a program
1. loads the first two weight chunks of its tile (GEMV stages) or the first K/V tile of its split (ATTN):
   neither depends on this step's data, so these loads are in flight while it waits;
2. waits until its counter holds `wait_count * (epoch + 1)` (an acquire atomic read in a loop; no read when
   its last wait already saw that counter reach it, `_skip_met`);
3. computes, reading other programs' outputs with `.cg` loads (from L2, never a stale L1 line);
4. stores, then after a barrier adds one to its counter with release semantics.
ATTN items also take a ticket on their kv head's counter after storing their partial; the one that
takes the last merges the head's splits in split order (deterministic) and signals.

`epoch` (a device int32) is read by every program at its start; the last program to finish
(a done counter reaching P * (epoch + 1)) advances it, so counters never need a reset launch and
the step is one launch, capturable in a CUDA graph and replayed as is.

The GEMV tiles and the attention follow the graphed step's kernels (`declab_kernels.gemv`, the paged
decode kernel's "long" variant) in what they round and where: the fused RMSNorm scales the products
by 1/rms after the K loop, residual adds round the product to the weight dtype first, SwiGLU rounds
as its unfused pair, q and k are rotated in float32 and rounded to their dtypes.

Per-layer weights come through a pointer table [L, 6] int64 (qkv, o, gate/up, down, input norm,
post-attention norm), so the model's tensors are used where they are, with no stacked copy.

A wait gives up after MAX_POLLS polls (seconds: far beyond any step) and sets `stall_ptr`, so a
broken dependency shows as a flag and wrong logits instead of a GPU that never returns.

Constexpr debug aids (GPU only, off by default): DELAY > 0 makes every item spin a pseudo-random
0..DELAY ns before its wait (the stress test for a missing dependency); TIMELINE writes
globaltimer stamps per item (start, wait over, end) and the SM id into `time_ptr` [n_items, 4].
"""

import triton
import triton.language as tl

from declab_kernels.persistent_step import schedule

# The stage codes of the work list, as constexprs (a kernel reads no other globals).
EMBED = tl.constexpr(schedule.EMBED)
QKV = tl.constexpr(schedule.QKV)
ATTN = tl.constexpr(schedule.ATTN)
O = tl.constexpr(schedule.O)
GU = tl.constexpr(schedule.GU)
DOWN = tl.constexpr(schedule.DOWN)
HEAD = tl.constexpr(schedule.HEAD)


@triton.jit
def _wait(cnt_ptr, idx, target, stamp_ptr, TIMELINE: tl.constexpr, stall_ptr, MAX_POLLS: tl.constexpr):
    """Spin until counter `idx` holds at least `target` (idx < 0: no wait); TIMELINE: stamp when it does.
    After MAX_POLLS polls (seconds) it gives up and sets the stall flag, and every wait gives up at once
    while the flag is set: a broken list or a program that is not resident makes wrong logits and a
    flag the host can read, not a hung GPU."""
    if idx >= 0:
        seen = tl.atomic_add(cnt_ptr + idx, 0, sem="acquire")
        stalled = tl.load(stall_ptr, volatile=True)
        polls = 0
        while (seen < target) & (polls < MAX_POLLS) & (stalled == 0):
            seen = tl.atomic_add(cnt_ptr + idx, 0, sem="acquire")
            stalled = tl.load(stall_ptr, volatile=True)
            polls += 1
        if (seen < target) & (stalled == 0):
            tl.atomic_or(stall_ptr, 1)
    if TIMELINE:
        tl.store(stamp_ptr, tl.extra.cuda.globaltimer())


@triton.jit
def _signal(cnt_ptr, idx):
    """Publish this program's stores: every thread's stores are issued before one thread's release add."""
    tl.debug_barrier()
    if idx >= 0:
        tl.atomic_add(cnt_ptr + idx, 1, sem="release")


@triton.jit
def _delay(seed, DELAY: tl.constexpr):
    """Spin a pseudo-random 0..DELAY ns (GPU only; DELAY 0 compiles to nothing)."""
    if DELAY > 0:
        wait_ns = ((seed.to(tl.int64) * 2654435761) & 0x7FFFFFFF) % DELAY
        t0 = tl.extra.cuda.globaltimer()
        while tl.extra.cuda.globaltimer() - t0 < wait_ns:
            pass


@triton.jit
def _weights(tab_ptr, layer, j, like_ptr, WIDTH: tl.constexpr = 6):
    """Pointer j of layer `layer`'s row of the pointer table (WIDTH pointers a layer), typed as
    `like_ptr` (16-byte aligned)."""
    p = tl.load(tab_ptr + layer * WIDTH + j).to(tl.pointer_type(like_ptr.dtype.element_ty))
    return tl.multiple_of(p, 16)


@triton.jit
def _item(row, i, epoch, n_items, time_ptr, TIMELINE: tl.constexpr):
    """Work item i's fields (its row of the list: stage, layer, tile, wait counter, wait target per
    step, signal counter), the target scaled to this step (epoch + 1 steps so far), its delay seed and
    the timeline slot of its wait's end; the item's start stamped when TIMELINE."""
    if TIMELINE:
        tl.store(time_ptr + i * 4, tl.extra.cuda.globaltimer())
    target = tl.load(row + 4) * (epoch + 1)
    return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), target, tl.load(row + 5), i + epoch * n_items, time_ptr + i * 4 + 1


@triton.jit
def _skip_met(wait_idx, target, met_idx, met_target):
    """The wait of an item, -1 (none) when this program's last wait already saw that counter reach at least the
    target (counters only grow, and that acquire ordered all this program's later reads after the producers'
    stores), and the (counter, target) met after it: a run of items of one stage on a program polls once."""
    met = (wait_idx == met_idx) & (target <= met_target)
    return (tl.where(met, -1, wait_idx), tl.where(wait_idx >= 0, wait_idx, met_idx),
            tl.where((wait_idx >= 0) & (wait_idx != met_idx), target, tl.maximum(target, met_target)))


@triton.jit
def _step_start(epoch_ptr):
    """This program's id, the program count, the epoch and the steps so far counting this one."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    epoch = tl.load(epoch_ptr)
    return pid, n_prog, epoch, epoch + 1


@triton.jit
def _item_end(time_ptr, i, TIMELINE: tl.constexpr):
    """TIMELINE: item i's end stamp and its SM id."""
    if TIMELINE:
        tl.store(time_ptr + i * 4 + 2, tl.extra.cuda.globaltimer())
        tl.store(time_ptr + i * 4 + 3, tl.extra.cuda.smid().to(tl.int64))


@triton.jit
def _step_end(done_ptr, epoch_ptr, n_prog, steps):
    """The last program to finish advances the epoch; every program read it at its start, before its done add."""
    tl.debug_barrier()
    done = tl.atomic_add(done_ptr, 1, sem="acq_rel")
    if done == n_prog * steps - 1:
        tl.atomic_add(epoch_ptr, 1, sem="release")


@triton.jit
def _embed_item(embed_ptr, tokens_ptr, x_ptr, D_MODEL: tl.constexpr, EMBED_BLOCK: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr):
    """x = embed[token], converted to x's dtype (no wait: TIMELINE stamps its end as the wait's)."""
    token = tl.load(tokens_ptr).to(tl.int64)
    for c0 in tl.static_range(0, D_MODEL, EMBED_BLOCK):
        c = c0 + tl.arange(0, EMBED_BLOCK)
        tl.store(x_ptr + c, tl.load(embed_ptr + token * D_MODEL + c, mask=c < D_MODEL), mask=c < D_MODEL)
    if TIMELINE:
        tl.store(stamp_ptr, tl.extra.cuda.globaltimer())


@triton.jit
def _pairs(ptr, rows, row_len: tl.constexpr, j, EVICT: tl.constexpr, CG: tl.constexpr):
    """Column pairs j (columns 2j and 2j + 1; every j < row_len / 2) of rows `rows` of a [*, row_len] matrix, as
    loaded: one 32-bit word a pair for a 16-bit dtype, the two columns for float32 (`_unpack` makes float32 of
    both). Why words, and no mask: a loop that carries loaded 16-bit values carries them as halves, and a masked
    load as a select; the moves that split or select them at the loop's end wait for the load just issued, while
    a word loaded whole into its register stays in flight across the loop's back edge."""
    if ptr.dtype.element_ty.primitive_bitwidth == 16:
        words = tl.multiple_of(ptr.to(tl.pointer_type(tl.int32), bitcast=True), 16) + rows * (row_len // 2) + j
        if EVICT:
            lo = tl.load(words, eviction_policy="evict_first")
        elif CG:
            lo = tl.load(words, cache_modifier=".cg")
        else:
            lo = tl.load(words)
        hi = lo
    else:
        cols = ptr + rows * row_len + 2 * j
        if EVICT:
            lo = tl.load(cols, eviction_policy="evict_first")
            hi = tl.load(cols + 1, eviction_policy="evict_first")
        elif CG:
            lo = tl.load(cols, cache_modifier=".cg")
            hi = tl.load(cols + 1, cache_modifier=".cg")
        else:
            lo = tl.load(cols)
            hi = tl.load(cols + 1)
    return lo, hi


@triton.jit
def _unpack(lo, hi, like_ptr):
    """The float32 values of a pair `_pairs` loaded from a matrix of like_ptr's dtype."""
    dt = like_ptr.dtype.element_ty
    if dt == tl.bfloat16:
        return (lo << 16).to(tl.float32, bitcast=True), (lo & -65536).to(tl.float32, bitcast=True)
    elif dt == tl.float16:
        return ((lo & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                (lo >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))
    else:
        return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _in_row(j0, offs_j, K: tl.constexpr, BJ: tl.constexpr):
    """Pair indices j0 + offs_j of a chunk, clamped into the row of K // 2 pairs (`_chunk_products` zeroes the
    activation past K, so a clamped pair adds nothing). When whole chunks tile the row, only chunks wholly past it
    (the loop's last loads ahead) are clamped, as a block, so the loads stay vectorised."""
    if (K // 2) % BJ == 0:
        return tl.minimum(j0, K // 2 - BJ) + offs_j
    else:
        return tl.minimum(j0 + offs_j, K // 2 - 1)


@triton.jit
def _weight_pairs(w_ptr, w_rows, j0, offs_j, K: tl.constexpr, BJ: tl.constexpr):
    """Column pairs j0 + offs_j of the tile's weight rows (streamed once: evicted first)."""
    return _pairs(w_ptr, w_rows, K, _in_row(j0, offs_j, K, BJ)[None, :], True, False)


@triton.jit
def _act_pairs(x_ptr, nw_ptr, j0, offs_j, K: tl.constexpr, BJ: tl.constexpr, NORM: tl.constexpr):
    """Column pairs j0 + offs_j of the activation (from L2: other programs wrote it) and, with NORM, of the norm
    weight (without: the activation's again, so the loop carries one tuple whatever the stage)."""
    j = _in_row(j0, offs_j, K, BJ)
    x_lo, x_hi = _pairs(x_ptr, 0, K, j, False, True)
    if NORM:
        n_lo, n_hi = _pairs(nw_ptr, 0, K, j, False, False)
    else:
        n_lo, n_hi = x_lo, x_hi
    return x_lo, x_hi, n_lo, n_hi


@triton.jit
def _prep(xt, nw, ss, w_ptr, NORM: tl.constexpr, ROUND_NORMED: tl.constexpr, SQRELU: tl.constexpr):
    """One column of the activation as the stage multiplies it (normed, rounded, squared ReLU), and ss += x^2 with NORM."""
    if NORM:
        ss += xt * xt
        xt = xt * nw
        if ROUND_NORMED:
            xt = xt.to(w_ptr.dtype.element_ty).to(tl.float32)
    if SQRELU:
        xt = tl.maximum(xt, 0.0)
        xt = (xt * xt).to(w_ptr.dtype.element_ty).to(tl.float32)
    return xt, ss


@triton.jit
def _chunk_products(acc, ss, j, K: tl.constexpr, w_lo, w_hi, x_lo, x_hi, n_lo, n_hi, w_ptr, x_ptr, nw_ptr, NORM: tl.constexpr,
                    ROUND_NORMED: tl.constexpr, SQRELU: tl.constexpr):
    """acc += w x over the column pairs j of one chunk (acc [BN, BK / 2]), the activation zero past K; ss += x^2 with NORM."""
    inside = j < K // 2
    wl, wh = _unpack(w_lo, w_hi, w_ptr)
    xl, xh = _unpack(x_lo, x_hi, x_ptr)
    nl, nh = _unpack(n_lo, n_hi, nw_ptr)
    xl, ss = _prep(tl.where(inside, xl, 0.0), nl, ss, w_ptr, NORM, ROUND_NORMED, SQRELU)
    xh, ss = _prep(tl.where(inside, xh, 0.0), nh, ss, w_ptr, NORM, ROUND_NORMED, SQRELU)
    return acc + wl * xl[None, :] + wh * xh[None, :], ss


@triton.jit
def _gemv_item(w_ptr, N, K: tl.constexpr, tile, x_ptr, nw_ptr, eps, r_ptr, out_ptr, cnt_ptr, wait_idx, target, seed,
               BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
               DELAY: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr, stall_ptr, MAX_POLLS: tl.constexpr,
               ss_ptr=None, SS_N: tl.constexpr = 0, SS_PAD: tl.constexpr = 1, ROUND_NORMED: tl.constexpr = False,
               SQRELU: tl.constexpr = False):
    """Tile `tile` of out = x @ W^T, W [N, K]: BN weight rows; NORM: x is rmsnorm'd with weight nw;
    RESIDUAL: out = r + product (r and out may be the same rows); SWIGLU: W is [gate; up] and the tile
    takes gate and up rows of the same BN / 2 outputs, out = silu(gate) * up. SS_N > 0: x is g * norm
    weight of a norm whose statistics earlier items wrote, ss [SS_N] float32 partial sums of g^2, and
    the products are scaled by rsqrt(sum(ss) / K + eps) (`declab_kernels.gemv.fusions.RMSScale`).
    ROUND_NORMED (with NORM): x * nw is rounded to the weight dtype before its products, as a graphed
    step that stores h = x * nw for a GEMV with `RMSScale` rounds it. SQRELU: x is relu(x)^2 rounded to the
    weight dtype (`declab_kernels.gemv.fusions.SqReLU`)."""
    r = tl.arange(0, BN)
    if SWIGLU:
        j = tile * (BN // 2) + r // 2
        rows = j + (r % 2) * (N // 2)
        n_mask = j < N // 2
    else:
        rows = tile * BN + r
        n_mask = rows < N
    BJ: tl.constexpr = BK // 2
    offs_j = tl.arange(0, BJ)
    # Rows past N load row N - 1 (their results are never stored): no load in the K loop has a mask.
    w_rows = tl.minimum(rows, N - 1)[:, None].to(tl.int64)
    # The first two chunks are this step's own weights: loaded before the wait, in flight while it spins.
    wa_lo, wa_hi = _weight_pairs(w_ptr, w_rows, 0, offs_j, K, BJ)
    wb_lo, wb_hi = _weight_pairs(w_ptr, w_rows, BJ, offs_j, K, BJ)
    _delay(seed, DELAY)
    _wait(cnt_ptr, wait_idx, target, stamp_ptr, TIMELINE, stall_ptr, MAX_POLLS)
    xa_lo, xa_hi, na_lo, na_hi = _act_pairs(x_ptr, nw_ptr, 0, offs_j, K, BJ, NORM)
    xb_lo, xb_hi, nb_lo, nb_hi = _act_pairs(x_ptr, nw_ptr, BJ, offs_j, K, BJ, NORM)
    acc = tl.zeros((BN, BJ), dtype=tl.float32)
    ss = tl.zeros((BJ,), dtype=tl.float32)
    # Two chunks an iteration, each buffer reloaded in place right after its products: no register is
    # copied into another (a rotation w = w_next = w_after compiles to moves that wait for the load just
    # issued), so both chunks' loads stay in flight while the other's products run.
    for j0 in range(0, K // 2, 2 * BJ):
        acc, ss = _chunk_products(acc, ss, j0 + offs_j, K, wa_lo, wa_hi, xa_lo, xa_hi, na_lo, na_hi, w_ptr, x_ptr, nw_ptr, NORM,
                                  ROUND_NORMED, SQRELU)
        wa_lo, wa_hi = _weight_pairs(w_ptr, w_rows, j0 + 2 * BJ, offs_j, K, BJ)
        xa_lo, xa_hi, na_lo, na_hi = _act_pairs(x_ptr, nw_ptr, j0 + 2 * BJ, offs_j, K, BJ, NORM)
        acc, ss = _chunk_products(acc, ss, j0 + BJ + offs_j, K, wb_lo, wb_hi, xb_lo, xb_hi, nb_lo, nb_hi, w_ptr, x_ptr, nw_ptr, NORM,
                                  ROUND_NORMED, SQRELU)
        wb_lo, wb_hi = _weight_pairs(w_ptr, w_rows, j0 + 3 * BJ, offs_j, K, BJ)
        xb_lo, xb_hi, nb_lo, nb_hi = _act_pairs(x_ptr, nw_ptr, j0 + 3 * BJ, offs_j, K, BJ, NORM)
    res = tl.sum(acc, axis=1)
    if NORM:
        res = res * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    if SS_N > 0:
        s_i = tl.arange(0, SS_PAD)
        parts = tl.load(ss_ptr + s_i, mask=s_i < SS_N, other=0.0, cache_modifier=".cg")
        res = res * tl.rsqrt(tl.sum(parts, axis=0) / K + eps)
    dt = out_ptr.dtype.element_ty
    if SWIGLU:
        gate, up = tl.split(tl.reshape(res, (BN // 2, 2)))
        gate = gate.to(dt).to(tl.float32)
        up = up.to(dt).to(tl.float32)
        y = ((gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up).to(dt)
        oj = tile * (BN // 2) + tl.arange(0, BN // 2)
        tl.store(out_ptr + oj, y, mask=oj < N // 2)
    elif RESIDUAL:
        rv = tl.load(r_ptr + rows, mask=n_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + rows, (rv + res.to(w_ptr.dtype.element_ty).to(tl.float32)).to(dt), mask=n_mask)
    else:
        tl.store(out_ptr + rows, res.to(dt), mask=n_mask)


@triton.jit
def _attn_item(layer, tile, qkv_ptr, attn_ptr, lse_ptr, part_ptr, k_ptr, v_ptr, bt_ptr, cos_ptr, sin_ptr, seq_len,
               stride_kl, stride_kb, stride_kt, stride_kh, stride_cos, qk_scale, num_splits,
               cnt_ptr, wait_idx, target, signal_idx, ticket_idx, ticket_target, seed,
               HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, G: tl.constexpr,
               G_PAD: tl.constexpr, G_R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
               TILE: tl.constexpr, S_PAD: tl.constexpr, CHUNK: tl.constexpr, DELAY: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr,
               stall_ptr, MAX_POLLS: tl.constexpr):
    """Split `tile % num_splits` of kv head `tile // num_splits`: RoPE on q (and, in the split holding
    the step's position, on k, written with v into the cache), the split's online softmax over its
    keys into a partial, then a ticket; the last ticket's taker merges the head's partials into attn.
    The splits are cut at BLOCK_N keys (the graphed step's tiles, so both cut the keys alike); a split
    walks its keys TILE at a time (fewer registers: one program holds every stage's code)."""
    hk = tile // num_splits
    split = tile % num_splits
    # Splits as the paged decode kernel cuts them: equal runs of whole BLOCK_N-key tiles.
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(n_tiles, num_splits), 1)
    n_valid = tl.cdiv(n_tiles, tiles_per_split)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    p_new = seq_len - 1
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    dmask = d < D
    heads = hk * G + g
    qmask = (g[:, None] < G) & dmask[None, :]
    k_base = k_ptr + layer.to(tl.int64) * stride_kl
    v_base = v_ptr + layer.to(tl.int64) * stride_kl
    # The split's first K/V tile was written by earlier steps (the step's own row is patched in
    # below): loaded before the wait.
    pos = start + tl.arange(0, TILE)
    valid = pos < end
    page = tl.load(bt_ptr + pos // PAGE, mask=valid, other=0).to(tl.int64)
    kv_off = page * stride_kb + (pos % PAGE) * stride_kt + hk * stride_kh
    kvmask = valid[:, None] & dmask[None, :]
    k_t = tl.load(k_base + kv_off[:, None] + d[None, :], mask=kvmask, other=0.0)
    v_t = tl.load(v_base + kv_off[:, None] + d[None, :], mask=kvmask, other=0.0)
    _delay(seed, DELAY)
    _wait(cnt_ptr, wait_idx, target, stamp_ptr, TIMELINE, stall_ptr, MAX_POLLS)
    lse_head = lse_ptr + hk * G * num_splits
    part_head = part_ptr + hk * G * num_splits * D_PAD
    if start < end:
        HALF: tl.constexpr = D // 2
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        cos = tl.load(cos_ptr + p_new * stride_cos + d % HALF, mask=dmask, other=0.0)
        # [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]: the partner half times -sin, then +sin
        sin = tl.load(sin_ptr + p_new * stride_cos + d % HALF, mask=dmask, other=0.0) * tl.where(d < HALF, -1.0, 1.0)
        q = tl.load(qkv_ptr + heads[:, None] * D + d[None, :], mask=qmask, other=0.0, cache_modifier=".cg")
        q_p = tl.load(qkv_ptr + heads[:, None] * D + partner[None, :], mask=qmask, other=0.0, cache_modifier=".cg")
        q = (q.to(tl.float32) * cos[None, :] + q_p.to(tl.float32) * sin[None, :]).to(q.dtype)
        k_row = qkv_ptr + (HQ + hk) * D
        k_a = tl.load(k_row + d, mask=dmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        k_b = tl.load(k_row + partner, mask=dmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        k_new = (k_a * cos + k_b * sin).to(k_ptr.dtype.element_ty)
        v_new = tl.load(qkv_ptr + (HQ + HKV + hk) * D + d, mask=dmask, other=0.0, cache_modifier=".cg").to(v_ptr.dtype.element_ty)
        if end == seq_len:
            page_new = tl.load(bt_ptr + p_new // PAGE).to(tl.int64)
            row_new = page_new * stride_kb + (p_new % PAGE) * stride_kt + hk * stride_kh
            tl.store(k_base + row_new + d, k_new, mask=dmask)
            tl.store(v_base + row_new + d, v_new, mask=dmask)
        # The later tiles are loaded after this barrier and see the new row; the first, loaded
        # before it, takes the row from registers.
        tl.debug_barrier()
        is_new = (pos == p_new)[:, None]
        k_t = tl.where(is_new, k_new[None, :], k_t)
        v_t = tl.where(is_new, v_new[None, :], v_t)
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        for n0 in range(start, end, TILE):
            k = k_t
            v = v_t
            cur_valid = (n0 + tl.arange(0, TILE)) < end
            # why: the next tile's loads go out before this tile's softmax
            nxt = n0 + TILE + tl.arange(0, TILE)
            nxt_valid = nxt < end
            nxt_page = tl.load(bt_ptr + nxt // PAGE, mask=nxt_valid, other=0).to(tl.int64)
            nxt_off = nxt_page * stride_kb + (nxt % PAGE) * stride_kt + hk * stride_kh
            nxt_mask = nxt_valid[:, None] & dmask[None, :]
            k_t = tl.load(k_base + nxt_off[:, None] + d[None, :], mask=nxt_mask, other=0.0)
            v_t = tl.load(v_base + nxt_off[:, None] + d[None, :], mask=nxt_mask, other=0.0)
            # [G_PAD, TILE] scores in log2 units
            qk = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
            qk = tl.where(cur_valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            m_i = m_new
        gmask = g < G
        tl.store(lse_head + g * num_splits + split, m_i + tl.log2(l_i), mask=gmask)
        tl.store(part_head + (g[:, None] * num_splits + split) * D_PAD + d[None, :], acc / l_i[:, None], mask=gmask[:, None])
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + ticket_idx, 1, sem="acq_rel")
    if ticket == ticket_target - 1:
        # The last split of this kv head merges all n_valid partials in split order:
        # out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M).
        gr = tl.arange(0, G_R)
        gr_ok = gr < G
        sp = tl.arange(0, S_PAD)
        sp_mask = gr_ok[:, None] & (sp[None, :] < n_valid)
        lse_all = tl.load(lse_head + gr[:, None] * num_splits + sp[None, :], mask=sp_mask, other=float("-inf"),
                          cache_modifier=".cg")
        # Padding head rows get weight 1 on zero partials instead of NaN from -inf - -inf.
        lse_all = tl.where(gr_ok[:, None], lse_all, 0.0)
        m_run = tl.max(lse_all, 1)
        den = tl.sum(tl.exp2(lse_all - m_run[:, None]), 1)
        red = tl.zeros([G_R, D_PAD], dtype=tl.float32)
        sc = tl.arange(0, CHUNK)
        for c in tl.static_range(0, S_PAD, CHUNK):
            s = c + sc
            smask = gr_ok[:, None] & (s[None, :] < n_valid)
            lse = tl.load(lse_head + gr[:, None] * num_splits + s[None, :], mask=smask, other=float("-inf"),
                          cache_modifier=".cg")
            w = tl.exp2(tl.where(gr_ok[:, None], lse, 0.0) - m_run[:, None])
            # [G_R, CHUNK, D_PAD]
            part = tl.load(part_head + (gr[:, None, None] * num_splits + s[None, :, None]) * D_PAD + d[None, None, :],
                           mask=smask[:, :, None], other=0.0, cache_modifier=".cg")
            red += tl.sum(w[:, :, None] * part, 1)
        out = attn_ptr + (hk * G + gr)[:, None] * D + d[None, :]
        tl.store(out, (red / den[:, None]).to(attn_ptr.dtype.element_ty), mask=gr_ok[:, None] & dmask[None, :])
        _signal(cnt_ptr, signal_idx)


@triton.jit
def persistent_step_kernel(
    items_ptr, n_items, cnt_ptr, epoch_ptr, done_ptr, tab_ptr,
    embed_ptr, head_ptr, final_norm_ptr, tokens_ptr, positions_ptr,
    x_ptr, qkv_ptr, attn_ptr, act_ptr, lse_ptr, part_ptr, logits_ptr,
    k_ptr, v_ptr, bt_ptr, cos_ptr, sin_ptr,
    stride_kl, stride_kb, stride_kt, stride_kh, stride_cos,
    eps, qk_scale, num_splits, time_ptr, stall_ptr,
    D_MODEL: tl.constexpr, INTER: tl.constexpr, VOCAB: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, G_R: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr, S_PAD: tl.constexpr, CHUNK: tl.constexpr,
    BN_QKV: tl.constexpr, BK_QKV: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
    BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_DOWN: tl.constexpr, BK_DOWN: tl.constexpr,
    BN_HEAD: tl.constexpr, BK_HEAD: tl.constexpr, EMBED_BLOCK: tl.constexpr,
    DELAY: tl.constexpr = 0, TIMELINE: tl.constexpr = False, MAX_POLLS: tl.constexpr = 1 << 22,
):
    pid, n_prog, epoch, steps = _step_start(epoch_ptr)
    seq_len = (tl.load(positions_ptr) + 1).to(tl.int32)
    N_QKV: tl.constexpr = (HQ + 2 * HKV) * D
    met_idx = -1
    met_target = 0
    for i in range(pid, n_items, n_prog):
        row = items_ptr + i * 8
        stage, layer, tile, wait_idx, target, signal_idx, seed, stamp = _item(row, i, epoch, n_items, time_ptr, TIMELINE)
        wait_idx, met_idx, met_target = _skip_met(wait_idx, target, met_idx, met_target)
        if stage == EMBED:
            _embed_item(embed_ptr, tokens_ptr, x_ptr, D_MODEL, EMBED_BLOCK, stamp, TIMELINE)
            _signal(cnt_ptr, signal_idx)
        elif stage == QKV:
            _gemv_item(_weights(tab_ptr, layer, 0, embed_ptr), N_QKV, D_MODEL, tile, x_ptr, _weights(tab_ptr, layer, 4, embed_ptr),
                       eps, x_ptr, qkv_ptr, cnt_ptr, wait_idx, target, seed, BN_QKV, BK_QKV, True, False, False, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            _signal(cnt_ptr, signal_idx)
        elif stage == ATTN:
            _attn_item(layer, tile, qkv_ptr, attn_ptr, lse_ptr, part_ptr, k_ptr, v_ptr, bt_ptr, cos_ptr, sin_ptr, seq_len,
                       stride_kl, stride_kb, stride_kt, stride_kh, stride_cos, qk_scale, num_splits,
                       cnt_ptr, wait_idx, target, signal_idx, tl.load(row + 6), tl.load(row + 7) * steps, seed,
                       HQ, HKV, D, D_PAD, G, G_PAD, G_R, PAGE, BLOCK_N, TILE, S_PAD, CHUNK, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
        elif stage == O:
            _gemv_item(_weights(tab_ptr, layer, 1, embed_ptr), D_MODEL, HQ * D, tile, attn_ptr, attn_ptr, eps, x_ptr, x_ptr,
                       cnt_ptr, wait_idx, target, seed, BN_O, BK_O, False, True, False, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            _signal(cnt_ptr, signal_idx)
        elif stage == GU:
            _gemv_item(_weights(tab_ptr, layer, 2, embed_ptr), 2 * INTER, D_MODEL, tile, x_ptr, _weights(tab_ptr, layer, 5, embed_ptr),
                       eps, x_ptr, act_ptr, cnt_ptr, wait_idx, target, seed, BN_GU, BK_GU, True, False, True, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            _signal(cnt_ptr, signal_idx)
        elif stage == DOWN:
            _gemv_item(_weights(tab_ptr, layer, 3, embed_ptr), D_MODEL, INTER, tile, act_ptr, act_ptr, eps, x_ptr, x_ptr,
                       cnt_ptr, wait_idx, target, seed, BN_DOWN, BK_DOWN, False, True, False, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
            _signal(cnt_ptr, signal_idx)
        elif stage == HEAD:
            _gemv_item(head_ptr, VOCAB, D_MODEL, tile, x_ptr, final_norm_ptr, eps, x_ptr, logits_ptr,
                       cnt_ptr, wait_idx, target, seed, BN_HEAD, BK_HEAD, True, False, False, DELAY, stamp, TIMELINE, stall_ptr, MAX_POLLS)
        _item_end(time_ptr, i, TIMELINE)
    _step_end(done_ptr, epoch_ptr, n_prog, steps)
