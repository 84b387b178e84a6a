"""Paged attention: Triton kernels against the float32 reference (write_kv, decode, prefill).

On the CPU these run under the Triton interpreter in float32 with small sizes; on a GPU the same
tests run in bfloat16, plus bigger GPU-only cases (long and odd lengths, head dim 80, CUDA graphs).
Cache slots no sequence owns are filled with NaN, so a kernel that reads past a sequence fails.
"""

import pytest
import torch

from declab_kernels import paged_attention as pa

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
# The interpreter computes tl.dot wrongly on bf16 inputs, so CPU tests use float32.
DTYPE = torch.bfloat16 if GPU else torch.float32
TOL = 2e-2 if GPU else 1e-4


def gpu_only(test):
    """Marks a test `gpu` and skips it without a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not GPU, reason="needs a GPU")(test))


# The Triton interpreter warns on every loop bound it reads from a loaded scalar.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def rel_rms(a, b):
    """||a - b|| / ||b|| in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def make_cache(seq_lens, page, num_kv_heads, head_dim, *, shuffle=True, dtype=DTYPE, seed=0, head_major=False):
    """Random paged caches holding `seq_lens` positions, their block tables, and NaN everywhere else.

    Pages are handed out in a random order when `shuffle`; unused block-table entries point at
    random pages (whose unused rows are NaN), as a real allocator may leave them. `head_major`: the
    same values stored `[num_blocks, Hkv, page, D]` and seen through the kernels' layout (a
    transposed view, which every kernel takes through its strides).
    """
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page) for n in seq_lens]
    max_blocks = max(pages_per_seq) + 1
    num_blocks = sum(pages_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen, dtype=torch.int32)
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    next_page = 0
    for b, (n, count) in enumerate(zip(seq_lens, pages_per_seq)):
        ids = order[next_page : next_page + count]
        next_page += count
        block_tables[b, :count] = ids
        pos = torch.arange(n)
        k_cache[ids[pos // page], pos % page] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v_cache[ids[pos // page], pos % page] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    k_cache, v_cache = k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype)
    if head_major:
        k_cache, v_cache = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache))
        assert k_cache.stride(2) == page * head_dim
    return k_cache, v_cache, block_tables.to(DEVICE), seq_lens.to(DEVICE)


def run_decode(seq_lens, page, group, num_kv_heads, head_dim, *, shuffle=True, num_splits=None, tol=TOL,
               variant="split", head_major=False):
    k_cache, v_cache, block_tables, lens = make_cache(seq_lens, page, num_kv_heads, head_dim, shuffle=shuffle,
                                                      head_major=head_major)
    q = torch.randn(len(seq_lens), group * num_kv_heads, head_dim, device=DEVICE).to(DTYPE)
    scale = head_dim**-0.5
    want = pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale, impl="ref")
    workspace = None
    if num_splits is not None or variant != "split":
        workspace = pa.decode_workspace(len(seq_lens), q.shape[1], num_kv_heads, head_dim, max(seq_lens), DEVICE,
                                        num_splits=num_splits, variant=variant)
    out = torch.full_like(q, float("nan"))
    got = pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale, impl="triton", out=out,
                                    workspace=workspace)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any()
    assert got.dtype == q.dtype
    assert rel_rms(got, want) < tol


def run_prefill(q_lens, seq_lens, page, group, num_kv_heads, head_dim, causal, *, tol=TOL, num_splits=None,
                head_major=False):
    k_cache, v_cache, block_tables, lens = make_cache(seq_lens, page, num_kv_heads, head_dim, head_major=head_major)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    q = torch.randn(sum(q_lens), group * num_kv_heads, head_dim, device=DEVICE).to(DTYPE)
    scale = head_dim**-0.5
    want = pa.paged_prefill_attention(q, k_cache, v_cache, block_tables, lens, cu, scale, causal=causal, impl="ref")
    if num_splits is None:
        got = pa.paged_prefill_attention(q, k_cache, v_cache, block_tables, lens, cu, scale, causal=causal,
                                         impl="triton", max_seqlen_q=max(q_lens))
    else:
        from declab_kernels.paged_attention import triton as pa_triton

        got = pa_triton.paged_prefill_attention(q, k_cache, v_cache, block_tables, lens, cu, scale, causal=causal,
                                                max_seqlen_q=max(q_lens), num_splits=num_splits)
    assert not torch.isnan(got).any()
    assert got.dtype == q.dtype
    assert rel_rms(got, want) < tol


def test_write_kv_ref_vs_triton():
    page, num_kv_heads, head_dim, num_blocks = 16, 2, 64, 5
    k_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, device=DEVICE).to(DTYPE)
    v_cache = torch.randn_like(k_cache)
    before = k_cache.clone()
    slots = torch.randperm(num_blocks * page)[:9].to(DEVICE)
    # A negative slot is a padding token and must be skipped.
    slots[4] = -1
    k = torch.randn(9, num_kv_heads, head_dim, device=DEVICE).to(DTYPE)
    v = torch.randn_like(k)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    pa.write_kv(k, v, k_ref, v_ref, slots, impl="ref")
    pa.write_kv(k, v, k_cache, v_cache, slots, impl="triton")
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    written = slots >= 0
    assert torch.equal(k_cache.flatten(0, 1)[slots[written]], k[written])
    assert torch.equal(v_cache.flatten(0, 1)[slots[written]], v[written])
    untouched = torch.ones(num_blocks * page, dtype=torch.bool, device=DEVICE)
    untouched[slots[written]] = False
    assert torch.equal(k_cache.flatten(0, 1)[untouched], before.flatten(0, 1)[untouched])


@pytest.mark.parametrize(
    "seq_lens,page,group,num_kv_heads,head_dim",
    [
        ([17, 1, 300], 16, 1, 2, 64),
        ([300, 17, 1], 64, 4, 2, 128),
        ([1, 300, 17], 256, 8, 1, 64),
        ([33, 5], 16, 2, 2, 80),
    ],
)
def test_decode_ref_vs_triton(seq_lens, page, group, num_kv_heads, head_dim):
    run_decode(seq_lens, page, group, num_kv_heads, head_dim)


@pytest.mark.parametrize("num_splits", [1, 7])
def test_decode_ref_vs_triton_fixed_splits(num_splits):
    # 7 splits over lengths 1..300: most splits of the short sequences are empty and exit early.
    run_decode([300, 1, 17], 16, 4, 1, 64, num_splits=num_splits)


@pytest.mark.parametrize("variant", ["long"])
@pytest.mark.parametrize(
    "seq_lens,page,group,num_kv_heads,head_dim,num_splits",
    [
        # 33 splits: the flat merge's padded split range (64) is larger than the splits in use
        ([300, 1, 17], 16, 4, 1, 64, 33),
        ([17, 1, 300], 16, 1, 2, 64, None),
        ([300, 17], 64, 8, 1, 128, 7),
        ([33, 5], 256, 2, 2, 80, 3),
    ],
)
def test_decode_ref_vs_triton_variants(seq_lens, page, group, num_kv_heads, head_dim, num_splits, variant):
    run_decode(seq_lens, page, group, num_kv_heads, head_dim, num_splits=num_splits, variant=variant)


def rope_tables(max_pos, head_dim):
    """RoPE cos / sin tables [max_pos, D/2] float32 (base 10000)."""
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)


def run_decode_rope(seq_lens, page, group, num_kv_heads, head_dim, *, num_splits=None, variant="split", tol=TOL,
                    head_major=False):
    """Decode with the step's RoPE and cache write folded in, against the reference doing them first."""
    k_cache, v_cache, block_tables, lens = make_cache(seq_lens, page, num_kv_heads, head_dim, head_major=head_major)
    # The step's own row (position seq_len - 1) is not in the cache yet: NaN there until written.
    for b, n in enumerate(seq_lens):
        if n:
            k_cache[block_tables[b, (n - 1) // page], (n - 1) % page] = float("nan")
            v_cache[block_tables[b, (n - 1) // page], (n - 1) % page] = float("nan")
    B, hq = len(seq_lens), group * num_kv_heads
    # q, k, v as views into one projection output, as the model makes them
    qkv = torch.randn(B, hq + 2 * num_kv_heads, head_dim, device=DEVICE).to(DTYPE)
    q, k, v = qkv.split([hq, num_kv_heads, num_kv_heads], dim=1)
    cos, sin = rope_tables(max(seq_lens) + 3, head_dim)
    scale = head_dim**-0.5
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    want = pa.paged_decode_attention(q, kc_ref, vc_ref, block_tables, lens, scale, impl="ref", rope=(k, v, cos, sin))
    before = qkv.clone()
    workspace = pa.decode_workspace(B, hq, num_kv_heads, head_dim, max(seq_lens), DEVICE, num_splits=num_splits,
                                    variant=variant)
    got = pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale, impl="triton",
                                    workspace=workspace, rope=(k, v, cos, sin))
    assert not torch.isnan(got).any()
    assert rel_rms(got, want) < tol
    assert torch.equal(qkv, before)
    # The rotated k and v landed where the reference put them, and nothing else changed.
    torch.testing.assert_close(k_cache, kc_ref, equal_nan=True, rtol=tol, atol=tol)
    torch.testing.assert_close(v_cache, vc_ref, equal_nan=True, rtol=0, atol=0)
    assert not any(torch.isnan(k_cache[block_tables[b, (n - 1) // page], (n - 1) % page]).any()
                   for b, n in enumerate(seq_lens) if n)


@pytest.mark.parametrize(
    "seq_lens,page,group,num_kv_heads,head_dim,num_splits,variant",
    [
        ([17, 1, 300], 16, 1, 2, 64, None, "split"),
        ([300, 0, 17], 16, 4, 1, 64, 7, "split"),  # the new row in the last of 7 splits; a padding slot
        ([33, 5], 16, 2, 2, 80, 3, "long"),  # D=80: the halves are not the padded tile's
        ([300, 17], 64, 8, 1, 128, None, "long"),
    ],
)
def test_decode_rope_folded_in_matches_ref(seq_lens, page, group, num_kv_heads, head_dim, num_splits, variant):
    run_decode_rope(seq_lens, page, group, num_kv_heads, head_dim, num_splits=num_splits, variant=variant)


def test_decode_rope_bad_shapes_are_an_error():
    k_cache, v_cache, block_tables, lens = make_cache([5], 16, 2, 64)
    q = torch.randn(1, 4, 64, device=DEVICE).to(DTYPE)
    k = torch.randn(1, 2, 64, device=DEVICE).to(DTYPE)
    cos, sin = rope_tables(8, 64)
    with pytest.raises(ValueError, match="rope k and v"):
        pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1, impl="triton", rope=(k[:, :1], k, cos, sin))
    with pytest.raises(ValueError, match="rope tables"):
        pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1, impl="triton", rope=(k, k, cos.double(), sin))


@pytest.mark.parametrize("variant", ["split", "long"])
def test_head_major_caches_match_ref(variant):
    # Head-major storage seen as a transposed view: every kernel reads the caches through their strides.
    run_decode([300, 1, 17], 16, 4, 2, 64, num_splits=7, variant=variant, head_major=True)
    run_decode_rope([17, 300], 16, 2, 2, 80, num_splits=3, variant=variant, head_major=True)
    run_prefill([17, 1, 100], [17, 40, 300], 16, 4, 2, 64, causal=True, head_major=True)
    run_prefill([32], [300], 16, 4, 2, 64, causal=False, num_splits=3, head_major=True)


def test_write_kv_head_major_cache():
    k_cache, v_cache, _, _ = make_cache([40], 16, 2, 64, head_major=True)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([3, -1, 17, 40], device=DEVICE)
    k = torch.randn(4, 2, 64, device=DEVICE).to(DTYPE)
    v = torch.randn_like(k)
    pa.write_kv(k, v, k_ref, v_ref, slots, impl="ref")
    pa.write_kv(k, v, k_cache, v_cache, slots, impl="triton")
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(k_cache[2, 8], k[3]) and torch.equal(v_cache[0, 3], v[0])


def test_decode_unknown_variant_is_an_error():
    with pytest.raises(ValueError):
        pa.decode_workspace(1, 4, 1, 64, 16, DEVICE, variant="fast")


def test_decode_ref_vs_triton_contiguous_vs_shuffled_pages():
    run_decode([150, 40], 16, 4, 2, 64, shuffle=False)
    run_decode([150, 40], 16, 4, 2, 64, shuffle=True)


@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_ref_vs_triton_empty_sequence_gives_zero(num_splits):
    k_cache, v_cache, block_tables, _ = make_cache([20, 5], 16, 1, 64)
    lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, 64, device=DEVICE).to(DTYPE)
    workspace = pa.decode_workspace(2, 4, 1, 64, 32, DEVICE, num_splits=num_splits)
    out = torch.full_like(q, float("nan"))
    pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125, impl="triton", out=out,
                              workspace=workspace)
    want = pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125, impl="ref")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_rms(out, want) < TOL


def test_decode_ref_vs_triton_workspace_shared_by_calls():
    # One workspace serves every layer's call: the split counters return to zero after each call,
    # so the program that merges the partials is found again in the next one.
    workspace = pa.decode_workspace(3, 8, 2, 64, 300, DEVICE, num_splits=5)
    for seed in (0, 1, 2):
        k_cache, v_cache, block_tables, lens = make_cache([300, 90, 1], 16, 2, 64, seed=seed)
        q = torch.randn(3, 8, 64, device=DEVICE).to(DTYPE)
        out = torch.full_like(q, float("nan"))
        pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125, impl="triton", out=out,
                                  workspace=workspace)
        want = pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125, impl="ref")
        assert rel_rms(out, want) < TOL
        assert not workspace.counters.any()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "q_lens,seq_lens,page,group,num_kv_heads,head_dim",
    [
        # one-shot prefill of mixed lengths
        ([17, 1, 300], [17, 1, 300], 16, 1, 2, 64),
        # chunked prefill / Mask-Predict canvas after a cached prefix
        ([5, 130, 1], [300, 147, 17], 64, 4, 1, 128),
        ([40, 17], [300, 17], 256, 8, 1, 64),
        ([20], [90], 16, 2, 1, 80),
        # prefix 62: the first query's own position is the last of the first 64-key tile
        ([200], [262], 16, 2, 1, 64),
    ],
)
def test_prefill_ref_vs_triton(q_lens, seq_lens, page, group, num_kv_heads, head_dim, causal):
    run_prefill(q_lens, seq_lens, page, group, num_kv_heads, head_dim, causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize(
    "q_lens,seq_lens,page,group,num_kv_heads,head_dim",
    [
        # a Mask-Predict block over a long prefix, and a second sequence whose later splits are empty
        ([32, 5], [700, 5], 16, 4, 2, 64),
        # a query run longer than the tile, prefix not a multiple of the key tile; D padded
        ([150, 1], [333, 77], 32, 2, 1, 80),
    ],
)
def test_prefill_key_splits_match_ref(q_lens, seq_lens, page, group, num_kv_heads, head_dim, causal, num_splits):
    run_prefill(q_lens, seq_lens, page, group, num_kv_heads, head_dim, causal, num_splits=num_splits)


def test_prefill_splits_only_when_the_query_tiles_leave_sms_idle():
    from declab_kernels.paged_attention.triton import (MIN_PREFILL_SPLIT_TOKENS, PREFILL_PROGRAMS_PER_SM, choose_num_splits,
                                                prefill_config)

    def splits(programs, max_kv_len):
        return choose_num_splits(programs, max_kv_len, 132, block_n=prefill_config(64).block_n,
                                 programs_per_sm=PREFILL_PROGRAMS_PER_SM, min_split_tokens=MIN_PREFILL_SPLIT_TOKENS)

    # Many query tiles (a 4k-token prompt chunk): no split.
    assert splits(32 * 32, 131072) == 1
    # One 32-query block, 32 heads, over 32k keys: two programs per SM, one wave (8 x 32 <= 264).
    assert splits(32, 32768) == 8
    # A short prefix caps the splits at one per 256 keys.
    assert splits(32, 600) == 3


def test_decode_splits_all_hold_data_at_the_bound():
    from declab_kernels.paged_attention.triton import DECODE_VARIANTS, choose_num_splits

    long = DECODE_VARIANTS["long"]

    def splits(programs, max_seq_len, block_n=128):
        return choose_num_splits(programs, max_seq_len, 132, block_n=block_n, programs_per_sm=long.programs_per_sm,
                                 min_split_tokens=long.min_split_tokens)

    # A batch-1 llama-1b layer (8 kv heads, 128-key tiles): two programs an SM want 33 splits; at 4k
    # the 32 tiles cap them, past it 33 would give 32 runs of whole tiles and one empty split.
    for ctx in (4096, 8192, 32768, 131072):
        assert splits(8, ctx) == 32
    # Fewer tiles than wanted splits: one tile each.
    assert splits(8, 1000) == 8
    for programs in (1, 3, 8, 16, 40):
        for max_seq_len in (1, 127, 129, 5000, 8192, 65537):
            for block_n in (16, 64, 128):
                s = splits(programs, max_seq_len, block_n)
                tiles = -(-max_seq_len // block_n)
                per_split = -(-tiles // s)
                # the kernel's cut: every split holds data at the bound, none are left over
                assert (s - 1) * per_split < tiles <= s * per_split
                assert s <= max(1, 2 * 132 // programs)


def test_prefill_triton_chunked_equals_one_shot():
    # Writing a sequence's K/V in two chunks, attending after each, matches one causal pass.
    page, num_kv_heads, group, head_dim, n, split = 16, 2, 2, 64, 150, 61
    num_blocks = 12
    k_cache = torch.full((num_blocks, page, num_kv_heads, head_dim), float("nan"), device=DEVICE).to(DTYPE)
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.randperm(num_blocks)[None, : -(-n // page)].to(torch.int32).to(DEVICE)
    pos = torch.arange(n, device=DEVICE)
    slots = block_tables[0].long()[pos // page] * page + pos % page
    q = torch.randn(n, group * num_kv_heads, head_dim, device=DEVICE).to(DTYPE)
    k = torch.randn(n, num_kv_heads, head_dim, device=DEVICE).to(DTYPE)
    v = torch.randn_like(k)
    scale = head_dim**-0.5
    chunks = []
    for lo, hi in ((0, split), (split, n)):
        pa.write_kv(k[lo:hi], v[lo:hi], k_cache, v_cache, slots[lo:hi], impl="triton")
        lens = torch.tensor([hi], dtype=torch.int32, device=DEVICE)
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
        chunks.append(pa.paged_prefill_attention(q[lo:hi], k_cache, v_cache, block_tables, lens, cu, scale,
                                                 causal=True, impl="triton", max_seqlen_q=hi - lo))
    lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    whole = pa.paged_prefill_attention(q, k_cache, v_cache, block_tables, lens, cu, scale, causal=True, impl="ref")
    assert rel_rms(torch.cat(chunks), whole) < TOL


def test_decode_triton_matches_last_prefill_row():
    # The decode query at position L-1 sees exactly what the last causal prefill query sees.
    k_cache, v_cache, block_tables, lens = make_cache([77], 16, 2, 64)
    q = torch.randn(1, 8, 64, device=DEVICE).to(DTYPE)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    dec = pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125, impl="triton")
    pre = pa.paged_prefill_attention(q, k_cache, v_cache, block_tables, lens, cu, 0.125, causal=True,
                                     impl="triton", max_seqlen_q=1)
    assert rel_rms(dec, pre) < TOL


def test_bad_impl_is_an_error():
    k_cache, v_cache, block_tables, lens = make_cache([3], 16, 1, 64)
    q = torch.randn(1, 1, 64, device=DEVICE).to(DTYPE)
    with pytest.raises(ValueError):
        pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125, impl="auto")


@gpu_only
@pytest.mark.parametrize(
    "seq_lens,page,group,num_kv_heads,head_dim",
    [
        ([1, 17, 1000, 4097], 16, 1, 4, 64),
        ([4097, 1000, 17, 1], 64, 4, 2, 128),
        ([1000, 4097, 1, 17], 256, 8, 1, 128),
        ([4097, 17, 1000, 1], 16, 16, 1, 64),
        ([17, 4097, 1, 1000], 128, 4, 2, 80),
        ([32768], 16, 4, 8, 128),
    ],
)
def test_gpu_decode_ref_vs_triton(seq_lens, page, group, num_kv_heads, head_dim):
    run_decode(seq_lens, page, group, num_kv_heads, head_dim)


@gpu_only
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "q_lens,seq_lens,page,group,num_kv_heads,head_dim",
    [
        ([4097, 1, 17, 1000], [4097, 1, 17, 1000], 16, 4, 2, 128),
        ([300, 1, 1000], [4097, 17, 1000], 64, 8, 1, 64),
        ([64, 1000], [1000, 4097], 256, 1, 4, 128),
        ([999, 17], [4097, 17], 128, 4, 2, 80),
        # a Mask-Predict block over a 32k prefix: key splits
        ([32], [32768], 16, 4, 8, 64),
    ],
)
def test_gpu_prefill_ref_vs_triton(q_lens, seq_lens, page, group, num_kv_heads, head_dim, causal):
    run_prefill(q_lens, seq_lens, page, group, num_kv_heads, head_dim, causal)


@gpu_only
@pytest.mark.parametrize("variant", ["long"])
@pytest.mark.parametrize(
    "seq_lens,page,group,num_kv_heads,head_dim",
    [
        ([4097], 16, 4, 8, 128),
        ([32768], 16, 4, 8, 64),
        ([1, 17, 1000, 4097], 64, 8, 1, 128),
        ([17, 4097, 1, 1000], 128, 4, 2, 80),
    ],
)
def test_gpu_decode_ref_vs_triton_variants(seq_lens, page, group, num_kv_heads, head_dim, variant):
    run_decode(seq_lens, page, group, num_kv_heads, head_dim, variant=variant)


@gpu_only
@pytest.mark.parametrize("variant", ["split", "long"])
@pytest.mark.parametrize(
    "seq_lens,page,group,num_kv_heads,head_dim",
    [
        ([1, 17, 1000, 4097], 16, 4, 8, 64),
        ([4097, 0, 17], 64, 4, 2, 128),
        ([17, 4097, 1, 1000], 128, 4, 2, 80),
    ],
)
def test_gpu_decode_rope_folded_in(seq_lens, page, group, num_kv_heads, head_dim, variant):
    run_decode_rope(seq_lens, page, group, num_kv_heads, head_dim, variant=variant)


@gpu_only
@pytest.mark.parametrize("variant", ["split", "long"])
def test_gpu_decode_triton_cuda_graph_replay(variant):
    # Captured once, replayed after the lengths and queries change in place: no host sync inside.
    k_cache, v_cache, block_tables, _ = make_cache([4000, 4000, 2500, 2500], 16, 4, 128)
    lens = torch.tensor([4000, 1, 2500, 17], dtype=torch.int32, device=DEVICE)
    q = torch.randn(4, 16, 128, device=DEVICE).to(DTYPE)
    out = torch.empty_like(q)
    workspace = pa.decode_workspace(4, 16, 4, 128, 4096, DEVICE, variant=variant)

    def step():
        pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 128**-0.5, impl="triton", out=out,
                                  workspace=workspace)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    lens.copy_(torch.tensor([17, 4000, 1, 2500], dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = pa.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 128**-0.5, impl="ref")
    assert not torch.isnan(out).any()
    assert rel_rms(out, want) < TOL
    assert not workspace.counters.any()


class _LaunchRecorder:
    """Stands in for a Triton kernel: records, per launch, what Triton keys its compiled variants
    on. Every keyword argument is a constexpr or a launch option (the launches here pass nothing
    else by keyword); of the positional arguments, an integer Triton specialises counts as 1, a
    multiple of 16 or neither, and a tensor by its dtype and whether it is 16-byte aligned."""

    def __init__(self, kernel):
        options = getattr(kernel, "kwargs", {})  # the interpreter keeps jit's options here
        dns = getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize") or []
        self.names, self.unspecialised, self.keys, self.launches = kernel.arg_names, set(dns), set(), 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            key = []
            for name, arg in zip(self.names, args):
                if isinstance(arg, torch.Tensor):
                    key.append((name, arg.dtype, arg.data_ptr() % 16 == 0))
                elif isinstance(arg, int) and name not in self.unspecialised:
                    key.append((name, "1" if arg == 1 else "16" if arg % 16 == 0 else "other"))
            self.keys.add((tuple(key), tuple(sorted(kwargs.items()))))
            self.launches += 1
        return launch


def test_serving_chunks_of_a_long_prompt_compile_one_prefill_variant_per_query_tile(monkeypatch):
    """Every chunk a 1,024-token prompt can be cut into (alone, and beside a second prompt's first
    chunk, under block tables of several widths; llama-8b's heads on a 132-SM GPU) compiles one
    `_prefill_kernel` variant per query tile size (4), with or without key splits, and one merge
    variant: a serving run does not compile in the middle of its timed points (when the query
    count, the table width and the split count were specialised, the same launches made 35, and the merge 11)."""
    from declab_kernels.paged_attention import triton as tri

    prefill, merge = _LaunchRecorder(tri._prefill_kernel), _LaunchRecorder(tri._prefill_merge_kernel)
    monkeypatch.setattr(tri, "_prefill_kernel", prefill)
    monkeypatch.setattr(tri, "_prefill_merge_kernel", merge)
    monkeypatch.setattr(tri, "_num_sms", lambda device: 132)
    page, hq, hkv, d, prompt = 16, 32, 8, 128, 1024
    k_cache = torch.zeros(2 * prompt // page + 8, page, hkv, d, dtype=torch.bfloat16)
    for width in (prompt // page, prompt // page + 1, 80, 2 * prompt // page):
        for start in range(0, prompt, 97):
            for length in range(1, prompt - start + 1, 7):
                for beside in (0, 256):
                    q_lens, lens = [length] + [beside] * bool(beside), [start + length] + [beside] * bool(beside)
                    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
                    q = torch.empty(sum(q_lens), hq, d, dtype=torch.bfloat16)
                    tables = torch.zeros(len(lens), width, dtype=torch.int32)
                    tri.paged_prefill_attention(q, k_cache, k_cache, tables, torch.tensor(lens, dtype=torch.int32), cu,
                                                d ** -0.5, causal=True, max_seqlen_q=max(q_lens))
    block_ms = {dict(kw)["BLOCK_M"] for _, kw in prefill.keys}
    assert block_ms == {16, 32, 64, 128} and len(prefill.keys) == len(block_ms)
    # Some of them split their keys (a short chunk late in the prompt), each split count merged.
    assert 0 < merge.launches < prefill.launches and len(merge.keys) == 1
