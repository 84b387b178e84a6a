"""WKV-7, the RWKV-7 "Goose" time-mixing operator (Peng et al. 2025): float32 PyTorch reference.

Per batch and head the state S is a [K, V] matrix. Token t (w is the log-decay, exp(w) in (0, 1]):

    S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T
    o_t = scale * S_t^T r_t

(RWKV-7 passes a = -kk and b = kk * iclr, kk the normalised key.) Conventions and argument order
follow flash-linear-attention's `chunk_rwkv7` / `fused_recurrent_rwkv7`: inputs `[B, T, H, K]`
(v `[B, T, H, V]`), state `[B, H, K, V]` float32.

Three forms, all taking an initial state and returning the final one:
- `wkv7_step_ref`: one token, updating the state in place (the decode step).
- `wkv7_recurrent_ref`: the recurrence above, token by token.
- `wkv7_chunk_ref`: the chunked form (the DPLR / WY representation): inside a chunk of C tokens the
  product of the C transitions is applied through a C x C unit-triangular solve; across chunks the
  state is passed on. Memory is O(T + B H C^2 K), never a per-token copy of the state.
"""

import torch


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
