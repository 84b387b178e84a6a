"""fp8 (e4m3) paged caches: the quantization's error bounds, and every Triton kernel that writes or
reads the cache against the reference in fp8 mode.

Writes (`write_kv`, the RoPE + write kernel, the decode kernel's own row) must store the same bytes
and exponents as `ref.quantize`; reads (decode, prefill) must match the reference's attention over
the same fp8 cache at the bf16-cache tolerance of test_paged_attention.py. On the CPU these run under
the Triton interpreter in float32 (fp8 storage, fp32 compute); on a GPU the same tests in bfloat16.
"""

import pytest
import torch

from declab_kernels import paged_attention as pa
from declab_kernels import rotary
from declab_kernels.paged_attention import ref
from declab_kernels.paged_attention import triton as pa_triton

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
TOL = 2e-2 if GPU else 1e-4
# fp8 against a float cache of the same values: e4m3 keeps 3 mantissa bits (relative error <= 2^-4 per
# element, 2.4% RMS); a query that sees few keys gets their V error undiluted, plus the scores' error
# from K. Measured 0.02-0.054 relative RMS on these cases.
FP8_VS_FLOAT_TOL = 8e-2

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def rel_rms(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fp8_cache(num_blocks, page, num_kv_heads, head_dim):
    """Empty fp8 caches and their exponents; rows no sequence owns hold e4m3 NaN (0x7f), so a kernel
    that reads past a sequence fails."""
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k = torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(pa.FP8)
    scales = tuple(torch.zeros(shape[:3], dtype=torch.int8, device=DEVICE) for _ in range(2))
    return k, k.clone(), scales


def filled_cache(seq_lens, page, num_kv_heads, head_dim, seed=0):
    """fp8 caches holding random rows of `seq_lens` sequences (written by the reference, pages shuffled),
    the float32 caches of the same rows, the block tables and lengths."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in seq_lens]
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
    k8, v8, scales = fp8_cache(num_blocks, page, num_kv_heads, head_dim)
    kf = torch.zeros(num_blocks, page, num_kv_heads, head_dim, device=DEVICE)
    vf = torch.zeros_like(kf)
    used = 0
    for b, (n, count) in enumerate(zip(seq_lens, pages)):
        tables[b, :count] = order[used : used + count]
        used += count
        pos = torch.arange(n)
        slots = (tables[b].long()[pos // page] * page + pos % page).to(DEVICE)
        # Rows of very different sizes, so the exponents differ from row to row.
        size = torch.exp(torch.randn(n, num_kv_heads, 1, generator=gen))
        k = (torch.randn(n, num_kv_heads, head_dim, generator=gen) * size).to(DEVICE, DTYPE)
        v = (torch.randn(n, num_kv_heads, head_dim, generator=gen) * size).to(DEVICE, DTYPE)
        pa.write_kv(k, v, k8, v8, slots, impl="ref", scales=scales)
        pa.write_kv(k, v, kf, vf, slots, impl="ref")
    return k8, v8, scales, kf, vf, tables.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def test_round_trip_error_bounds():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 4, 64, generator=gen) * torch.exp(8 * torch.randn(512, 4, 1, generator=gen))
    x[0, 0] = 0.0
    x8, e = ref.quantize(x)
    back = ref.dequantize(x8, e)
    amax = x.abs().amax(-1)
    scaled_max = amax / ref.pow2(e)
    # The row's largest magnitude lands in (224, 448]: e is the smallest exponent that fits it.
    nonzero = amax > 0
    assert (scaled_max[nonzero] <= 448).all() and (scaled_max[nonzero] > 224).all()
    # Per element: half a unit in the last place of e4m3 (2^-4 relative) above 2^-6 * 2^e, else 2^-10 * 2^e.
    err = (back - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, 2.0**-10 * ref.pow2(e).unsqueeze(-1))
    assert (err <= bound * (1 + 1e-6)).all()
    # RMS over normal-distributed rows: 2.4% measured.
    assert rel_rms(back, x) < 3e-2
    # An all-zero row stays zero, with the smallest exponent.
    assert (back[0, 0] == 0).all() and e[0, 0] == ref.MIN_EXP


def test_exponent_at_the_boundaries():
    # 448 * 2^k fits exactly with e = k; anything just over needs e = k + 1 (and then stores 224).
    x = torch.zeros(4, 8)
    x[0, 0], x[1, 0], x[2, 3], x[3, 5] = 448.0, 448.0 * 1.0001, 448.0 * 2.0**-20, -448.0 * 2.0**10
    e = ref.row_exponents(x)
    assert e.tolist() == [0, 1, -20, 10]
    x8, _ = ref.quantize(x)
    assert x8.float().abs().amax(-1).tolist() == [448.0, 224.0, 448.0, 448.0]


def test_write_kv_triton_stores_the_reference_bytes():
    page, heads, dim, blocks = 16, 3, 48, 6
    gen = torch.Generator().manual_seed(1)
    n = 40
    k = (torch.randn(n, heads, dim, generator=gen) * torch.exp(4 * torch.randn(n, heads, 1, generator=gen))).to(DEVICE, DTYPE)
    v = torch.randn(n, heads, dim, generator=gen).to(DEVICE, DTYPE)
    slots = torch.randperm(blocks * page, generator=gen)[:n].to(DEVICE)
    slots[5] = -1
    k_ref, v_ref, s_ref = fp8_cache(blocks, page, heads, dim)
    k_tri, v_tri, s_tri = fp8_cache(blocks, page, heads, dim)
    pa.write_kv(k, v, k_ref, v_ref, slots, impl="ref", scales=s_ref)
    pa.write_kv(k, v, k_tri, v_tri, slots, impl="triton", scales=s_tri)
    assert same_bytes(k_tri, k_ref) and same_bytes(v_tri, v_ref)
    assert torch.equal(s_tri[0], s_ref[0]) and torch.equal(s_tri[1], s_ref[1])
    # The padding token's row was left alone (still NaN).
    kept = slots[slots >= 0]
    assert torch.isnan(k_tri.float()).sum() == (blocks * page - kept.numel()) * heads * dim


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_rotary_write_kv_fp8_equals_rotary_then_quantized_write(impl):
    n, hq, hkv, dim, page, blocks = 11, 4, 2, 32, 16, 3
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(n, hq, dim, generator=gen).to(DEVICE, DTYPE)
    k = (torch.randn(n, hkv, dim, generator=gen) * 30).to(DEVICE, DTYPE)
    v = torch.randn(n, hkv, dim, generator=gen).to(DEVICE, DTYPE)
    positions = torch.randint(0, 100, (n,), generator=gen).to(DEVICE)
    angles = torch.arange(128.0)[:, None] * 0.7 ** torch.arange(dim // 2.0)[None, :]
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    slots = torch.randperm(blocks * page, generator=gen)[:n].to(DEVICE)
    slots[0] = -1
    k_want, v_want, s_want = fp8_cache(blocks, page, hkv, dim)
    q_rot, k_rot = rotary.apply_rotary(q, k, positions, cos, sin, impl="ref")
    pa.write_kv(k_rot, v, k_want, v_want, slots, impl="ref", scales=s_want)
    k_got, v_got, s_got = fp8_cache(blocks, page, hkv, dim)
    q2, k2 = q.clone(), k.clone()
    rotary.apply_rotary_write_kv(q2, k2, v, positions, cos, sin, k_got, v_got, slots, impl=impl, scales=s_got)
    assert same_bytes(k_got, k_want) and same_bytes(v_got, v_want)
    assert torch.equal(s_got[0], s_want[0]) and torch.equal(s_got[1], s_want[1])
    assert rel_rms(q2, q_rot) < TOL


@pytest.mark.parametrize("seq_lens,page,group,heads,dim,num_splits,variant", [
    ([37, 5, 64], 16, 2, 2, 64, None, "split"),
    ([130, 1], 32, 4, 1, 48, 3, "split"),
    ([200], 16, 1, 2, 64, None, "long"),
    ([70, 9], 16, 3, 2, 32, 2, "long"),
])
def test_decode_fp8_triton_matches_ref(seq_lens, page, group, heads, dim, num_splits, variant):
    k8, v8, scales, kf, vf, tables, lens = filled_cache(seq_lens, page, heads, dim)
    q = torch.randn(len(seq_lens), group * heads, dim, generator=torch.Generator().manual_seed(3)).to(DEVICE, DTYPE)
    scale = dim**-0.5
    want = pa.paged_decode_attention(q, k8, v8, tables, lens, scale, impl="ref", scales=scales)
    ws = pa.decode_workspace(len(seq_lens), q.shape[1], heads, dim, max(seq_lens), DEVICE, num_splits=num_splits, variant=variant)
    got = pa.paged_decode_attention(q, k8, v8, tables, lens, scale, impl="triton", workspace=ws, scales=scales)
    assert not torch.isnan(got).any()
    assert rel_rms(got, want) < TOL
    exact = pa.paged_decode_attention(q, kf, vf, tables, lens, scale, impl="ref")
    assert rel_rms(want, exact) < FP8_VS_FLOAT_TOL


@pytest.mark.parametrize("variant", ["split", "long"])
def test_decode_fp8_rope_writes_the_reference_row(variant):
    seq_lens, page, group, heads, dim = [33, 16, 1], 16, 2, 2, 32
    k8, v8, scales, _, _, tables, lens = filled_cache(seq_lens, page, heads, dim, seed=4)
    gen = torch.Generator().manual_seed(5)
    b = len(seq_lens)
    q = torch.randn(b, group * heads, dim, generator=gen).to(DEVICE, DTYPE)
    k_new = (torch.randn(b, heads, dim, generator=gen) * 7).to(DEVICE, DTYPE)
    v_new = torch.randn(b, heads, dim, generator=gen).to(DEVICE, DTYPE)
    angles = torch.arange(64.0)[:, None] * 0.8 ** torch.arange(dim // 2.0)[None, :]
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    # The step's row is the last of each sequence: the kernel rotates, quantizes and writes it.
    caches = {impl: (k8.clone(), v8.clone(), (scales[0].clone(), scales[1].clone())) for impl in ("ref", "triton")}
    out = {}
    for impl, (kc, vc, sc) in caches.items():
        ws = pa.decode_workspace(b, q.shape[1], heads, dim, max(seq_lens), DEVICE, variant=variant) if impl == "triton" else None
        out[impl] = pa.paged_decode_attention(q, kc, vc, tables, lens, dim**-0.5, impl=impl, workspace=ws,
                                              rope=(k_new, v_new, cos, sin), scales=sc)
    (kr, vr, sr), (kt, vt, st) = caches["ref"], caches["triton"]
    assert same_bytes(kt, kr) and same_bytes(vt, vr) and torch.equal(st[0], sr[0]) and torch.equal(st[1], sr[1])
    assert rel_rms(out["triton"], out["ref"]) < TOL


@pytest.mark.parametrize("q_lens,seq_lens,page,group,heads,dim,causal,num_splits", [
    ([7, 5], [40, 5], 16, 2, 2, 64, True, None),
    ([3, 20], [100, 20], 32, 1, 2, 48, False, None),
    ([16], [300], 16, 2, 1, 32, False, 3),
    ([9, 1], [9, 70], 16, 4, 1, 64, True, 2),
])
def test_prefill_fp8_triton_matches_ref(q_lens, seq_lens, page, group, heads, dim, causal, num_splits):
    k8, v8, scales, kf, vf, tables, lens = filled_cache(seq_lens, page, heads, dim, seed=6)
    q = torch.randn(sum(q_lens), group * heads, dim, generator=torch.Generator().manual_seed(7)).to(DEVICE, DTYPE)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(DEVICE)
    scale = dim**-0.5
    want = pa.paged_prefill_attention(q, k8, v8, tables, lens, cu, scale, causal=causal, impl="ref", scales=scales)
    got = pa_triton.paged_prefill_attention(q, k8, v8, tables, lens, cu, scale, causal=causal, max_seqlen_q=max(q_lens),
                                            num_splits=num_splits, scales=scales)
    assert not torch.isnan(got).any()
    assert rel_rms(got, want) < TOL
    exact = pa.paged_prefill_attention(q, kf, vf, tables, lens, cu, scale, causal=causal, impl="ref")
    assert rel_rms(want, exact) < FP8_VS_FLOAT_TOL


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_scales_must_match_the_cache(impl):
    k8, v8, scales = fp8_cache(2, 16, 2, 32)
    kf = torch.zeros(2, 16, 2, 32, device=DEVICE, dtype=DTYPE)
    k = torch.randn(3, 2, 32, device=DEVICE, dtype=DTYPE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="needs scales"):
        pa.write_kv(k, k, k8, v8, slots, impl=impl)
    with pytest.raises(ValueError, match="are for fp8 caches"):
        pa.write_kv(k, k, kf, kf.clone(), slots, impl=impl, scales=scales)
    with pytest.raises(ValueError, match="int8 tensors"):
        pa.write_kv(k, k, k8, v8, slots, impl=impl, scales=(scales[0][:1], scales[1]))
    q = torch.randn(1, 4, 32, device=DEVICE, dtype=DTYPE)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="needs scales"):
        pa.paged_decode_attention(q, k8, v8, tables, lens, 1.0, impl=impl)


def gpu_only(test):
    return pytest.mark.gpu(pytest.mark.skipif(not GPU, reason="needs a GPU")(test))


@gpu_only
@pytest.mark.parametrize("seq_lens,page,group,heads,dim,variant", [
    ([8192], 16, 4, 8, 64, "long"),
    ([32768], 16, 4, 8, 128, "long"),
    ([4096, 1000, 3], 128, 4, 8, 128, "split"),
    ([2049] * 16, 16, 4, 8, 64, "split"),
])
def test_gpu_decode_fp8_long_contexts(seq_lens, page, group, heads, dim, variant):
    k8, v8, scales, kf, vf, tables, lens = filled_cache(seq_lens, page, heads, dim, seed=8)
    q = torch.randn(len(seq_lens), group * heads, dim, device=DEVICE).to(DTYPE)
    want = pa.paged_decode_attention(q, k8, v8, tables, lens, dim**-0.5, impl="ref", scales=scales)
    ws = pa.decode_workspace(len(seq_lens), q.shape[1], heads, dim, max(seq_lens), DEVICE, variant=variant)
    got = pa.paged_decode_attention(q, k8, v8, tables, lens, dim**-0.5, impl="triton", workspace=ws, scales=scales)
    assert rel_rms(got, want) < TOL


@gpu_only
def test_gpu_prefill_fp8_long_prompt():
    k8, v8, scales, _, _, tables, lens = filled_cache([4096], 16, 2, 64, seed=9)
    q = torch.randn(4096, 8, 64, device=DEVICE).to(DTYPE)
    cu = torch.tensor([0, 4096], dtype=torch.int32, device=DEVICE)
    want = pa.paged_prefill_attention(q, k8, v8, tables, lens, cu, 0.125, causal=True, impl="ref", scales=scales)
    got = pa.paged_prefill_attention(q, k8, v8, tables, lens, cu, 0.125, causal=True, impl="triton", max_seqlen_q=4096,
                                     scales=scales)
    assert rel_rms(got, want) < TOL
