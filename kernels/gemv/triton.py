"""Small-batch GEMV in Triton: y = x @ W^T for a few rows of x, W streamed once.

One kernel, `_gemv_kernel`, grid `(cdiv(N, BLOCK_N), SPLIT_K, G)`. Program (n, s, g) owns BLOCK_N
rows of W_g (contiguous in K) for all M rows of x_g and the s-th of SPLIT_K equal runs of whole
BLOCK_K tiles of K, accumulating in float32. Two ways to multiply a tile (constexpr `DOT`):
- FMA: elementwise products kept unreduced in a `[BLOCK_M, BLOCK_N, BLOCK_K]` float32 accumulator,
  one reduction over K after the loop (no cross-thread work inside the loop);
- DOT: `tl.dot` of the x tile (M padded to 16) with the W tile transposed, the loads pipelined
  through shared memory.
SPLIT_K > 1: each program stores its float32 partial to a workspace `[SPLIT_K, G, M, N]`, takes a
ticket from a per-(g, n-block) int32 counter; the last one sums the SPLIT_K partials in split order
(deterministic), writes the output and sets the counter back to 0. One launch, no host sync, the
workspace has a fixed size and is zero again after every call: CUDA-graph safe.

Base offsets are int64 (G * N * K can pass 2^31); in-tile offsets stay int32.

PDL (constexpr, `kernels.pdl`, launched with launch_pdl): every program calls
gdc_launch_dependents() first, loads its first W tiles (FMA: PDL_TILES, 1 or 2; DOT: one),
then gdc_wait() (the previous kernel has finished and its writes are visible) before it reads x or
writes anything; the K loop runs over the remaining tiles. Without PDL the kernel is unchanged.

NORM (constexpr; `gemv_triton(..., norm=(z, norm_weight, eps))`, G == 1, one group of K channels):
x is gated_rmsnorm(y, z) with y = x. Every program first computes each row's rstd over the whole
row (split-K included; after gdc_wait with PDL), then rebuilds each x tile from y, z and the norm
weight of its columns. NORM=False compiles as before.

ACT (constexpr; `gemv_triton(..., act="sqrelu")`, G == 1): x is relu(input)^2, computed as each x
tile is loaded (no statistics, so no extra pass).

SWIGLU (constexpr; `gemv_triton(..., swiglu=True)`, G == 1): W is [gate; up] (N = 2I rows) and the
output is silu(x @ gate^T) * (x @ up^T) [M, I]. Program n takes gate and up rows of the same BLOCK_N
/ 2 outputs (interleaved as its local rows), so the epilogue computes each output once from its two
products.
"""

import os

import torch
import triton
import triton.language as tl

from kernels import pdl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Keyword names of a configuration, in the order `config_name` prints them.
META = ("DOT", "BLOCK_N", "BLOCK_K", "SPLIT_K", "LOOP_STAGES")


def _cfg(dot, bn, bk, sk, warps, stages, loop=None):
    meta = {"DOT": dot, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "LOOP_STAGES": loop}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


# Candidate configurations. The first is the interpreter's (it cannot autotune over several) and the
# fallback when pruning leaves nothing. FMA tiles are loaded straight into registers (bytes in flight
# come from many resident programs) unless LOOP_STAGES is set: then Triton pipelines them through
# shared memory with cp.async, LOOP_STAGES - 1 tiles ahead (it only does that for loads that feed no
# tl.dot when the loop asks). DOT loops are pipelined by num_stages. FMA accumulators take
# M_pad * BLOCK_N * BLOCK_K / (32 warps) registers a thread: `config_fits` keeps an FMA config only
# while that is <= 64.
CONFIGS = [
    _cfg(False, 4, 1024, 1, 4, 3),       # M=1: 8 KB tiles, 512 programs at N=2048
    _cfg(False, 4, 1024, 1, 4, 3, 3),    # the same, two tiles ahead through shared memory
    _cfg(False, 8, 512, 1, 4, 3, 3),
    _cfg(False, 4, 2048, 1, 8, 3),       # M=1, long K: 16 KB tiles, half the serial tiles a program
    _cfg(False, 16, 512, 1, 8, 3),       # M=1, large N: 16 KB tiles
    _cfg(False, 16, 512, 1, 8, 3, 3),
    _cfg(False, 4, 1024, 2, 4, 3, 3),    # M=1, long K: two splits
    _cfg(False, 4, 1024, 4, 4, 3),       # M=1, long K: four splits
    _cfg(False, 4, 256, 1, 4, 3, 4),     # M <= 8: 2 KB tiles, 8 * M accumulator registers
    _cfg(True, 16, 256, 1, 4, 4),        # M > 1: 8 KB of W a tile
    _cfg(True, 16, 256, 4, 4, 4),        # M > 1, few programs: four splits
    _cfg(True, 32, 256, 2, 4, 4),        # M > 1: 16 KB of W a tile, two splits
    _cfg(True, 64, 128, 1, 4, 4),        # M > 1, large N
]
MAX_SPLIT_K = max(c.kwargs["SPLIT_K"] for c in CONFIGS)
MIN_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in CONFIGS)
FMA_REGS = 64


def config_name(config) -> str:
    """Short label of a configuration: "fma n4 k1024 s1 w4 st3 p3" (p: LOOP_STAGES)."""
    kw = config.kwargs
    loop = f" p{kw['LOOP_STAGES']}" if kw.get("LOOP_STAGES") else ""
    return (f"{'dot' if kw['DOT'] else 'fma'} n{kw['BLOCK_N']} k{kw['BLOCK_K']} s{kw['SPLIT_K']} "
            f"w{config.num_warps} st{config.num_stages}{loop}")


def _m_pow2(M):
    return max(1, triton.next_power_of_2(M))


def config_fits(config, M, K) -> bool:
    """Whether `config` is a sensible candidate at M rows and depth K (used to prune autotuning)."""
    kw = config.kwargs
    if not kw["DOT"] and _m_pow2(M) * kw["BLOCK_N"] * kw["BLOCK_K"] > FMA_REGS * 32 * config.num_warps:
        return False
    # Every split gets at least one whole tile.
    return kw["SPLIT_K"] == 1 or kw["SPLIT_K"] * kw["BLOCK_K"] <= K


def _prune(configs, nargs, **kwargs):
    kept = [c for c in configs if config_fits(c, nargs["M"], nargs["K"])]
    return kept or configs[:1]


@triton.jit
def _gated_row_rstd(x_rows, z_rows, m_mask, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M] float32: 1 / rms(y * silu(z)) over the whole row (K channels, one group) of each row,
    y = x. Every program reads whole rows (split-K included), from L2."""
    offs_k = tl.arange(0, BLOCK_K)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask = m_mask[:, None] & (k < K)[None, :]
        y = tl.load(x_rows + k[None, :], mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        z = tl.load(z_rows + k[None, :], mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        h = y * z * tl.sigmoid(z)
        ss += tl.sum(h * h, axis=1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _gemv_tile(acc, w, x_rows, k, k_hi, m_mask, DOT: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr,
               NORM: tl.constexpr, z_rows, nw_ptr, rstd, ACT: tl.constexpr):
    """acc + the products of the W tile `w` (columns k) with the x tile of the same columns. With NORM
    the x tile is gated_rmsnorm(y, z) of those columns, y read from x_rows, rounded as the unfused
    pair rounds it: rmsnorm(y * silu(z)) to y's dtype, times the norm weight, to W's dtype. With ACT
    (1: sqrelu) it is relu(x)^2 of those columns, rounded to x's dtype as its own kernel rounds it."""
    xt = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < k_hi)[None, :], other=0.0,
                 eviction_policy="evict_last")
    if ACT == 1:
        relu = tl.maximum(xt.to(tl.float32), 0.0)
        xt = (relu * relu).to(xt.dtype)
    if NORM:
        zt = tl.load(z_rows + k[None, :], mask=m_mask[:, None] & (k < k_hi)[None, :], other=0.0,
                     eviction_policy="evict_last").to(tl.float32)
        nw = tl.load(nw_ptr + k, mask=k < k_hi, other=0.0, eviction_policy="evict_last").to(tl.float32)
        h = xt.to(tl.float32) * zt * tl.sigmoid(zt) * rstd[:, None]
        xt = (h.to(xt.dtype).to(tl.float32) * nw[None, :]).to(w.dtype)
    if DOT:
        acc += tl.dot(xt, tl.trans(w), input_precision=DOT_PREC)
    elif BLOCK_M == 1:
        acc += w.to(tl.float32) * xt.to(tl.float32)
    else:
        acc += w.to(tl.float32)[None, :, :] * xt.to(tl.float32)[:, None, :]
    return acc


@triton.jit
def _store_out(res, out_rows, offs_n, pid_n, o_mask, m_mask, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SWIGLU: tl.constexpr):
    """Write the float32 products `res` [BLOCK_M, BLOCK_N] of the weight rows offs_n. With SWIGLU (the
    rows are gate and up pairs) write silu(gate) * up [BLOCK_M, BLOCK_N / 2] instead, rounded as the
    unfused pair rounds it: both products to the output dtype, silu(gate) to it, the product to it."""
    dt = out_rows.dtype.element_ty
    if SWIGLU:
        gate, up = tl.split(tl.reshape(res, (BLOCK_M, BLOCK_N // 2, 2)))
        gate = gate.to(dt).to(tl.float32)
        up = up.to(dt).to(tl.float32)
        y = ((gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up).to(dt)
        oj = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_rows + oj[None, :], y, mask=m_mask[:, None] & (oj < N // 2)[None, :])
    else:
        tl.store(out_rows + offs_n[None, :], res.to(dt), mask=o_mask)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, G,
    stride_xg, stride_xm, stride_wg, stride_wn, stride_bg, stride_og, stride_om,
    z_ptr, nw_ptr, stride_zm, eps,
    M_POW2: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
    DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr = None, PDL: tl.constexpr = False, PDL_TILES: tl.constexpr = 1,
    NORM: tl.constexpr = False, ACT: tl.constexpr = 0, SWIGLU: tl.constexpr = False,
):
    # tl.dot needs at least 16 rows: x is padded with masked (zero) rows.
    BLOCK_M: tl.constexpr = 16 if DOT and M_POW2 < 16 else M_POW2
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    if SWIGLU:
        # W is [gate; up] (N = 2I rows): local rows 2j and 2j + 1 are gate and up row j of this
        # program's BLOCK_N / 2 outputs, so the epilogue has both halves of each output at hand.
        r = tl.arange(0, BLOCK_N)
        j = pid_n * (BLOCK_N // 2) + r // 2
        offs_n = j + (r % 2) * (N // 2)
        n_mask = j < N // 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        # Split s owns whole tiles [s * per, (s + 1) * per); a split past the end runs no iteration.
        per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = pid_k * per
        k_hi = tl.minimum(K, k_lo + per)
    x_rows = x_ptr + g * stride_xg + offs_m[:, None] * stride_xm
    w_rows = w_ptr + g * stride_wg + offs_n[:, None].to(tl.int64) * stride_wn
    if DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    # NORM (G == 1, one group of K channels): x is gated_rmsnorm(y = x, z) with the norm weight nw.
    z_rows = z_ptr + offs_m[:, None] * stride_zm
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM and not PDL:
        rstd = _gated_row_rstd(x_rows, z_rows, m_mask, K, eps, BLOCK_M, BLOCK_K)
    k_start = k_lo
    if PDL:
        # Programmatic dependent launch: let the next kernel's programs launch now, fetch the first
        # weight tiles (no kernel of a decode step writes a weight) while the previous kernel is
        # still finishing, and only then wait for it: x, the output, the split-K partials and
        # counters are all touched after the wait. FMA: PDL_TILES tiles (a second costs +0..8
        # registers; where it pays, see `gemv_triton`'s early_tiles). DOT: one,
        # its tile is held in the mma operand layout, ~45 registers more a tile (kept at the
        # occupancy shared memory already allows), where two would halve the resident programs.
        PEEL: tl.constexpr = 1 if DOT else PDL_TILES
        tl.extra.cuda.gdc_launch_dependents()
        k_a = k_lo + offs_k
        k_b = k_a + BLOCK_K
        w_a = tl.load(w_rows + k_a[None, :], mask=n_mask[:, None] & (k_a < k_hi)[None, :], other=0.0,
                      eviction_policy="evict_first")
        if PEEL > 1:
            w_b = tl.load(w_rows + k_b[None, :], mask=n_mask[:, None] & (k_b < k_hi)[None, :], other=0.0,
                          eviction_policy="evict_first")
        tl.extra.cuda.gdc_wait()
        if NORM:
            rstd = _gated_row_rstd(x_rows, z_rows, m_mask, K, eps, BLOCK_M, BLOCK_K)
        acc = _gemv_tile(acc, w_a, x_rows, k_a, k_hi, m_mask, DOT, BLOCK_M, DOT_PREC,
                         NORM, z_rows, nw_ptr, rstd, ACT)
        if PEEL > 1:
            acc = _gemv_tile(acc, w_b, x_rows, k_b, k_hi, m_mask, DOT, BLOCK_M, DOT_PREC,
                             NORM, z_rows, nw_ptr, rstd, ACT)
        k_start = k_lo + PEEL * BLOCK_K
    for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=LOOP_STAGES):
        k = k0 + offs_k
        k_mask = k < k_hi
        # W is read once: evict it first so x and the outputs stay in L2.
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc = _gemv_tile(acc, w, x_rows, k, k_hi, m_mask, DOT, BLOCK_M, DOT_PREC,
                         NORM, z_rows, nw_ptr, rstd, ACT)
    if DOT:
        res = acc
    elif BLOCK_M == 1:
        res = tl.sum(acc, axis=1)[None, :]
    else:
        res = tl.sum(acc, axis=2)
    o_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            res += tl.load(b_ptr + g * stride_bg + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        _store_out(res, out_ptr + g * stride_og + offs_m[:, None] * stride_om, offs_n, pid_n, o_mask, m_mask, N,
                   BLOCK_M, BLOCK_N, SWIGLU)
    else:
        # Partials [SPLIT_K, G, M, N], float32.
        mn = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + (pid_k * G + g) * M * N + mn, res, mask=o_mask)
        # Every thread's partial stores are issued before one thread takes a ticket; acq_rel
        # publishes them to, and acquires the others' for, the program that takes the last one.
        tl.debug_barrier()
        cnt = cnt_ptr + g * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(cnt, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            tl.store(cnt, 0)
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            # In split order whoever is last, so the result does not depend on timing.
            for s in tl.static_range(SPLIT_K):
                # .cg reads from L2, where the other programs' stores landed.
                total += tl.load(part_ptr + (s * G + g) * M * N + mn, mask=o_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + g * stride_bg + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            _store_out(total, out_ptr + g * stride_og + offs_m[:, None] * stride_om, offs_n, pid_n, o_mask, m_mask, N,
                       BLOCK_M, BLOCK_N, SWIGLU)


def _autotune_bench(fn, quantiles):
    # About 30 ms a candidate (Triton's default is ~125 ms); do_bench clears L2 before every call.
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


_gemv_tuned = triton.autotune(
    configs=CONFIGS[:1] if INTERPRET else CONFIGS,
    key=["M", "N", "K", "G", "HAS_BIAS", "NORM", "ACT", "SWIGLU"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_autotune_bench,
)(_gemv_kernel)

# Per device: (partials, counters). A workspace that grows is replaced, the old one kept alive:
# a captured CUDA graph may still point at it.
_workspaces: dict = {}
_retired: list = []


def _workspace(device, n_part, n_cnt):
    """Float32 partials of >= n_part elements and >= n_cnt int32 counters, all zero, on `device`."""
    key = str(device)
    ws = _workspaces.get(key)
    if ws is None or ws[0].numel() < n_part or ws[1].numel() < n_cnt:
        if ws is not None:
            _retired.append(ws)
            n_part, n_cnt = max(n_part, ws[0].numel()), max(n_cnt, ws[1].numel())
        # Counters start at zero and every launch leaves them at zero; partials need no zeroing.
        ws = (torch.empty(max(n_part, 1), dtype=torch.float32, device=device),
              torch.zeros(max(n_cnt, 1), dtype=torch.int32, device=device))
        _workspaces[key] = ws
    return ws


def _as_config(config):
    if config is None or isinstance(config, triton.Config):
        return config
    if isinstance(config, dict):
        meta = {k: config.get(k) for k in META}
        return triton.Config(meta, num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 3))
    raise TypeError(f"gemv: config must be a triton.Config or a dict, got {type(config).__name__}")


def _check_norm(x, norm):
    """(z, norm weight, eps) for a NORM launch, checked: x [M, K], z [M, K], weight [K], one group."""
    if len(norm) not in (3, 4):
        raise ValueError("gemv: norm must be (z, norm_weight, eps) or (z, norm_weight, eps, group_size)")
    z, nw, eps = norm[:3]
    if x.dim() != 2:
        raise ValueError(f"gemv: the gated-norm prologue takes x [M, K], got {tuple(x.shape)}")
    K = x.shape[-1]
    group_size = norm[3] if len(norm) == 4 and norm[3] is not None else K
    if group_size != K:
        raise ValueError(f"gemv: the gated-norm prologue supports one group (group_size == K = {K}), "
                         f"got group_size {group_size}")
    if tuple(z.shape) != tuple(x.shape) or tuple(nw.shape) != (K,):
        raise ValueError(f"gemv: norm needs z {list(x.shape)} and weight [{K}], got {tuple(z.shape)} and {tuple(nw.shape)}")
    if z.dtype != x.dtype or nw.dtype != x.dtype:
        raise ValueError(f"gemv: y, z and the norm weight must share a dtype, got {x.dtype}, {z.dtype}, {nw.dtype}")
    if z.stride(-1) != 1:
        z = z.contiguous()
    if nw.stride(0) != 1:
        nw = nw.contiguous()
    return z, nw, float(eps)


# Activations the prologue computes, by name: the ACT constexpr.
ACTS = {"sqrelu": 1}


def gemv_triton(x, weight, bias=None, *, out=None, config=None, norm=None, act=None, swiglu=False, early_tiles=1):
    """See `kernels.gemv.gemv`. `config` (a `triton.Config` of CONFIGS or a dict with META keys and
    optional num_warps / num_stages) launches that configuration instead of the autotuned one.

    `norm=(z, norm_weight, eps)` (optionally a 4th item, group_size, which must be K): the product
    is gated_rmsnorm(x, z) @ W^T, the norm (`kernels.mamba2_norm.gated_rmsnorm`, one group) computed
    in the kernel's prologue: x [M, K] only, z [M, K] and norm_weight [K] in x's dtype.

    `act="sqrelu"`: the product is relu(x)^2 @ W^T, computed as the x tiles are loaded; x [M, K] only,
    not with `norm`. `swiglu=True`: W is [gate; up] [2I, K] and the result is
    `kernels.swiglu.silu_mul` of the product, [M, I], computed in the epilogue; x [M, K] only.

    `early_tiles` (1 or 2; PDL launches of FMA configurations only): the weight tiles each program
    loads before its PDL wait. One is the default: in graphed decode steps of all three families a
    second one was slower. Two measured faster for llama's decode projections on either side of the
    batch-1 decode attention, q/k/v and o (kernels/gemv/README.md, performance log)."""
    if early_tiles not in (1, 2):
        raise ValueError(f"gemv: early_tiles must be 1 or 2, got {early_tiles}")
    if norm is not None:
        norm = _check_norm(x, norm)
    if act is not None:
        if act not in ACTS:
            raise ValueError(f"gemv: act must be one of {sorted(ACTS)}, got {act!r}")
        if norm is not None or x.dim() != 2:
            raise ValueError("gemv: an activation prologue takes x [M, K] and no norm")
    if swiglu and (x.dim() != 2 or weight.dim() != 2 or weight.shape[0] % 2):
        raise ValueError(f"gemv: swiglu takes x [M, K] and weight [2I, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    grouped = x.dim() == 3
    if x.dim() not in (2, 3) or weight.dim() != x.dim():
        raise ValueError(f"gemv: x [M, K] with weight [N, K], or x [G, M, K] with weight [G, N, K]; "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[-1] or (grouped and x.shape[0] != weight.shape[0]):
        raise ValueError(f"gemv: shapes {tuple(x.shape)} and {tuple(weight.shape)} do not match")
    if weight.stride(-1) != 1:
        raise ValueError("gemv: weight must be contiguous in K (stride 1 in its last dimension)")
    if x.dtype != weight.dtype:
        raise ValueError(f"gemv: x is {x.dtype}, weight is {weight.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    G = x.shape[0] if grouped else 1
    M, K = x.shape[-2], x.shape[-1]
    N = weight.shape[-2]
    out_shape = (G, M, N) if grouped else (M, N // 2 if swiglu else N)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != out_shape or out.stride(-1) != 1:
        raise ValueError(f"gemv: out must be {list(out_shape)} with a contiguous last dimension, got {tuple(out.shape)}")
    has_bias = bias is not None
    if has_bias and tuple(bias.shape) != ((G, N) if grouped else (N,)):
        raise ValueError(f"gemv: bias must be {[G, N] if grouped else [N]}, got {tuple(bias.shape)}")
    if has_bias and bias.stride(-1) != 1:
        bias = bias.contiguous()
    if M == 0 or N == 0 or G == 0:
        return out
    if K == 0:
        if swiglu:
            from kernels.swiglu.ref import silu_mul_ref

            return out.copy_(silu_mul_ref(torch.zeros(M, N, dtype=x.dtype, device=x.device) if bias is None
                                          else bias.unsqueeze(0).expand(M, N)))
        return out.zero_() if not has_bias else out.copy_(bias.unsqueeze(-2).expand(out_shape))
    config = _as_config(config)
    split = config.kwargs["SPLIT_K"] if config is not None else MAX_SPLIT_K
    min_bn = config.kwargs["BLOCK_N"] if config is not None else MIN_BLOCK_N
    part, cnt = _workspace(x.device, split * G * M * N if split > 1 else 0, G * triton.cdiv(N, min_bn))
    gs = (lambda t: t.stride(0)) if grouped else (lambda t: 0)
    args = (x, weight, bias if has_bias else x, out, part, cnt,
            M, N, K, G,
            gs(x), x.stride(-2), gs(weight), weight.stride(-2), gs(bias) if has_bias else 0, gs(out), out.stride(-2),
            *((norm[0], norm[1], norm[0].stride(0), norm[2]) if norm is not None else (x, x, 0, 0.0)))
    use_pdl = pdl(x.device)
    consts = dict(M_POW2=_m_pow2(M), HAS_BIAS=has_bias, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
                  PDL=use_pdl, PDL_TILES=early_tiles, NORM=norm is not None, ACT=ACTS.get(act, 0), SWIGLU=swiglu)
    if config is None:
        def grid(meta):
            return triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"], G

        # The autotuner passes keyword arguments that are no config's on to every launch (its
        # benchmark's and the real one), launch options such as launch_pdl included.
        _gemv_tuned[grid](*args, **consts, launch_pdl=use_pdl)
    else:
        kw = config.kwargs
        grid = (triton.cdiv(N, kw["BLOCK_N"]), kw["SPLIT_K"], G)
        _gemv_kernel[grid](*args, **consts, **kw, num_warps=config.num_warps, num_stages=config.num_stages,
                           launch_pdl=use_pdl)
    return out


def tuned_config(M, N, K, G=1, has_bias=False, dtype=torch.bfloat16, norm=False, act=None, swiglu=False):
    """The configuration autotuning chose for this shape (None before the first call)."""
    for key, cfg in _gemv_tuned.cache.items():
        if key[:8] == (M, N, K, G, has_bias, norm, ACTS.get(act, 0), swiglu) and str(dtype) in key[8:]:
            return cfg
    return None
