"""Mamba-2 decoding: prefill + steps equal the parallel forward, chunked/resumed prefill equals one
shot, greedy generation matches transformers' `generate`, the memory model is exact, and the Triton
kernels (interpreter on the CPU) give the reference's logits and tokens."""

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import decoders
from declab_arch import mamba2
from declab_kernels import tuning
from decoders.mamba2 import Mamba2Cache, Mamba2Decoder
from decoders.sampling import Sampling

TRITON_SSD = Path(__file__).resolve().parents[2] / "declab_kernels" / "ssd" / "triton.py"
gpu = pytest.mark.gpu


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tiny(impl="ref", device="cpu", dtype="float32", **options):
    return decoders.load("mamba2-tiny", device=device, dtype=dtype, impl=impl, seed=0, **options)


def random_tokens(shape, vocab=512, seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_load_preset_gives_the_family():
    dec = decoders.load("mamba2-tiny", device="cpu")
    assert isinstance(dec, Mamba2Decoder) and dec.family == "mamba2"
    c = dec.config
    assert (c.d_model, c.n_layer, c.d_state, c.headdim, c.expand, c.vocab_size, c.ngroups, c.chunk_size) == (64, 2, 16, 16, 2, 512, 1, 64)
    # Decay parameters stay float32 under a lower-precision model dtype.
    half = decoders.load("mamba2-tiny", device="cpu", dtype="bfloat16", impl="ref")
    assert half.model.backbone.layers[0].mixer.A_log.dtype == torch.float32
    assert half.model.backbone.layers[0].mixer.in_proj.weight.dtype == torch.bfloat16


@torch.inference_mode()
def test_decode_steps_match_parallel_forward_ref():
    """Teacher-forced prefill + steps over prompts of three lengths vs `logits` over whole sequences."""
    dec = tiny()
    seqs = random_tokens((3, 48))
    full = dec.logits(seqs)
    lens = [29, 17, 40]
    cache = dec.new_cache(lens, 48)
    first = dec.prefill_forward(cache, [seqs[i, :n].tolist() for i, n in enumerate(lens)])
    rows = torch.arange(3)
    assert rel(first, full[rows, torch.tensor(lens) - 1]) < 1e-5
    pos = torch.tensor(lens)
    for _ in range(48 - max(lens)):
        logits = dec.decode_forward(cache, seqs[rows, pos], pos)
        assert rel(logits, full[rows, pos]) < 1e-5
        pos += 1


def test_greedy_generate_equals_argmax_of_full_forward_ref():
    dec = tiny()
    prompts = [random_tokens((23,), seed=1).tolist(), random_tokens((9,), seed=2).tolist()]
    gen = dec.generate(prompts, max_new_tokens=7)
    assert gen.passes == 6 and [len(t) for t in gen.tokens] == [7, 7]
    for prompt, new in zip(prompts, gen.tokens):
        seq = torch.tensor([prompt + new])
        expected = dec.logits(seq)[0, len(prompt) - 1 : -1].argmax(-1)
        assert new == expected.tolist()


def test_sampled_generate_runs_and_is_seeded():
    dec = tiny()
    sampling = Sampling(temperature=1.0, top_k=50, seed=7)
    a = dec.generate([[1, 2, 3]], max_new_tokens=5, sampling=sampling).tokens
    b = dec.generate([[1, 2, 3]], max_new_tokens=5, sampling=sampling).tokens
    assert a == b and len(a[0]) == 5


@torch.inference_mode()
def test_chunked_prefill_equals_one_shot_ref():
    """Prompts of 150 and 91 tokens (not multiples of the scan chunk 64) in prefill chunks of 37."""
    prompts = [random_tokens((150,), seed=3).tolist(), random_tokens((91,), seed=4).tolist()]
    one = tiny(prefill_chunk=8192)
    chunked = tiny(prefill_chunk=37)
    c1, c2 = one.new_cache([150, 91], 160), chunked.new_cache([150, 91], 160)
    l1, l2 = one.prefill_forward(c1, prompts), chunked.prefill_forward(c2, prompts)
    assert rel(l2, l1) < 1e-5
    assert rel(c2.ssm, c1.ssm) < 1e-5 and rel(c2.conv, c1.conv) < 1e-5


@torch.inference_mode()
def test_prefill_resumed_from_saved_state_equals_one_pass_ref():
    """Consume a prefix, save the state, continue in a fresh cache loaded from it: same as one pass."""
    dec = tiny()
    prompts = [random_tokens((133,), seed=5).tolist(), random_tokens((70,), seed=6).tolist()]
    whole = dec.new_cache([133, 70], 140)
    expected = dec.prefill_forward(whole, prompts)
    cuts = [61, 45]
    first = dec.new_cache(cuts, 140)
    dec.prefill_forward(first, [p[:c] for p, c in zip(prompts, cuts)])
    saved = Mamba2Cache(conv=first.conv.clone(), ssm=first.ssm.clone(), lens=list(first.lens))
    assert saved.lens == cuts
    resumed = dec.new_cache([133, 70], 140)
    resumed.conv.copy_(saved.conv)
    resumed.ssm.copy_(saved.ssm)
    resumed.lens = list(saved.lens)
    logits = dec.prefill_forward(resumed, [p[c:] for p, c in zip(prompts, cuts)])
    assert rel(logits, expected) < 1e-5
    assert rel(resumed.ssm, whole.ssm) < 1e-5 and rel(resumed.conv, whole.conv) < 1e-5


def random_cache(dec, batch, seed):
    """A cache of `batch` rows holding random states, every slot of every ring included (a stale slot
    must not leak into a window)."""
    g = torch.Generator().manual_seed(seed)
    cache = dec.new_cache([0] * batch, 1)
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=g))
    cache.ssm.copy_(torch.randn(cache.ssm.shape, generator=g))
    return cache


# Rows of one chunk_forward: (cache row, start position, length). W = d_conv = 4: lengths 2 and 1 are
# shorter than the conv's window, starts 5, 3 and 9 not multiples of W, length 70 over one scan chunk
# (64); cache row 1 sits out.
ROWS = [(3, 5, 2), (0, 0, 70), (2, 9, 13), (4, 3, 1)]


def chunk_alone_and_together(dec, rows, logits):
    """chunk_forward over `rows` in one call, and each row alone in its own call, from the same random
    states: (together's result, together's cache, the alone results, the alone cache)."""
    width = max(n for _, _, n in rows)
    tokens = random_tokens((len(rows), width), seed=21)
    together, alone = random_cache(dec, 5, seed=20), random_cache(dec, 5, seed=20)
    got = dec.chunk_forward(together, tokens, [p for _, p, _ in rows], [n for _, _, n in rows],
                            rows=[r for r, _, _ in rows], logits=logits)
    want = [dec.chunk_forward(alone, tokens[j : j + 1, :n], [p], [n], rows=[r], logits=logits)[0]
            for j, (r, p, n) in enumerate(rows)]
    return got, together, want, alone


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interpreter)])
@torch.inference_mode()
def test_chunk_forward_rows_at_any_position_and_length_equal_each_row_alone(impl):
    """One chunk_forward over rows at different positions with different lengths (right-padded) gives
    each row's logits, SSM state and conv ring as that row alone does, the rows it leaves untouched
    included; with logits="all", each row's real positions too."""
    dec = tiny(impl)
    got, together, want, alone = chunk_alone_and_together(dec, ROWS, "last")
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together.ssm, alone.ssm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together.conv, alone.conv, rtol=1e-5, atol=1e-5)
    got, _, want, _ = chunk_alone_and_together(dec, ROWS, "all")
    for j, (_, _, n) in enumerate(ROWS):
        torch.testing.assert_close(got[j, :n], want[j], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interpreter)])
@torch.inference_mode()
def test_chunk_forward_rows_continue_their_sequences(impl):
    """Rows whose prefixes (of ROWS's start positions) were consumed in one chunk_forward continue in
    another with ROWS's lengths, then decode a token: the logits equal the parallel forward's over each
    whole sequence, and the next position's slot of each ring is zero."""
    dec = tiny(impl)
    width = max(n for _, _, n in ROWS)
    seqs = random_tokens((len(ROWS), max(p for _, p, _ in ROWS) + width + 1), seed=22)
    full = dec.logits(seqs)
    cache = dec.new_cache([0] * 5, 1)
    first = [j for j, (_, p, _) in enumerate(ROWS) if p]
    dec.chunk_forward(cache, seqs[first], [0] * len(first), [ROWS[j][1] for j in first], rows=[ROWS[j][0] for j in first],
                      logits="none")
    tokens = torch.stack([seqs[j, p : p + width] for j, (_, p, _) in enumerate(ROWS)])
    got = dec.chunk_forward(cache, tokens, [p for _, p, _ in ROWS], [n for _, _, n in ROWS], rows=[r for r, _, _ in ROWS])
    index, ends = torch.arange(len(ROWS)), torch.tensor([p + n for _, p, n in ROWS])
    assert rel(got, full[index, ends - 1]) < 1e-5
    next_tokens, positions = torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long)
    for j, (r, p, n) in enumerate(ROWS):
        assert not cache.conv[:, r, :, (p + n) % dec.config.d_conv].any()
        next_tokens[r], positions[r] = seqs[j, p + n], p + n
    step = dec.decode_forward(cache, next_tokens, positions)
    assert rel(step[[r for r, _, _ in ROWS]], full[index, ends]) < 1e-5


def count_forward_chunk(monkeypatch):
    calls = []
    run = mamba2.Mamba2LM.forward_chunk

    def counted(self, tokens, *args, **kwargs):
        calls.append(tokens.shape[0])
        return run(self, tokens, *args, **kwargs)

    monkeypatch.setattr(mamba2.Mamba2LM, "forward_chunk", counted)
    return calls


@torch.inference_mode()
def test_chunk_forward_is_one_pass_whatever_the_rows_positions_and_lengths(monkeypatch):
    dec = tiny()
    calls = count_forward_chunk(monkeypatch)
    cache = dec.new_cache([0] * 5, 1)
    dec.chunk_forward(cache, random_tokens((4, 70)), [p for _, p, _ in ROWS], [n for _, _, n in ROWS],
                      rows=[r for r, _, _ in ROWS])
    assert calls == [4]
    calls.clear()
    dec.prefill_forward(cache, [random_tokens((n,), seed=n).tolist() for n in (3, 17, 9, 1, 40)])
    assert calls == [5]


@torch.inference_mode()
def test_chunk_forward_with_a_lower_dt_limit_goes_one_pass_per_length(monkeypatch):
    """dt_min_limit > 0 clamps a padded position's step up to the limit, which would move the state:
    there the rows go one pass per length (each row still at its own position), equal to each row
    alone, and forward_chunk refuses padded rows."""
    config = dataclasses.replace(tiny().config, dt_min_limit=0.01)
    dec = Mamba2Decoder(mamba2.build(config, None, "dt-limit"), config, device="cpu", dtype=torch.float32, impl="ref",
                        source="dt-limit")
    calls = count_forward_chunk(monkeypatch)
    rows = ROWS + [(1, 7, 13)]
    got, together, want, alone = chunk_alone_and_together(dec, rows, "last")
    assert calls == [1, 1, 2, 1] + [1] * len(rows)
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together.ssm, alone.ssm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together.conv, alone.conv, rtol=1e-5, atol=1e-5)
    cache = dec.new_cache([0, 0], 1)
    with pytest.raises(ValueError, match="dt_min_limit"):
        dec.model.forward_chunk(random_tokens((2, 5)), cache.conv, cache.ssm, [0, 1], "ref", [0, 0], [5, 3])


def test_hf_generate_matches_token_for_token_ref(tmp_path, hf_mamba2_groups):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(4)
    config = Mamba2Config(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16, num_heads=8, n_groups=2,
        expand=2, chunk_size=16, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    hf_mamba2_groups(config.n_groups)
    model = Mamba2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".D") or name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    dec = decoders.load(tmp_path, device="cpu", dtype="float32", impl="ref")
    prompts = random_tokens((2, 19), vocab=100, seed=8)
    with torch.no_grad():
        hf = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    ours = dec.generate(prompts, max_new_tokens=12)
    assert ours.tokens == hf[:, 19:].tolist()


def test_memory_model_is_exact_and_context_free():
    dec = tiny()
    c = dec.config
    cache = dec.new_cache([5, 5, 5], 100)
    state = sum(t.numel() * t.element_size() for t in (cache.conv, cache.ssm))
    m = dec.memory(3, 100)
    ssm = c.nheads * c.headdim * c.d_state * 4
    assert m.state_bytes == state == 3 * c.n_layer * (c.conv_dim * c.d_conv * 4 + ssm)
    assert dec.memory(3, 131072) == m
    weights = sum(p.numel() * p.element_size() for p in dec.model.parameters())
    # Tied: the embedding table is read once, as the head.
    assert m.weight_bytes == weights and m.step_read_bytes == weights + state
    # Written: the SSM states and one slot of each conv ring.
    assert m.step_write_bytes == 3 * c.n_layer * (c.conv_dim * 4 + ssm)
    config = dataclasses.replace(c, tie_embeddings=False)
    untied = Mamba2Decoder(mamba2.build(config, None, "untied"), config, device="cpu", dtype=torch.float32, impl="ref", source="untied")
    untied_weights = untied.weight_bytes()
    # Untied: the head is read, the embedding table is not (one row per token).
    assert untied_weights == weights + c.vocab_size * c.d_model * 4
    assert untied.memory(3, 100).step_read_bytes == untied_weights - c.vocab_size * c.d_model * 4 + state


@pytest.mark.interpreter
@pytest.mark.skipif(not TRITON_SSD.exists(), reason="declab_kernels/ssd/triton.py is not written yet")
@pytest.mark.parametrize("lens", [[37, 20, 5], [37, 20], [37]])
def test_triton_equals_ref_whole_model(lens):
    """Three sequences, two and one: up to two the Triton step gates in the SSM step and the norms'
    statistics come with the projections (`declab_kernels.tuning.GATE_IN_STEP_ROWS`)."""
    assert tuning.GATE_IN_STEP_ROWS == 2
    ref, tri = tiny("ref"), tiny("triton")
    tokens = random_tokens((3, 70), seed=9)
    assert rel(tri.logits(tokens), ref.logits(tokens)) < 1e-4
    prompts = [tokens[i, :n].tolist() for i, n in enumerate(lens)]
    a, b = tri.generate(prompts, max_new_tokens=4), ref.generate(prompts, max_new_tokens=4)
    assert a.tokens == b.tokens
    with torch.inference_mode():
        step, pos = torch.tensor([3]), torch.tensor([6])
        got = tri.decode_forward(tri.new_cache([5], 8), step, pos)
        want = ref.decode_forward(ref.new_cache([5], 8), step, pos)
    assert rel(got, want) < 1e-4


class LaunchCount(TorchDispatchMode):
    """Counts the ATen ops that launch a kernel (not views or allocations) and the Triton launches."""

    NO_KERNEL = {"view", "_unsafe_view", "reshape", "split", "split_with_sizes", "squeeze", "unsqueeze", "t",
                 "transpose", "as_strided", "empty", "empty_strided", "empty_like", "detach", "alias", "select", "slice",
                 "expand", "unflatten", "promote_types"}

    def __init__(self, monkeypatch, kernel_class):
        super().__init__()
        self.aten, self.triton, self.inside = [], [], 0
        run = kernel_class.run

        def counted(fn, *args, **kwargs):
            self.triton.append(fn)
            # The interpreter runs a kernel with ATen ops of its own: not launches.
            self.inside += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                self.inside -= 1

        monkeypatch.setattr(kernel_class, "run", counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and name not in self.NO_KERNEL:
            self.aten.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.interpreter
@torch.inference_mode()
def test_triton_step_launches_five_kernels_per_layer(monkeypatch):
    """Above `tuning.GATE_IN_STEP_ROWS` sequences: embedding + norm, then per layer in_proj, decode step, gated
    norm, out_proj, add + norm; the head."""
    from declab_kernels.mamba2_norm import triton as norm_tri

    dec = tiny("triton", dtype="bfloat16")
    cache = dec.new_cache([3, 3, 3], 8)
    tokens, positions = torch.tensor([5, 9, 2]), torch.tensor([3, 3, 3])
    dec.decode_forward(cache, tokens, positions)
    with LaunchCount(monkeypatch, type(norm_tri._gated_rmsnorm_kernel)) as count:
        dec.decode_forward(cache, tokens, positions)
    L = dec.config.n_layer
    # The projections and the head: F.linear, or its mm / addmm where the dispatcher decomposes it.
    assert set(count.aten) <= {"linear", "mm", "addmm"} and len(count.aten) == 2 * L + 1
    assert len(count.triton) == 3 * L + 1


@gpu
@torch.inference_mode()
def test_gpu_decode_matches_parallel_forward_bf16_triton():
    dec = tiny("triton", device="cuda", dtype="bfloat16")
    seqs = random_tokens((4, 300), seed=10).cuda()
    full = dec.logits(seqs)
    lens = [200, 257, 131, 200]
    cache = dec.new_cache(lens, 300)
    rows = torch.arange(4, device="cuda")
    first = dec.prefill_forward(cache, [seqs[i, :n].tolist() for i, n in enumerate(lens)])
    assert rel(first, full[rows, torch.tensor(lens, device="cuda") - 1]) < 3e-2
    pos = torch.tensor(lens, device="cuda")
    for _ in range(30):
        assert rel(dec.decode_forward(cache, seqs[rows, pos], pos), full[rows, pos]) < 3e-2
        pos += 1


@gpu
@torch.inference_mode()
def test_gpu_decode_step_replays_in_a_cuda_graph_triton():
    dec = decoders.load("mamba2-130m", device="cuda", dtype="bfloat16", impl="triton")
    cache = dec.new_cache([64] * 4, 128)
    dec.prefill_forward(cache, random_tokens((4, 64), vocab=50288, seed=11).tolist())
    tokens = random_tokens((4,), vocab=50288, seed=12).cuda()
    pos = torch.full((4,), 64, device="cuda")
    eager_cache = Mamba2Cache(cache.conv.clone(), cache.ssm.clone(), list(cache.lens))
    expected = dec.decode_forward(eager_cache, tokens, pos)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # Warm-up (compiles the kernels) on a scratch copy, so the graph's cache sees exactly one step.
        dec.decode_forward(Mamba2Cache(cache.conv.clone(), cache.ssm.clone(), list(cache.lens)), tokens, pos)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dec.decode_forward(cache, tokens, pos)
    graph.replay()
    torch.cuda.synchronize()
    assert rel(out, expected) < 1e-2
    assert rel(cache.ssm, eager_cache.ssm) < 1e-3


@gpu
@torch.inference_mode()
def test_gpu_long_prompt_chunked_prefill_triton():
    """A 20k-token prompt in 8192-token chunks equals 4096-token chunks; the prefill's extra memory stays
    far below what [T, V] logits (2 GB here) or anything quadratic in T would take."""
    prompt = random_tokens((20_000,), vocab=50288, seed=13).tolist()
    results = []
    for chunk in (8192, 4096):
        dec = decoders.load("mamba2-130m", device="cuda", dtype="bfloat16", impl="triton", prefill_chunk=chunk)
        cache = dec.new_cache([len(prompt)], len(prompt) + 1)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        results.append((dec.prefill_forward(cache, [prompt]), cache.ssm))
        assert torch.cuda.max_memory_allocated() - base < 2**30
    (l1, s1), (l2, s2) = results
    assert rel(l2, l1) < 2e-2 and rel(s2, s1) < 2e-2
