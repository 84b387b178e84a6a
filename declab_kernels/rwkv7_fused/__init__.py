"""Fused elementwise steps of the RWKV-7 decode step (the math is in ref.py's docstring).

Each public function takes `impl` "triton" | "ref" (already resolved by `declab_kernels.resolve_impl`); there
is no fallback from one to the other. Activations are rows `[B, C]` with channels contiguous.
"""

from declab_kernels import check_impl
from declab_kernels.rwkv7_fused.ref import (
    add_norm_shift_ref,
    gate_output_ref,
    lora_hidden_ref,
    sqrelu_ref,
    time_mix_inputs_ref,
)

__all__ = ["add_norm_shift", "lora_hidden", "time_mix_inputs", "gate_output", "sqrelu"]


def _pick(impl, ref, name):
    check_impl(impl)
    if impl == "ref":
        return ref
    from declab_kernels.rwkv7_fused import triton as tri

    return getattr(tri, name)


def add_norm_shift(x, delta, weight, bias, prev=None, mixes=None, *, eps, impl, state_ready=False):
    """x `[B, C]` <- x + delta (when given); h = LayerNorm(x). With prev `[B, C]` and mixes `[M, C]`:
    returns the mixed inputs `[M, B, C]` (h + (prev - h) * mix_m) and sets prev <- h; else returns h.
    `state_ready` (Triton, see triton.add_norm_shift_triton): prev was last written before a kernel
    launched without PDL."""
    fn = _pick(impl, add_norm_shift_ref, "add_norm_shift_triton")
    extra = {"state_ready": state_ready} if impl == "triton" else {}
    return fn(x, delta, weight, bias, prev, mixes, eps=eps, **extra)


def lora_hidden(blocks, acts, *, impl):
    """LoRA down-projection outputs `[B, D_j]` (3 or 4) -> `[NB * B, sum D_j]`: act_j(block j) on the
    block diagonal, zeros elsewhere, so one GEMM with the up-projections concatenated along their
    inner dimension gives every LoRA's output, row block j for LoRA j."""
    return _pick(impl, lora_hidden_ref, "lora_hidden_triton")(blocks, acts)


def time_mix_inputs(r, k, v, u, bias_w, bias_a, bias_v, k_k, k_a, v_first, *, head_dim, impl):
    """WKV-7 inputs from the projections r, k, v `[B, C]` and the LoRA outputs u `[NB * B, C]` (row
    blocks v, w, a, g; no v block when v_first is None). Returns (x `[5, B, C]`: r, k, v, a, b in r's
    dtype; w `[B, C]` float32 log-decay)."""
    fn = _pick(impl, time_mix_inputs_ref, "time_mix_inputs_triton")
    return fn(r, k, v, u, bias_w, bias_a, bias_v, k_k, k_a, v_first, head_dim=head_dim)


def gate_output(o, r, k, v, g, r_k, norm_weight, norm_bias, *, eps, impl):
    """(groupnorm_per_head(o) + sum(r * k * r_k) v) * g: o, r, k, v `[B, H, D]`, g `[B, C]` -> `[B, C]`."""
    fn = _pick(impl, gate_output_ref, "gate_output_triton")
    return fn(o, r, k, v, g, r_k, norm_weight, norm_bias, eps=eps)


def sqrelu(x, *, impl):
    """relu(x)^2 in place on a contiguous x. Returns x."""
    return _pick(impl, sqrelu_ref, "sqrelu_triton")(x)
