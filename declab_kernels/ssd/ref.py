"""Mamba-2 (SSD, Dao & Gu 2024) reference ops in plain PyTorch float32: the specification.

Layouts follow mamba-ssm so results cross-check against `mamba_chunk_scan_combined`,
`selective_state_update` and `causal_conv1d_fn`:
x `[B, T, H, P]`, dt `[B, T, H]`, A `[H]` (negative), B/C `[B, T, G, N]`, state `[B, H, P, N]`.
Head h reads group h // (H // G).

- `ssd_chunk_scan`: the chunked algorithm of the paper's listing, memory O(T * chunk); differentiable,
  it is also the training path of `declab_arch.mamba2` (B and C stay per group, never copied per head).
- `ssd_recurrent_ref`: the same recurrence one token at a time, the ground truth for the above.
- `causal_conv1d`: depthwise causal convolution over `[B, T, C]` with a carried window.
- `mamba2_decode_step`: one token of conv + SSM, updating both states in place (the conv state a ring of
  W inputs indexed by position, `conv_window_slots`).
"""

import torch
import torch.nn.functional as F

DEFAULT_DT_LIMIT = (0.0, float("inf"))


def process_dt(dt, dt_bias, dt_softplus, dt_limit):
    """Raw dt `[..., H]` -> the step size: + dt_bias, softplus, clamp (as mamba-ssm, the clamp
    applies only when dt_limit differs from the default (0, inf))."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != DEFAULT_DT_LIMIT:
        dt = dt.clamp(dt_limit[0], dt_limit[1])
    return dt


def segsum(a):
    """a `[..., L]` -> `[..., L, L]` with out[i, j] = a[j+1] + ... + a[i] for j <= i, -inf above."""
    L = a.shape[-1]
    cs = torch.cumsum(a, dim=-1)
    out = cs[..., :, None] - cs[..., None, :]
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device))
    return out.masked_fill(~causal, float("-inf"))


def _heads(t, H):
    """`[B, T, G, N]` -> `[B, T, H, N]`: each group serves H // G consecutive heads."""
    return t.float().repeat_interleave(H // t.shape[2], dim=2)


def ssd_chunk_scan(x, dt, A, B, C, *, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=DEFAULT_DT_LIMIT, initial_state=None):
    """Chunked SSD scan. Returns y `[B, T, H, P]` (x's dtype) and the final state `[B, H, P, N]` fp32.

    Heads are indexed (group g, head j within the group), h = g * J + j, so B and C are read per group
    and never copied per head: C_l . B_s is one `[L, L]` matrix per chunk and group, shared by its J heads.
    """
    Bsz, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    J, L = H // G, chunk_size
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    # Zero padding to whole chunks: a padded token has dt = 0, so it neither decays nor adds to the state.
    pad = (-T) % L
    nc = (T + pad) // L

    def chunks(t):
        """`[B, T, ...]` -> `[B, nc, L, ...]`, zero-padded."""
        if pad:
            t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(Bsz, nc, L, *t.shape[2:])

    # [B, c, l, G, J, P], [B, c, G, J, l], [B, c, l, G, N]
    X = chunks(dt[..., None] * x).view(Bsz, nc, L, G, J, P)
    dA = chunks(dt * A.float()).view(Bsz, nc, L, G, J).permute(0, 1, 3, 4, 2)
    Bc, Cc = chunks(B.float()), chunks(C.float())

    # 1. Chunk-local cumulative decay: dA_cs[b, c, g, j, l] = sum of dt*A over chunk c up to token l.
    dA_cs = torch.cumsum(dA, dim=-1)

    # 2. Intra-chunk output (the diagonal blocks): y_l += sum_{s<=l} (C_l . B_s) exp(dA_cs_l - dA_cs_s) dt_s x_s.
    CB = torch.einsum("bclgn,bcsgn->bcgls", Cc, Bc)
    scores = CB[:, :, :, None] * torch.exp(segsum(dA))
    y = torch.einsum("bcgjls,bcsgjp->bclgjp", scores, X)

    # 3. Chunk states: what each chunk adds to the state by its end, from a zero start.
    decay_to_end = torch.exp(dA_cs[..., -1:] - dA_cs)
    states = torch.einsum("bclgn,bclgjp->bcgjpn", Bc, X * decay_to_end.permute(0, 1, 4, 2, 3)[..., None])

    # 4. Inter-chunk recurrence: the state entering chunk c, passed across chunks one chunk at a time.
    s = torch.zeros(Bsz, H, P, N, device=x.device) if initial_state is None else initial_state.float()
    s = s.view(Bsz, G, J, P, N)
    # (unbind, not indexing: the backward of c indexed reads would each write a full-size gradient)
    entering = []
    for decay, state in zip(torch.exp(dA_cs[..., -1]).unbind(1), states.unbind(1)):
        entering.append(s)
        s = decay[..., None, None] * s + state
    entering = torch.stack(entering, dim=1)

    # 5. State to output: y_l += exp(dA_cs_l) C_l . state entering the chunk.
    to_out = torch.exp(dA_cs).permute(0, 1, 4, 2, 3)[..., None]
    y = torch.addcmul(y, torch.einsum("bclgn,bcgjpn->bclgjp", Cc, entering), to_out)

    y = y.reshape(Bsz, nc * L, H, P)[:, :T]
    return _finish(y, x, D, z), s.reshape(Bsz, H, P, N)


def _finish(y, x, D, z):
    """Skip connection and gate: y + D * x, then * silu(z); cast to x's dtype."""
    if D is not None:
        y = torch.addcmul(y, D.float()[:, None], x)
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def ssd_recurrent_ref(x, dt, A, B, C, *, chunk_size=None, D=None, z=None, dt_bias=None, dt_softplus=False,
                      dt_limit=DEFAULT_DT_LIMIT, initial_state=None):
    """The SSM one token at a time: state = exp(dt A) state + dt x B^T, y = state C. Same signature as
    `ssd_chunk_scan` (chunk_size is ignored)."""
    Bsz, T, H, P = x.shape
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    Bh, Ch = _heads(B, H), _heads(C, H)
    s = torch.zeros(Bsz, H, P, Bh.shape[-1], device=x.device) if initial_state is None else initial_state.float()
    ys = []
    for t in range(T):
        decay = torch.exp(dt[:, t] * A.float())
        s = decay[..., None, None] * s + (dt[:, t, :, None] * x[:, t].float())[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", s, Ch[:, t]))
    return _finish(torch.stack(ys, dim=1), x, D, z), s


def causal_conv1d(x, weight, bias=None, *, initial_state=None, activation="silu"):
    """Depthwise causal conv: y[t, c] = act(bias[c] + sum_k weight[c, k] * x[t - W + 1 + k, c]).

    x `[B, T, C]`, weight `[C, W]`, initial_state `[B, C, W-1]` (the inputs before x; zeros if None).
    Returns y `[B, T, C]` (x's dtype) and the last W-1 inputs `[B, C, W-1]` (x's dtype).
    """
    Bsz, T, Cdim = x.shape
    W = weight.shape[1]
    if initial_state is None:
        initial_state = torch.zeros(Bsz, Cdim, W - 1, device=x.device)
    # [B, C, W-1+T]
    window = torch.cat([initial_state.float(), x.float().transpose(1, 2)], dim=-1)
    y = F.conv1d(window, weight.float()[:, None, :], None if bias is None else bias.float(), groups=Cdim)
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}: expected 'silu' or None")
    return y.transpose(1, 2).to(x.dtype), window[..., window.shape[-1] - (W - 1):].to(x.dtype)


def check_decode_conv(xBC, conv_state, conv_weight, positions):
    """A decode step's conv ring `[B, C, W]` and positions `[B]` (integers), checked against xBC `[B, C]`."""
    Bsz, Cdim = xBC.shape
    W = conv_weight.shape[1]
    if tuple(conv_state.shape) != (Bsz, Cdim, W) or tuple(conv_weight.shape) != (Cdim, W):
        raise ValueError(f"mamba2_decode_step: conv_state must be the ring [{Bsz}, {Cdim}, {W}] of conv_weight "
                         f"[{Cdim}, {W}], got {tuple(conv_state.shape)} and {tuple(conv_weight.shape)}")
    if tuple(positions.shape) != (Bsz,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"mamba2_decode_step: positions must be int32 or int64 [{Bsz}], "
                         f"got {positions.dtype} {tuple(positions.shape)}")


def check_decode_norm(norm, z, batch, H, P):
    """(norm_weight, sumsq) of a decode step's `norm=`, checked: z given, weight [H*P], sumsq [B, H] float32."""
    if z is None or len(norm) != 2:
        raise ValueError("mamba2_decode_step: norm=(norm_weight, sumsq) needs z (it normalises the gated output)")
    norm_weight, sumsq = norm
    if tuple(norm_weight.shape) != (H * P,) or tuple(sumsq.shape) != (batch, H) or sumsq.dtype != torch.float32:
        raise ValueError(f"mamba2_decode_step: norm needs a weight [{H * P}] and a float32 sumsq [{batch}, {H}], "
                         f"got {tuple(norm_weight.shape)} and {tuple(sumsq.shape)} {sumsq.dtype}")
    return norm_weight, sumsq


def conv_window_slots(position, width, device=None):
    """Slots of a conv ring `[..., C, width]` (the input at position p lives in slot p % width) that hold
    the width-1 inputs before `position`, oldest first, as an int64 tensor: `[width-1]` on `device` for
    an int, `[B, width-1]` for a tensor of positions `[B]`. Position p - width + 1 + j is in slot
    (p + 1 + j) % width. Made on the device, not copied there: an index copied from host memory would
    wait for the GPU (`declab_kernels.host_copy`)."""
    if torch.is_tensor(position):
        taps = torch.arange(width - 1, device=position.device)
        return (position.long()[:, None] + 1 + taps) % width
    return (position + 1 + torch.arange(width - 1, device=device)) % width


def conv_window(conv_state, positions):
    """The W-1 inputs before `positions` `[B]`, oldest first, from conv rings `[B, C, W]`: `[B, C, W-1]`."""
    Bsz, Cdim, W = conv_state.shape
    return conv_state.gather(2, conv_window_slots(positions, W)[:, None, :].expand(Bsz, Cdim, W - 1))


def mamba2_decode_step(xBC, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias, *, positions, ngroups,
                       headdim, dt_limit=DEFAULT_DT_LIMIT, z=None, out=None, norm=None):
    """One token: conv + SiLU over the carried window and the token, split into x/B/C, SSM update; both
    states in place.

    xBC `[B, C]` with C = H*P + 2*G*N ordered [x, B, C]; conv_state `[B, C, W]`, a ring: the input at
    position p lives in slot p % W (zeros before the first); positions `[B]` (int) the position of this
    token, whose input is written into slot positions % W (that slot's old input, W back, is not in
    the window). ssm_state `[B, H, P, N]` fp32; dt `[B, H]` raw (softplus(dt + dt_bias), clamped).
    Returns y `[B, H, P]` in xBC's dtype.

    `norm=(norm_weight [H*P], sumsq [B, H] float32)`, with z: the first half of the gated RMSNorm that
    follows (one group of all H*P channels). g = y * silu(z) is rounded to xBC's dtype; sumsq receives
    each head's sum of g^2 (float32) and the result is g * norm_weight, so that rmsnorm(g) * norm_weight
    = result * rsqrt(sumsq.sum(-1) / (H*P) + eps) (`declab_kernels.gemv.fusions.RMSScale` applies the scale).
    """
    Bsz, Cdim = xBC.shape
    H, P, G = dt.shape[1], headdim, ngroups
    N = (Cdim - H * P) // (2 * G)
    W = conv_weight.shape[1]
    check_decode_conv(xBC, conv_state, conv_weight, positions)
    # 1. The W-1 carried inputs and this token, convolved (with bias), then SiLU; the token into its slot.
    window = torch.cat([conv_window(conv_state, positions).float(), xBC.float()[..., None]], dim=-1)
    conv_state.scatter_(2, (positions.long() % W)[:, None, None].expand(Bsz, Cdim, 1), xBC[..., None].to(conv_state.dtype))
    xbc = F.silu((window * conv_weight.float()).sum(-1) + (0 if conv_bias is None else conv_bias.float()))
    # 2. Split into x [B, H, P], B and C [B, H, N] (a group's B and C serve H // G heads).
    x = xbc[:, : H * P].reshape(Bsz, H, P)
    Bm = xbc[:, H * P: H * P + G * N].reshape(Bsz, G, N).repeat_interleave(H // G, dim=1)
    Cm = xbc[:, H * P + G * N:].reshape(Bsz, G, N).repeat_interleave(H // G, dim=1)
    # 3. Step size and state update: state = exp(dt A) state + dt x B^T.
    dt = process_dt(dt, dt_bias, True, dt_limit)
    decay = torch.exp(dt * A.float())
    state = decay[..., None, None] * ssm_state + (dt[..., None] * x)[..., None] * Bm[:, :, None, :]
    ssm_state.copy_(state)
    # 4. Output: y = state C + D x, gated by silu(z).
    y = torch.einsum("bhpn,bhn->bhp", state, Cm) + D.float()[:, None] * x
    if z is not None:
        y = y * F.silu(z.float())
    if norm is not None:
        norm_weight, sumsq = check_decode_norm(norm, z, Bsz, H, P)
        g = y.to(xBC.dtype).float()
        sumsq.copy_(g.square().sum(-1))
        y = g * norm_weight.float().reshape(H, P)
    if out is None:
        return y.to(xBC.dtype)
    return out.copy_(y)
