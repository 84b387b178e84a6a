"""WKV-7, the RWKV-7 "Goose" time-mixing operator (Peng et al. 2025): float32 PyTorch reference.

Per batch and head the state S is a [K, V] matrix. Token t (w is the log-decay, exp(w) in (0, 1]):

    S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T
    o_t = scale * S_t^T r_t

(RWKV-7 passes a = -kk and b = kk * iclr, kk the normalised key.) Conventions and argument order
follow flash-linear-attention's `chunk_rwkv7` / `fused_recurrent_rwkv7`: inputs `[B, T, H, K]`
(v `[B, T, H, V]`), state `[B, H, K, V]` float32.

Four forms, all taking an initial state and returning the final one:
- `wkv7_step_ref`: one token, updating the state in place (the decode step).
- `wkv7_recurrent_ref`: the recurrence above, token by token.
- `wkv7_chunk_ref`: the chunked form (the DPLR / WY representation): inside a chunk of C tokens the
  product of the C transitions is applied through a C x C unit-triangular solve; across chunks the
  state is passed on. Memory is O(T + B H C^2 K), never a per-token copy of the state.
- `wkv7_chunk_factored`: the same chunked math with the pairwise decays factored into matrix
  products and all chunks processed at once; differentiable and memory-light (O(B H T C)), it is the
  reference path of `declab_arch.rwkv7` (training included). Valid while the decay over half a chunk stays
  below exp(FACTORED_MAX_EXP), which RWKV-7's bounded w guarantees; refused beyond.
"""

import torch
import torch.nn.functional as F


def wkv7_step_ref(r, w, k, v, a, b, state, *, scale=1.0):
    """One token. r, w, k, a, b `[B, H, K]`, v `[B, H, V]`, state `[B, H, K, V]` float32, updated
    in place. Returns o `[B, H, V]` in r's dtype."""
    dtype = r.dtype
    r, w, k, v, a, b = (x.float() for x in (r, w, k, v, a, b))
    # a^T S_{t-1}: [B, H, V]
    sa = torch.einsum("bhk,bhkv->bhv", a, state)
    new = torch.exp(w)[..., None] * state + b[..., None] * sa[:, :, None, :] + k[..., None] * v[:, :, None, :]
    state.copy_(new)
    return (scale * torch.einsum("bhk,bhkv->bhv", r, new)).to(dtype)


def wkv7_recurrent_ref(r, w, k, v, a, b, *, scale=1.0, initial_state=None):
    """Token-by-token recurrence. Returns (o `[B, T, H, V]` in r's dtype, final state float32)."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    state = torch.zeros(B, H, K, V, dtype=torch.float32, device=r.device)
    if initial_state is not None:
        state.copy_(initial_state)
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=r.device)
    for t in range(T):
        o[:, t] = wkv7_step_ref(r[:, t], w[:, t], k[:, t], v[:, t], a[:, t], b[:, t], state, scale=scale).float()
    return o.to(r.dtype), state


def wkv7_chunk_ref(r, w, k, v, a, b, *, scale=1.0, initial_state=None, chunk_size=16):
    """Chunked form, float32. Returns (o `[B, T, H, V]` in r's dtype, final state float32).

    Within a chunk (positions t, s = 0..L-1, S the state entering the chunk):
      1. g_t = sum_{s<=t} w_s (cumulative log-decay) and gp_t = g_t - w_t (the decay before t).
      2. Pairwise products of decays: for s < t, a_t^T diag(exp(gp_t - g_s)) k_s gives A_ak[t, s]
         and with b_s instead of k_s A_ab[t, s]; for s <= t, r_t^T diag(exp(g_t - g_s)) k_s gives
         A_rk[t, s] and with b_s A_rb[t, s].
      3. u_t = a_t^T S_{t-1} for every t at once. Unrolling the recurrence inside the chunk gives
         u = (a * exp(gp)) S + A_ak v + A_ab u, so u solves the unit lower-triangular system
         (I - A_ab) u = (a * exp(gp)) S + A_ak v.
      4. o = scale * ((r * exp(g)) S + A_rk v + A_rb u).
      5. S <- diag(exp(g_L)) S + (k * exp(g_L - g))^T v + (b * exp(g_L - g))^T u.
    """
    B, T, H, K = r.shape
    V = v.shape[-1]
    dtype = r.dtype
    # [B, H, T, D]
    r, w, k, v, a, b = (x.float().transpose(1, 2) for x in (r, w, k, v, a, b))
    S = torch.zeros(B, H, K, V, dtype=torch.float32, device=r.device)
    if initial_state is not None:
        S.copy_(initial_state)
    o = torch.empty(B, H, T, V, dtype=torch.float32, device=r.device)
    for t0 in range(0, T, chunk_size):
        rc, wc, kc, vc, ac, bc = (x[:, :, t0 : t0 + chunk_size] for x in (r, w, k, v, a, b))
        L = rc.shape[2]
        # 1. [B, H, L, K]
        g = wc.cumsum(2)
        gp = g - wc
        # 2. [B, H, L, L, K] decay from just after s to just before t (strict) or through t (inclusive)
        pos = torch.arange(L, device=r.device)
        strict = (pos[:, None] > pos[None, :])[None, None, :, :, None]
        incl = (pos[:, None] >= pos[None, :])[None, None, :, :, None]
        d_strict = torch.exp((gp[:, :, :, None] - g[:, :, None, :]).masked_fill(~strict, float("-inf")))
        d_incl = torch.exp((g[:, :, :, None] - g[:, :, None, :]).masked_fill(~incl, float("-inf")))
        A_ak = torch.einsum("bhtk,bhtsk,bhsk->bhts", ac, d_strict, kc)
        A_ab = torch.einsum("bhtk,bhtsk,bhsk->bhts", ac, d_strict, bc)
        A_rk = torch.einsum("bhtk,bhtsk,bhsk->bhts", rc, d_incl, kc)
        A_rb = torch.einsum("bhtk,bhtsk,bhsk->bhts", rc, d_incl, bc)
        # 3. [B, H, L, V]
        eye = torch.eye(L, device=r.device)
        rhs = (ac * torch.exp(gp)) @ S + A_ak @ vc
        u = torch.linalg.solve_triangular(eye - A_ab, rhs, upper=False, unitriangular=True)
        # 4.
        o[:, :, t0 : t0 + L] = scale * ((rc * torch.exp(g)) @ S + A_rk @ vc + A_rb @ u)
        # 5. g_L: [B, H, 1, K]
        gl = g[:, :, -1:]
        S = (
            torch.exp(gl).transpose(-1, -2) * S
            + (kc * torch.exp(gl - g)).transpose(-1, -2) @ vc
            + (bc * torch.exp(gl - g)).transpose(-1, -2) @ u
        )
    return o.transpose(1, 2).to(dtype), S


# Bound on the exponents of the factored form: every factor exp(+-(g_t - c)) it forms stays below
# exp(60) ~ 1e26, far inside float32 (exp(88.7)), so the products r k exp(g_t - g_s) (each at most
# |r||k|, the decay being <= 1) are formed from finite, normal factors at full relative precision.
FACTORED_MAX_EXP = 60.0
# Largest [B, H, T_segment, 2C] float buffer of one segment of the factored form (256 MiB in float32):
# bounds a long no-grad prefill; a training batch (64 x 512 tokens, H=8, C=64) is one segment.
FACTORED_SEGMENT_FLOATS = 1 << 26


def wkv7_chunk_factored(r, w, k, v, a, b, *, scale=1.0, initial_state=None, chunk_size=64):
    """The chunked form of `wkv7_chunk_ref` with the pairwise decays factored into matrix products,
    all chunks at once, differentiable. Returns (o `[B, T, H, V]` in r's dtype, final state).

    Computes in float32 (float64 inputs stay float64), also under autocast; the state is returned in
    that dtype. Same steps 1-5 as `wkv7_chunk_ref`; inside a chunk, with c = g at the middle row:

        exp(g_t - g_s) = exp(g_t - c) exp(c - g_s)

    so [A_rk | A_rb] = (r exp(g - c)) ([k; b] exp(c - g))^T on and below the diagonal and
    [A_ak | A_ab] = (a exp(gp - c)) ([k; b] exp(c - g))^T below it: two `[C, 2C]` products per chunk
    instead of the `[C, C, K]` decay tensor. Every exponent is bounded by the decay accumulated over
    half a chunk, |g_t - c| <= (C/2 + 1) max|w|: RWKV-7's |w| <= exp(-0.5) gives 20.0 at C = 64, far
    below FACTORED_MAX_EXP; inputs beyond it are refused by a device-side assert (`torch._assert_async`:
    no host sync on a GPU, a RuntimeError on the CPU). Entries above the diagonal may overflow; they are
    masked out before any use, forward and backward.

    Across chunks: with u = W S + U (step 3), o = R S + O (step 4) and step 5 written S <- M S + D, the
    W, U, R, O, M, D of every chunk are formed in parallel; the loop over chunks is one batched product
    each, then o = R S_in + O for all chunks at once.

    Memory O(B H T C): the sequence is cut into segments of whole chunks (the state carried across)
    so that a segment's largest buffer stays under FACTORED_SEGMENT_FLOATS.
    """
    B, T, H, K = r.shape
    dtype = r.dtype
    ft = torch.promote_types(dtype, torch.float32)
    seg = max(chunk_size, FACTORED_SEGMENT_FLOATS // (2 * B * H * chunk_size) // chunk_size * chunk_size)
    S = initial_state
    if S is None:
        S = torch.zeros(B, H, K, v.shape[-1], dtype=ft, device=r.device)
    outs = []
    # why: autocast would run the products in bf16, and the solve on mixed dtypes
    with torch.autocast(r.device.type, enabled=False):
        for t0 in range(0, T, seg):
            x = (y[:, t0 : t0 + seg] for y in (r, w, k, v, a, b))
            o, S = _factored_segment(*x, S.to(ft), scale=scale, chunk_size=chunk_size, dtype=ft, out_dtype=dtype)
            outs.append(o)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), S


def _factored_segment(r, w, k, v, a, b, S, *, scale, chunk_size, dtype, out_dtype):
    """`wkv7_chunk_factored` on one segment, computing in `dtype` from the state S entering it.
    Returns (o `[B, T, H, V]` in out_dtype, S leaving it)."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    L = chunk_size
    pad = (-T) % L
    n = (T + pad) // L

    def chunks(x):
        """`[B, T, H, D]` -> `[B, H, n, L, D]` contiguous in `dtype` (so every product below is a plain
        batched GEMM). Padded tokens have w = k = b = 0: they leave S unchanged."""
        if pad:
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, n, L, H, -1).permute(0, 3, 1, 2, 4).to(dtype, memory_format=torch.contiguous_format)

    r, w, k, v, a, b = (chunks(x) for x in (r, w, k, v, a, b))
    if scale != 1.0:
        r = r * scale
    # 1. [B, H, n, L, K]; the reference row c and the chunk's total decay gl: [B, H, n, 1, K]
    g = w.cumsum(3)
    c, gl = g[:, :, :, L // 2 : L // 2 + 1], g[:, :, :, -1:]
    torch._assert_async(
        torch.maximum(-c, c - gl).max() <= FACTORED_MAX_EXP,
        "wkv7_chunk_factored: the decay over half a chunk exceeds FACTORED_MAX_EXP (use a shorter chunk)",
    )
    # 2. rd = r exp(g - c), ad = a exp(gp - c), kb = [k; b] exp(c - g): [A_rk | A_rb] = rd kb^T on and
    # below the diagonal, [A_ak | A_ab] = ad kb^T below it; [B, H, n, L, 2L]
    rd = r * torch.exp(g - c)
    ad = a * torch.exp(g - w - c)
    down = torch.exp(c - g)
    kb = torch.cat([k * down, b * down], dim=3)
    pos = torch.arange(L, device=r.device)
    incl = (pos[:, None] >= pos[None, :]).repeat(1, 2)
    strict = (pos[:, None] > pos[None, :]).repeat(1, 2)
    A_rk, A_rb = (rd @ kb.transpose(-1, -2)).masked_fill(~incl, 0.0).split(L, dim=-1)
    A_ak, A_ab = (ad @ kb.transpose(-1, -2)).masked_fill(~strict, 0.0).split(L, dim=-1)
    # 3. u = W S + U with [W | U] = (I - A_ab)^-1 [a exp(gp) | A_ak v]: [B, H, n, L, K + V]
    ec = torch.exp(c)
    eye = torch.eye(L, dtype=dtype, device=r.device)
    WU = torch.linalg.solve_triangular(eye - A_ab, torch.cat([ad * ec, A_ak @ v], dim=-1), upper=False,
                                       unitriangular=True)
    # 4. o = R S + O with R = r exp(g) + A_rb W, O = A_rk v + A_rb U
    RO = A_rb @ WU
    R = rd * ec + RO[..., :K]
    O = A_rk @ v + RO[..., K:]
    # 5. S <- M S + D with M = diag(exp(g_L)) + Bd^T W [B, H, n, K, K], D = Kd^T v + Bd^T U [B, H, n, K, V],
    # [Kd; Bd] = [k; b] exp(g_L - g)
    Kd, Bd = (kb * torch.exp(gl - c)).transpose(-1, -2).split(L, dim=-1)
    MD = Bd @ WU
    M = torch.diag_embed(torch.exp(gl[:, :, :, 0])) + MD[..., :K]
    D = Kd @ v + MD[..., K:]
    entering = []
    for Mc, Dc in zip(M.unbind(2), D.unbind(2)):
        entering.append(S)
        S = torch.baddbmm(Dc.flatten(0, 1), Mc.flatten(0, 1), S.flatten(0, 1)).view(B, H, K, V)
    o = R @ torch.stack(entering, dim=2) + O
    # [B, H, n, L, V] -> [B, T, H, V]
    o = o.permute(0, 2, 3, 1, 4).to(out_dtype, memory_format=torch.contiguous_format)
    return o.view(B, n * L, H, V)[:, :T], S


def rwkv7_inputs(B, T, H, K, V, *, dtype=torch.float32, device="cpu", generator=None):
    """Random inputs built the way an RWKV-7 layer builds them, so the recurrence stays stable.

    Returns r, w, k, v, a, b `[B, T, H, *]` in `dtype`: w = -exp(-0.5) * sigmoid(.) is the
    log-decay in [-0.61, 0); kk = normalize(k) per head; a = -kk; b = kk * iclr, iclr in (0, 1).
    """

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32)

    r = randn(B, T, H, K) * 0.5
    w = -0.6065306597126334 * torch.sigmoid(randn(B, T, H, K))
    k = randn(B, T, H, K) * 0.5
    v = randn(B, T, H, V) * 0.5
    kk = torch.nn.functional.normalize(k * (1 + 0.1 * randn(B, T, H, K)), dim=-1)
    iclr = torch.sigmoid(randn(B, T, H, K))
    # RWKV-7 scales the key by the in-context learning rate: k = k * (1 + (iclr - 1) * k_a)
    k = k * (1 + (iclr - 1) * 0.5)
    return tuple(x.to(dtype) for x in (r, w, k, v, -kk, kk * iclr))
