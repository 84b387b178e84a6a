"""RWKV-7 decoder (decoders.rwkv7): decoding equals the parallel forward, greedy generation is the
argmax token by token, chunked and resumed prefill equal one-shot prefill, prompts of different lengths
keep their own state, decode steps update the preallocated state in place, and the memory model."""

import pytest
import torch

import decoders
from decoders import UsageError
from decoders.rwkv7 import RWKV7Decoder


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def load(**options):
    return decoders.load("rwkv7-tiny", impl="ref", device="cpu", seed=1, **options)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def test_ref_prefill_and_steps_equal_parallel_forward():
    dec = load(prefill_chunk=8)
    lens, new = [19, 6, 11], 7
    ps = prompts(lens)
    state = dec.prefill(ps, max_new_tokens=new + 1)
    fed, logits = [], [state.first_logits]
    for _ in range(new):
        fed.append(state.next_tokens.clone())
        logits.append(dec.step(state).logits)
    fed = torch.stack(fed, 1).tolist()
    for i, n in enumerate(lens):
        full = dec.logits(torch.tensor([ps[i] + fed[i]]))[0]
        got = torch.stack([l[i] for l in logits])
        assert rel(got, full[n - 1 :]) < 1e-5


@torch.inference_mode()
def test_ref_greedy_generate_is_argmax_token_by_token():
    dec = load()
    ps = prompts([9, 4], seed=1)
    gen = dec.generate(ps, max_new_tokens=6)
    for p, out in zip(ps, gen.tokens):
        seq = p + out
        full = dec.logits(torch.tensor([seq]))[0]
        assert out == full[len(p) - 1 : -1].argmax(-1).tolist()


@torch.inference_mode()
@pytest.mark.parametrize("chunk", [3, 5, 16])
def test_ref_chunked_prefill_resumed_from_saved_state_equals_one_shot(chunk):
    one = load(prefill_chunk=4096)
    chunked = load(prefill_chunk=chunk)
    ps = prompts([23, 13], seed=2)
    cache = one.new_cache([23, 13], 30)
    expected = one.prefill_forward(cache, ps)
    head = [p[:10] for p in ps]
    tail = [p[10:] for p in ps]
    saved = chunked.new_cache([23, 13], 30)
    chunked.prefill_forward(saved, head)
    resumed = saved.clone()
    got = chunked.prefill_forward(resumed, tail)
    assert rel(got, expected) < 1e-5
    assert rel(resumed.wkv, cache.wkv) < 1e-5 and rel(resumed.shift, cache.shift) < 1e-5


@torch.inference_mode()
def test_ref_mixed_lengths_equal_each_prompt_alone():
    dec = load(prefill_chunk=6)
    lens = [14, 1, 6, 9]
    ps = prompts(lens, seed=3)
    batched = dec.generate(ps, max_new_tokens=4)
    for p, out in zip(ps, batched.tokens):
        assert dec.generate([p], max_new_tokens=4).tokens[0] == out


@torch.inference_mode()
def test_decode_updates_preallocated_state_in_place():
    dec = load()
    state = dec.prefill(prompts([5, 8], seed=4), max_new_tokens=4)
    ptrs = (state.cache.shift.data_ptr(), state.cache.wkv.data_ptr())
    before = state.cache.wkv.clone()
    dec.step(state)
    assert (state.cache.shift.data_ptr(), state.cache.wkv.data_ptr()) == ptrs
    assert not torch.equal(state.cache.wkv, before)
    assert state.cache.wkv.dtype == torch.float32
    c = dec.config
    assert tuple(state.cache.wkv.shape) == (c.num_hidden_layers, 2, c.num_heads, c.head_dim, c.head_dim)
    assert tuple(state.cache.shift.shape) == (c.num_hidden_layers, 2, 2, c.hidden_size)


def test_memory_model():
    dec = load()
    c = dec.config
    per_seq = c.num_hidden_layers * (c.num_heads * c.head_dim * c.head_dim * 4 + 2 * c.hidden_size * 4)
    m1, m2 = dec.memory(3, 100), dec.memory(3, 100_000)
    assert m1 == m2
    assert m1.state_bytes == 3 * per_seq
    embed = c.vocab_size * c.hidden_size * 4
    assert m1.weight_bytes == sum(p.numel() * 4 for p in dec.model.parameters())
    assert m1.step_read_bytes == m1.weight_bytes - embed + 3 * per_seq
    assert m1.step_write_bytes == 3 * per_seq


def test_detects_fla_configs_only():
    assert RWKV7Decoder.detects({"model_type": "rwkv7", "architectures": ["RWKV7ForCausalLM"]})
    assert not RWKV7Decoder.detects({"model_type": "llama"})
    assert not RWKV7Decoder.detects({"model_type": "rwkv6"})


def test_bad_prefill_chunk_is_usage_error():
    with pytest.raises(UsageError, match="prefill_chunk"):
        load(prefill_chunk=0)


@pytest.mark.interpreter
def test_triton_generates_twice_inside_the_callers_inference_mode():
    """A model built inside inference mode has inference-tensor parameters; packing them for the fused
    step must keep them so (it once turned them into normal tensors, and the next prefill failed)."""
    with torch.inference_mode():
        dec = decoders.load("rwkv7-tiny", impl="triton", device="cpu", seed=1)
        ps = prompts([9, 4], seed=2)
        first = dec.generate(ps, max_new_tokens=3).tokens
        assert dec.generate(ps, max_new_tokens=3).tokens == first


@torch.inference_mode()
@pytest.mark.gpu
def test_triton_decode_steps_replayed_in_cuda_graph_equal_eager():
    ps = prompts([300, 77, 1000, 5], seed=5)
    runs = {}
    for graphs in (False, True):
        dec = decoders.load("rwkv7-0.1b", impl="triton", device="cuda", dtype=torch.bfloat16, seed=2, cuda_graphs=graphs)
        state = dec.prefill(ps, max_new_tokens=8)
        runs[graphs] = [dec.step(state).logits.clone() for _ in range(7)]
        assert (state.graph is not None) == graphs
    for eager, replayed in zip(runs[False], runs[True]):
        assert rel(replayed, eager) < 1e-3


@torch.inference_mode()
@pytest.mark.gpu
def test_triton_long_prompt_chunked_equals_one_shot_bf16():
    whole = decoders.load("rwkv7-0.1b", impl="triton", device="cuda", dtype=torch.bfloat16, seed=3, prefill_chunk=16384)
    chunked = decoders.load("rwkv7-0.1b", impl="triton", device="cuda", dtype=torch.bfloat16, seed=3, prefill_chunk=3000)
    ps = prompts([12_345, 9_000], seed=6)
    a, b = whole.new_cache([12_345, 9_000], 12_346), chunked.new_cache([12_345, 9_000], 12_346)
    la, lb = whole.prefill_forward(a, ps), chunked.prefill_forward(b, ps)
    # Different chunk boundaries round the bf16 activations differently: ~2% through 12 layers.
    assert rel(lb, la) < 3e-2
    assert rel(b.wkv, a.wkv) < 3e-2
