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
"""

import torch


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Scatter new rows `k`, `v` `[N, Hkv, D]` into the caches at flat slots `slot_mapping` `[N]`.

    Slot s is page s // block_size, row s % block_size; a negative slot (padding token) is skipped.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    # Indexed, not viewed flat: the caches may be any strided view (a head-major pool).
    k_cache[slots // block_size, slots % block_size] = k[keep].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = v[keep].to(v_cache.dtype)


def gather_kv(k_cache, v_cache, block_table, seq_len):
    """Step 1: K and V `[seq_len, Hkv, D]` float32 of one sequence, read through its block table."""
    block_size = k_cache.shape[1]
    pos = torch.arange(seq_len, device=k_cache.device)
    pages = block_table.long()[pos // block_size]
    rows = pos % block_size
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


def rope_write(q, k, v, cos, sin, k_cache, v_cache, block_tables, seq_lens):
    """The step before decode when it is given `rope`: q `[B, Hq, D]` and k `[B, Hkv, D]` rotated at
    position seq_len - 1, the rotated k and v written into the cache at that position (sequences with
    seq_len 0 skipped); returns the rotated q."""
    pos = (seq_lens.long() - 1).clamp(min=0)
    block_size = k_cache.shape[1]
    pages = block_tables.long().gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
    slots = torch.where(seq_lens > 0, pages * block_size + pos % block_size, -1)
    write_kv(rotate_ref(k, pos, cos, sin), v, k_cache, v_cache, slots)
    return rotate_ref(q, pos, cos, sin)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """One query per sequence, q `[B, Hq, D]` at position seq_len - 1, over all seq_len positions."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], seq_len)
        q_pos = torch.tensor([seq_len - 1], device=q.device)
        out[b] = attend(q[b : b + 1], k, v, q_pos, scale, causal=True)[0]
    return out.to(q.dtype)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, causal):
    """Packed queries q `[total_q, Hq, D]`; sequence b's q_len_b queries are its last q_len_b positions."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], seq_len)
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
