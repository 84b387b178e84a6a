"""The transformer decoder: decoding over the paged cache equals the parallel forward."""

import pytest
import torch

import decoders
from decoders import Sampling
from decoders.base import UsageError


@pytest.fixture(scope="module")
def dec():
    return decoders.load("llama-tiny", device="cpu", dtype="float32", impl="ref")


@pytest.mark.parametrize("page_size", [16, 64])
def test_prefill_plus_steps_equal_the_parallel_forward(page_size):
    dec = decoders.load("llama-tiny", device="cpu", dtype="float32", impl="ref", page_size=page_size, prefill_chunk=7)
    tokens = torch.randint(0, dec.vocab_size, (3, 41))
    full = dec.logits(tokens)
    state = dec.prefill(tokens[:, :30], max_new_tokens=12)
    torch.testing.assert_close(state.first_logits, full[:, 29], rtol=1e-4, atol=1e-5)
    # Teacher forcing: feed the true next tokens instead of the sampled ones.
    with torch.inference_mode():
        for t in range(30, 41):
            state.next_tokens.copy_(tokens[:, t])
            out = dec.step(state)
            torch.testing.assert_close(out.logits, full[:, t], rtol=1e-4, atol=1e-5)
            assert out.committed.tolist() == [1, 1, 1]
    dec.release(state)


def test_greedy_generation_is_the_argmax_of_the_full_forward(dec):
    prompt = torch.randint(0, dec.vocab_size, (1, 9))
    gen = dec.generate(prompt, max_new_tokens=10)
    seq = prompt
    for _ in range(10):
        nxt = dec.logits(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert gen.tokens[0] == seq[0, 9:].tolist()
    assert gen.passes == 9 and len(gen.step_s) == 9 and gen.prefill_s > 0


def test_mixed_length_batch_matches_each_sequence_alone(dec):
    prompts = [[5, 6, 7], list(range(10, 40)), [1] * 17]
    together = dec.generate(prompts, max_new_tokens=6).tokens
    alone = [dec.generate([p], max_new_tokens=6).tokens[0] for p in prompts]
    assert together == alone


def test_sampling_is_seeded_and_respects_top_k(dec):
    prompt = [[3, 4, 5, 6]]
    a = dec.generate(prompt, 12, Sampling(temperature=1.0, top_k=5, seed=7)).tokens
    b = dec.generate(prompt, 12, Sampling(temperature=1.0, top_k=5, seed=7)).tokens
    assert a == b
    top1 = dec.generate(prompt, 12, Sampling(temperature=1.0, top_k=1, seed=7)).tokens
    assert top1 == dec.generate(prompt, 12).tokens


def test_blocks_are_returned_after_generation():
    dec = decoders.load("llama-tiny", device="cpu", dtype="float32", impl="ref", num_blocks=32)
    dec.generate([[1, 2, 3]] * 4, max_new_tokens=20)
    assert dec.pool.pool.num_free == 32


def test_a_pool_too_small_is_a_clear_error():
    from decoders.kv_cache import KVCacheExhausted

    dec = decoders.load("llama-tiny", device="cpu", dtype="float32", impl="ref", num_blocks=2)
    with pytest.raises(KVCacheExhausted):
        dec.generate([list(range(40))], max_new_tokens=4)


def test_context_over_the_maximum_is_refused(dec):
    with pytest.raises(UsageError, match="over llama-tiny's maximum of 8192"):
        dec.prefill([[1] * 8190], max_new_tokens=8)


def test_memory_counts_weights_and_kv(dec):
    c = dec.config
    mem = dec.memory(batch=2, ctx=100)
    kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    assert mem.state_bytes == 2 * 112 * kv_token
    assert mem.step_write_bytes == 2 * kv_token
    assert mem.step_read_bytes == dec.weight_bytes() + 2 * 100 * kv_token


@pytest.mark.interpreter
@pytest.mark.parametrize("prompts", [[list(range(3, 40)), [7, 8, 9]], [list(range(5, 30))]])
def test_triton_path_equals_the_reference(prompts):
    """Two sequences: norm kernels fused with the residual adds; one (one row a decode step,
    `declab_kernels.tuning.FOLD_ROWS`): each norm inside the GEMV after it and each add inside the one before."""
    from declab_kernels import tuning

    assert tuning.FOLD_ROWS == 1
    ref = decoders.load("llama-tiny", device="cpu", dtype="float32", impl="ref", seed=1)
    tri = decoders.load("llama-tiny", device="cpu", dtype="float32", impl="triton", seed=1)
    a, b = ref.prefill(prompts, max_new_tokens=2), tri.prefill(prompts, max_new_tokens=2)
    torch.testing.assert_close(b.first_logits, a.first_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tri.step(b).logits, ref.step(a).logits, rtol=1e-4, atol=1e-5)
    assert tri.generate(prompts, 6).tokens == ref.generate(prompts, 6).tokens


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["llama-tiny", "llama-1b"])
def test_triton_bf16_with_cuda_graphs_passes_the_correctness_gate_on_gpu(preset):
    """Triton in bf16 (CUDA graphs on) is as close to the float32 reference as the bf16 reference path is."""
    from decoders import harness

    tri = decoders.load(preset, device="cuda", dtype="bfloat16", impl="triton", seed=1)
    assert tri.cuda_graphs
    gate = harness.check_against_reference(tri, new_tokens=8)
    assert gate["ok"], gate
    assert gate["rel_rms"] < 5e-2, gate
