"""Paged attention reference: float32 PyTorch, one sequence at a time, obviously right.

The KV cache is a pool of pages (PagedAttention, Kwon et al. 2023):
`k_cache`, `v_cache` are `[num_blocks, block_size, Hkv, D]`; sequence b's position p lives in page
`block_tables[b, p // block_size]` at row `p % block_size`. Every function below follows the same
steps:

1. gather the sequence's K/V rows through its block table;
2. expand the Hkv key/value heads to the Hq query heads (GQA: query head h reads kv head h // G);
3. scores = scale * q k^T;
4. mask the positions the query may not see (causal: kv position > query position);
5. softmax over kv positions;
6. output = probabilities @ v.

A sequence with no valid positions (seq_len 0, e.g. a padding slot) gives a zero output.

fp8 caches (`float8_e4m3fn`, `scales=(k_scale, v_scale)` int8 `[num_blocks, block_size, Hkv]`): every
K or V row of one kv head (D values) is stored as D e4m3 values and one power-of-two exponent e, the
row's value being fp8 * 2^e. On write (`quantize`), e is the smallest exponent that puts the row's
largest magnitude at or under 448 (the largest finite e4m3), found from the float32 bits of that
magnitude, so the kernels pick the same e and store the same bytes; step 1 multiplies back
(`dequantize`, exact in float32).
"""

import torch

FP8 = torch.float8_e4m3fn
# Exponents are clamped here so that 2^-e and 2^e are both normal float32 numbers (an all-zero row).
MIN_EXP = -126


def pow2(e):
    """2^e as float32 for integer e in [-126, 127], built from its bits (exact, as in the kernels)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def row_exponents(x):
    """x `[..., D]` -> int8 `[...]`: per row the smallest e with max |x| / 2^e <= 448 (at least MIN_EXP).

    With max |x| = m * 2^E (m in [1, 2)) and 448 = 1.75 * 2^8: e = E - 8 when m <= 1.75, else E - 7.
    """
    bits = x.float().abs().amax(-1).contiguous().view(torch.int32)
    e = (bits >> 23) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return e.clamp(min=MIN_EXP).to(torch.int8)


def quantize(x):
    """x `[..., D]` -> (float8_e4m3fn `[..., D]`, int8 exponents `[...]`), rounding to nearest."""
    e = row_exponents(x)
    return (x.float() * pow2(-e.to(torch.int32)).unsqueeze(-1)).to(FP8), e


def dequantize(x8, e):
    """The float32 rows that `quantize` stored as x8 `[..., D]` and exponents e `[...]`."""
    return x8.float() * pow2(e).unsqueeze(-1)


def check_scales(k_cache, v_cache, scales):
    """`scales` checked against the caches: two int8 `[num_blocks, block_size, Hkv]` tensors for an fp8
    cache, None for any other; raises ValueError otherwise. Returns them."""
    fp8 = k_cache.dtype == FP8
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the K and V caches must share a dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if scales is None:
        if fp8:
            raise ValueError("an fp8 cache needs scales=(k_scale, v_scale), the exponents of its rows")
        return None
    if not fp8:
        raise ValueError(f"scales are for fp8 caches; this cache is {k_cache.dtype}")
    k_scale, v_scale = scales
    want = tuple(k_cache.shape[:3])
    if (tuple(k_scale.shape) != want or tuple(v_scale.shape) != want or k_scale.dtype != torch.int8
            or v_scale.dtype != torch.int8 or k_scale.stride() != v_scale.stride()):
        raise ValueError(f"fp8 cache scales must be two int8 tensors {list(want)} laid out alike, "
                         f"got {tuple(k_scale.shape)} {k_scale.dtype} and {tuple(v_scale.shape)} {v_scale.dtype}")
    return scales


def write_kv(k, v, k_cache, v_cache, slot_mapping, scales=None):
    """Scatter new rows `k`, `v` `[N, Hkv, D]` into the caches at flat slots `slot_mapping` `[N]`.

    Slot s is page s // block_size, row s % block_size; a negative slot (padding token) is skipped.
    An fp8 cache gets each row quantized, its exponent into `scales`.
    """
    check_scales(k_cache, v_cache, scales)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    pages, rows = slots // block_size, slots % block_size
    if scales is not None:
        for new, cache, exps in ((k[keep], k_cache, scales[0]), (v[keep], v_cache, scales[1])):
            cache[pages, rows], exps[pages, rows] = quantize(new)
        return
    # Indexed, not viewed flat: the caches may be any strided view (a head-major pool).
    k_cache[pages, rows] = k[keep].to(k_cache.dtype)
    v_cache[pages, rows] = v[keep].to(v_cache.dtype)


def gather_kv(k_cache, v_cache, block_table, seq_len, scales=None):
    """Step 1: K and V `[seq_len, Hkv, D]` float32 of one sequence, read through its block table
    (and dequantized, for an fp8 cache)."""
    block_size = k_cache.shape[1]
    pos = torch.arange(seq_len, device=k_cache.device)
    pages = block_table.long()[pos // block_size]
    rows = pos % block_size
    if scales is not None:
        return dequantize(k_cache[pages, rows], scales[0][pages, rows]), dequantize(v_cache[pages, rows], scales[1][pages, rows])
    return k_cache[pages, rows].float(), v_cache[pages, rows].float()


def attend(q, k, v, q_pos, scale, causal):
    """Steps 2-6 for one sequence: q `[Lq, Hq, D]` at absolute positions `q_pos` `[Lq]`, k/v `[L, Hkv, D]`."""
    group = q.shape[1] // k.shape[1]
    # [L, Hq, D]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    # [Hq, Lq, L]
    scores = scale * torch.einsum("qhd,khd->hqk", q.float(), k)
    if causal:
        kv_pos = torch.arange(k.shape[0], device=q.device)
        scores = scores.masked_fill(kv_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # [Lq, Hq, D]
    return torch.einsum("hqk,khd->qhd", probs, v)


def rope_write(q, k, v, cos, sin, k_cache, v_cache, block_tables, seq_lens, scales=None):
    """The step before decode when it is given `rope`: q `[B, Hq, D]` and k `[B, Hkv, D]` rotated at
    position seq_len - 1, the rotated k and v written into the cache at that position (sequences with
    seq_len 0 skipped); returns the rotated q."""
    pos = (seq_lens.long() - 1).clamp(min=0)
    block_size = k_cache.shape[1]
    pages = block_tables.long().gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
    slots = torch.where(seq_lens > 0, pages * block_size + pos % block_size, -1)
    write_kv(rotate_ref(k, pos, cos, sin), v, k_cache, v_cache, slots, scales)
    return rotate_ref(q, pos, cos, sin)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, scales=None):
    """One query per sequence, q `[B, Hq, D]` at position seq_len - 1, over all seq_len positions."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], seq_len, scales)
        q_pos = torch.tensor([seq_len - 1], device=q.device)
        out[b] = attend(q[b : b + 1], k, v, q_pos, scale, causal=True)[0]
    return out.to(q.dtype)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, causal, scales=None):
    """Packed queries q `[total_q, Hq, D]`; sequence b's q_len_b queries are its last q_len_b positions."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], seq_len, scales)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        out[cu[b] : cu[b + 1]] = attend(q[cu[b] : cu[b + 1]], k, v, q_pos, scale, causal)
    return out.to(q.dtype)


def rotate_ref(x, positions, cos, sin):
    """x `[N, H, D]` at positions `[N]`, tables cos and sin `[P, D/2]` float32 -> `[N, H, D]` in x's dtype.

    With x = [x1, x2] (the two halves of the head dimension) and angle a = positions * inv_freq:
    [x1 cos a - x2 sin a, x2 cos a + x1 sin a].
    """
    c = cos[positions].unsqueeze(-2)  # [N, 1, D/2]
    s = sin[positions].unsqueeze(-2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
