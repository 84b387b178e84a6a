"""Mamba-2 (SSD) ops: chunked scan, causal depthwise conv, fused decode step.

Each public function takes `impl="triton"|"ref"` (already resolved by `declab_kernels.resolve_impl`);
shapes and semantics are documented in ref.py and README.md.
"""

from declab_kernels import check_impl
from declab_kernels.ssd import ref
from declab_kernels.ssd.ref import DEFAULT_DT_LIMIT, conv_window_slots, ssd_recurrent_ref

__all__ = ["ssd_chunk_scan", "causal_conv1d", "mamba2_decode_step", "conv_window_slots", "ssd_recurrent_ref"]


def _module(impl):
    check_impl(impl)
    if impl == "ref":
        return ref
    from declab_kernels.ssd import triton as tri

    return tri


def ssd_chunk_scan(x, dt, A, B, C, *, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=DEFAULT_DT_LIMIT, initial_state=None, impl):
    """x `[B, T, H, P]`, dt `[B, T, H]` raw, A `[H]`, B/C `[B, T, G, N]` -> (y `[B, T, H, P]`, final state
    `[B, H, P, N]` fp32)."""
    return _module(impl).ssd_chunk_scan(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                                        dt_softplus=dt_softplus, dt_limit=dt_limit, initial_state=initial_state)


def causal_conv1d(x, weight, bias=None, *, initial_state=None, activation="silu", impl):
    """x `[B, T, C]`, weight `[C, W]` -> (y `[B, T, C]`, last W-1 inputs `[B, C, W-1]`)."""
    return _module(impl).causal_conv1d(x, weight, bias, initial_state=initial_state, activation=activation)


def mamba2_decode_step(xBC, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias, *, positions, ngroups,
                       headdim, dt_limit=DEFAULT_DT_LIMIT, z=None, impl, out=None, state_ready=False, norm=None):
    """One token at `positions` `[B]`: xBC `[B, C]`, dt `[B, H]`; conv_state `[B, C, W]` (a ring, the input
    at position p in slot p % W: `conv_window_slots`) and ssm_state `[B, H, P, N]` updated in place;
    returns y `[B, H, P]` (written into `out` when given). `state_ready` (Triton, see
    triton.mamba2_decode_step): ssm_state and conv_state were last written before a kernel launched
    without PDL. `norm=(norm_weight, sumsq)` (with z): the gated norm's statistics into sumsq `[B, H]`
    and the result times norm_weight (ref.mamba2_decode_step)."""
    extra = {"state_ready": state_ready} if impl == "triton" else {}
    return _module(impl).mamba2_decode_step(xBC, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias,
                                            positions=positions, ngroups=ngroups, headdim=headdim, dt_limit=dt_limit,
                                            z=z, out=out, norm=norm, **extra)
