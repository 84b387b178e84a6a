"""Mask-Predict decoder: each rule commits and re-masks exactly the positions the algorithm says (with
an oracle network whose predictions and confidences are fixed by construction), the cached prefix
equals recomputing it, the ELBO of one token is its exact log-probability, and bad input is refused."""

import math

import pytest
import torch
from torch import nn

import decoders
from declab_arch import maskpredict
from decoders.base import UsageError
from decoders.maskpredict import MaskPredictDecoder
from decoders.sampling import Sampling

GPU = torch.cuda.is_available()
gpu_only = pytest.mark.gpu
V, M = 16, 15  # oracle vocabulary and its mask token
ORACLE_CONFIG = dict(vocab_size=V, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                     max_position_embeddings=64, mask_token_id=M, eos_token_id=2)


def rel_rms(a, b):
    """||a - b|| / ||b|| in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class Oracle(nn.Module):
    """Stands in for the network: in pass t, canvas column c predicts table[t][c] = (token, probability).

    The mask token gets most of the raw probability, so a decoder that forgot to exclude it would
    emit it; the other tokens share what p leaves, so with the mask excluded the confidence is p.
    Every call is recorded (tokens fed, positions, query lengths, seq_lens, canvas rows).
    """

    def __init__(self, prompt_len, table):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.prompt_len, self.table, self.calls = prompt_len, table, []

    def hidden_paged(self, tokens, positions, batch):
        return torch.zeros(len(tokens), 1)

    def forward_paged(self, tokens, positions, batch, logit_index):
        pass_table = self.table[len(self.calls)] if len(self.calls) < len(self.table) else {}
        cu = batch.cu_seqlens_q.tolist()
        self.calls.append(dict(tokens=tokens.tolist(), positions=positions.tolist(), q_lens=[b - a for a, b in zip(cu, cu[1:])],
                               seq_lens=batch.seq_lens.tolist(), rows=logit_index.tolist()))
        rows = []
        for col in (positions[logit_index] - self.prompt_len).tolist():
            token, p = pass_table.get(col, (1, 0.5))
            probs = torch.full((V,), (1 - p) / (V - 2))
            probs[token] = p
            probs[M] = 50.0
            rows.append(probs.log())
        return torch.stack(rows)


def oracle_decoder(table, prompt_len=2, **options):
    config = maskpredict.MaskPredictConfig(**ORACLE_CONFIG)
    model = Oracle(prompt_len, table)
    return MaskPredictDecoder(model, config, device="cpu", dtype=torch.float32, impl="ref", source="oracle", **options), model


def run(dec, prompt, N, **generate):
    """Prefill and step to the end; the canvas after each pass and the committed counts."""
    state = dec.prefill([prompt], max_new_tokens=N, **generate)
    canvases, committed = [], []
    while not dec.finished(state):
        out = dec.step(state)
        canvases.append(state.canvas[0].tolist())
        committed.append(out.committed.item())
    return canvases, committed, dec.output(state, [])[0]


def test_mask_predict_remasks_the_least_confident_anywhere():
    # N=4, T=3: n_t = 4*(3-t)//3 = 2, 1, 0 tokens re-masked after passes 1, 2, 3.
    table = [
        {0: (5, 0.9), 1: (6, 0.2), 2: (7, 0.5), 3: (8, 0.7)},
        # Columns 0 and 3 are not masked in pass 2: their predictions here must be ignored.
        {0: (11, 0.01), 1: (9, 0.95), 2: (10, 0.8), 3: (12, 0.01)},
        {3: (13, 0.6)},
    ]
    dec, model = oracle_decoder(table, iterations=3)
    canvases, committed, out = run(dec, [3, 4], 4)
    # Pass 2 re-masks column 3: kept since pass 1, now the least confident (0.7), so it is revised.
    assert canvases == [[5, M, M, 8], [5, 9, 10, M], [5, 9, 10, 13]]
    assert committed == [2, 1, 1]
    assert out == [5, 9, 10, 13]
    assert [c["tokens"] for c in model.calls] == [[M, M, M, M], [5, M, M, 8], [5, 9, 10, M]]


def test_low_confidence_commits_the_most_confident_and_never_remasks():
    # N=4, T=3: k_t = 4t//3 - 4(t-1)//3 = 1, 1, 2 commits per pass.
    table = [
        {0: (5, 0.9), 1: (6, 0.2), 2: (7, 0.5), 3: (8, 0.7)},
        {0: (11, 0.01), 1: (9, 0.3), 2: (10, 0.6), 3: (12, 0.5)},
        {0: (11, 0.01), 1: (13, 0.1), 2: (11, 0.01), 3: (14, 0.2)},
    ]
    dec, _ = oracle_decoder(table, rule="low-confidence", iterations=3)
    canvases, committed, out = run(dec, [3, 4], 4)
    assert canvases == [[5, M, M, M], [5, M, 10, M], [5, 13, 10, 14]]
    assert committed == [1, 1, 2]
    assert out == [5, 13, 10, 14]


def test_threshold_commits_all_above_it_and_at_least_one():
    table = [
        {0: (5, 0.9), 1: (6, 0.2), 2: (7, 0.6), 3: (8, 0.4)},
        {1: (9, 0.3), 3: (10, 0.4)},
        {1: (11, 0.1)},
    ]
    dec, _ = oracle_decoder(table, threshold=0.5)
    canvases, committed, out = run(dec, [3, 4], 4)
    assert canvases == [[5, M, 7, M], [5, M, 7, 10], [5, 11, 7, 10]]
    assert committed == [2, 1, 1]
    assert out == [5, 11, 7, 10]


def test_equal_confidences_commit_left_to_right():
    table = [{c: (4 + c, 0.5) for c in range(3)}] * 3
    dec, _ = oracle_decoder(table, rule="low-confidence", iterations=3)
    canvases, committed, _ = run(dec, [3, 4], 3)
    assert canvases == [[4, M, M], [4, 5, M], [4, 5, 6]]
    assert committed == [1, 1, 1]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_blocks_cache_the_prefix_and_write_only_the_current_block(prefix_cache):
    table = [{0: (5, 0.9), 1: (6, 0.8)}, {2: (7, 0.9), 3: (8, 0.9)}]
    dec, model = oracle_decoder(table, rule="low-confidence", iterations=1, block_length=2, prefix_cache=prefix_cache)
    canvases, committed, out = run(dec, [3, 4], 4)
    assert canvases == [[5, 6, M, M], [5, 6, 7, 8]] and committed == [2, 2] and out == [5, 6, 7, 8]
    first, second = model.calls
    if prefix_cache:
        # Block 0: its canvas only, over the prompt's cached K/V.
        assert first == dict(tokens=[M, M], positions=[2, 3], q_lens=[2], seq_lens=[4], rows=[0, 1])
        # Block 1: the finished block 0 (its K/V enters the prefix, seeing only up to itself), then block 1's canvas.
        assert second == dict(tokens=[5, 6, M, M], positions=[2, 3, 4, 5], q_lens=[2, 2], seq_lens=[4, 6], rows=[2, 3])
    else:
        # LLaDA's own decoding: prompt + whole canvas every pass, logits of the current block.
        assert first == dict(tokens=[3, 4, M, M, M, M], positions=list(range(6)), q_lens=[6], seq_lens=[6], rows=[2, 3])
        assert second == dict(tokens=[3, 4, 5, 6, M, M], positions=list(range(6)), q_lens=[6], seq_lens=[6], rows=[4, 5])


def test_mask_predict_in_blocks_runs_t_passes_per_block():
    dec, model = oracle_decoder([], iterations=2, block_length=2)
    canvases, committed, out = run(dec, [3, 4], 6)
    assert len(canvases) == 6 and committed == [1, 1] * 3
    assert M not in out and len(out) == 6


def test_output_never_contains_the_mask_token():
    # The oracle gives the mask token almost all the raw probability everywhere.
    for options in (dict(iterations=2), dict(rule="low-confidence", iterations=3), dict(threshold=0.9), dict(iterations=1, block_length=2)):
        dec, _ = oracle_decoder([], **options)
        gen = dec.generate([[3, 4]], max_new_tokens=6)
        assert len(gen.tokens[0]) == 6 and M not in gen.tokens[0], options
        assert sum(gen.committed) == 6


class RecordedPass:
    """Stands in for a CUDA graph on the CPU: `replay` reruns the recorded pass and copies its results
    into the static outputs, as a graph replay would."""

    def __init__(self, dec, state, plan, log):
        self.dec, self.state, self.plan, self.log = dec, state, plan, log
        E, W = len(state.seqs), state.width
        self.out = (torch.empty(E, W, dtype=torch.int64), torch.empty(E, dtype=torch.int32),
                    torch.empty(len(plan.logit_index), V), torch.empty(E, W, dtype=torch.bool))

    def replay(self):
        self.log.append(("replay", self.state.block, self.state.passes_in_block))
        for static, new in zip(self.out, self.dec._refine(self.state, self.plan)):
            static.copy_(new)


@pytest.mark.parametrize("rule,T", [("mask-predict", 5), ("low-confidence", 4), ("mask-predict", 3)])
def test_graph_bookkeeping_captures_the_second_pass_and_replays_the_rest(monkeypatch, rule, T):
    """With graphs on, each block's second pass is captured when >= 2 passes are left, the rest of the
    block replays it, the next block captures anew, and the canvases equal eager decoding."""
    table = [{c: (3 + (c + t) % 9, 0.1 + 0.07 * ((5 * c + t) % 11)) for c in range(8)} for t in range(3 * T)]
    eager, _ = oracle_decoder(table, rule=rule, iterations=T, block_length=4)
    graphed, _ = oracle_decoder(table, rule=rule, iterations=T, block_length=4)
    log = []

    def capture(state, plan):
        log.append(("capture", state.block, state.passes_in_block))
        graph = RecordedPass(graphed, state, plan, log)
        return graph, graph.out

    monkeypatch.setattr(graphed, "_capture", capture)
    graphed.cuda_graphs = True
    want, got = run(eager, [3, 4], 8), run(graphed, [3, 4], 8)
    assert got == want
    expected = [] if T < 4 else [
        event for block in (0, 1) for event in [("capture", block, 1)] + [("replay", block, p) for p in range(2, T)]]
    assert log == expected


@pytest.mark.parametrize("rule", ["mask-predict", "low-confidence"])
def test_one_token_per_pass_is_deterministic(rule):
    dec = decoders.load("maskpredict-tiny", device="cpu", impl="ref", rule=rule, iterations=6)
    runs = [dec.generate([[5, 6, 7], [8, 9]], max_new_tokens=6, sampling=Sampling(temperature=1.0, seed=3)) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].passes == 6 and runs[0].committed == [1.0] * 6
    assert all(dec.mask_token_id not in seq for seq in runs[0].tokens)


def test_generate_stops_at_eos_once_every_sequence_has_one():
    # Block 0 ends with the end-of-sequence token (2): the second block is never decoded.
    table = [{0: (5, 0.9), 1: (2, 0.8)}]
    dec, model = oracle_decoder(table, rule="low-confidence", iterations=1, block_length=2)
    gen = dec.generate([[3, 4]], max_new_tokens=6, stop_at_eos=True)
    assert gen.tokens == [[5, 2]] and gen.passes == 1 and len(model.calls) == 1


def check_passes_against_forward(dec, prompts, N, tol=1e-4):
    """Every pass's canvas logits equal one no-cache forward over prompt + canvas: with segments
    (prefix cached) or fully bidirectional (prefix_cache=False)."""
    state = dec.prefill(prompts, max_new_tokens=N)
    passes = 0
    while not dec.finished(state):
        k, W, beam = state.block, state.width, state.beam
        before = state.canvas.clone()
        logits = dec.step(state).logits
        row = 0
        for e, (P, L) in enumerate(zip(state.entry_prompt_lens, state.lengths)):
            prompt = torch.tensor(prompts[e // beam])
            if dec.prefix_cache:
                canvas = before[e, : min(L, (k + 1) * W)].cpu()
                segments = torch.tensor([0] * P + [1 + c // W for c in range(len(canvas))])
                want = dec.model(torch.cat([prompt, canvas])[None].to(dec.device), segments[None].to(dec.device))[0, P + k * W :]
            else:
                canvas = before[e, :L].cpu()
                want = dec.model(torch.cat([prompt, canvas])[None].to(dec.device))[0, P + k * W : P + min(L, (k + 1) * W)]
            got = logits[row : row + len(want)]
            row += len(want)
            assert rel_rms(got, want) < tol, (passes, e)
        assert row == len(logits)
        passes += 1
    return passes


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_cached_prefix_equals_recomputing_it(impl):
    dec = decoders.load("maskpredict-tiny", device="cpu", impl=impl, rule="low-confidence", iterations=2, block_length=4)
    # A 20-token prompt spans two pages and shares its last page with the canvas.
    assert check_passes_against_forward(dec, [list(range(3, 23)), [7, 8, 9]], 12) == 6


def test_no_cache_passes_equal_a_full_bidirectional_forward():
    dec = decoders.load("maskpredict-tiny", device="cpu", impl="ref", iterations=2, block_length=4, prefix_cache=False)
    assert check_passes_against_forward(dec, [list(range(3, 21)), [7, 8, 9]], 8) == 4


def test_length_beam_candidates_share_the_prompt_and_pick_the_best():
    dec = decoders.load("maskpredict-tiny", device="cpu", impl="ref", iterations=2, length_beam=3)
    prompts = [list(range(3, 21)), [7, 8, 9]]
    assert check_passes_against_forward(dec, prompts, 10) == 2
    state = dec.prefill(prompts, max_new_tokens=10)
    while not dec.finished(state):
        dec.step(state)
    out = dec.output(state, [])
    for b, seq in enumerate(out):
        rows = range(b * 3, b * 3 + 3)
        scores = [state.confidence[e, : state.lengths[e]].log().mean().item() for e in rows]
        best = max(rows, key=lambda e: scores[e - b * 3])
        assert len(seq) == state.lengths[best] and seq == state.canvas[best, : len(seq)].tolist()
    # The candidates' lengths are the head's most likely, within 1..N.
    assert all(1 <= n <= 10 for n in state.lengths) and len(set(state.lengths[:3])) == 3


def test_elbo_of_one_token_is_its_exact_log_probability():
    dec = decoders.load("maskpredict-tiny", device="cpu", impl="ref")
    context, token = [5, 6, 7, 8], 42
    tokens = torch.tensor([context + [dec.mask_token_id]])
    with torch.no_grad():
        logp = maskpredict.token_log_probs(dec.model(tokens, torch.tensor([[0, 0, 0, 0, 1]])), dec.mask_token_id)
    assert dec.loglikelihood(context, [token], samples=8) == pytest.approx(logp[0, 4, token].item(), abs=1e-5)


def test_elbo_estimate_approaches_the_enumerated_bound():
    dec = decoders.load("maskpredict-tiny", device="cpu", impl="ref")
    context, cont = [5, 6, 7], [40, 41]
    mask = dec.mask_token_id

    def logp(masked_cont):
        tokens = torch.tensor([context + masked_cont])
        with torch.no_grad():
            out = maskpredict.token_log_probs(dec.model(tokens, torch.tensor([[0, 0, 0, 1, 1]])), mask)[0, 3:]
        return [out[i, t].item() for i, t in enumerate(cont)]

    # ELBO = E_l E_masks[(L/l) sum log p]: l=1 (either token, weight 2) or l=2 (both, weight 1), each l with probability 1/2.
    one = (2 * logp([mask, 41])[0] + 2 * logp([40, mask])[1]) / 2
    both = sum(logp([mask, mask]))
    exact = (one + both) / 2
    estimate = dec.loglikelihood(context, cont, samples=400, seed=1)
    assert estimate == pytest.approx(exact, rel=0.02)
    assert estimate == dec.loglikelihood(context, cont, samples=400, seed=1)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(iterations=0), "iterations"),
        (dict(iterations=-2), "iterations"),
        (dict(block_length=0), "block_length"),
        (dict(rule="beam"), "unknown rule"),
        (dict(rule="mask-predict", threshold=0.5), "threshold"),
        (dict(threshold=1.5), "threshold"),
        (dict(threshold=0.5, iterations=4), "threshold"),
        (dict(length_beam=0), "length_beam"),
        (dict(length_beam=2, block_length=4), "length_beam"),
    ],
)
def test_bad_options_raise_usage_error(options, match):
    with pytest.raises(UsageError, match=match):
        decoders.load("maskpredict-tiny", device="cpu", impl="ref", **options)


def test_bad_canvas_or_prompt_raises_usage_error():
    dec = decoders.load("maskpredict-tiny", device="cpu", impl="ref", block_length=4)
    with pytest.raises(UsageError, match="max_new_tokens"):
        dec.prefill([[5, 6]], max_new_tokens=0)
    with pytest.raises(UsageError, match="divide"):
        dec.prefill([[5, 6]], max_new_tokens=6)
    with pytest.raises(UsageError, match="divide"):
        dec.prefill([[5, 6]], max_new_tokens=2)
    with pytest.raises(UsageError, match="maximum"):
        dec.prefill([[5] * 8190], max_new_tokens=4)
    with pytest.raises(UsageError, match="max_new_tokens"):
        dec.generate([[5, 6]], max_new_tokens=0)
    config = maskpredict.MaskPredictConfig(**{**ORACLE_CONFIG, "max_predicted_length": 0})
    with pytest.raises(UsageError, match="length head"):
        MaskPredictDecoder(Oracle(2, []), config, device="cpu", dtype=torch.float32, impl="ref", source="oracle", length_beam=2)
    beam = decoders.load("maskpredict-tiny", device="cpu", impl="ref", length_beam=5)
    with pytest.raises(UsageError, match="length_beam"):
        beam.prefill([[5, 6]], max_new_tokens=4)
    with pytest.raises(UsageError, match="samples"):
        dec.loglikelihood([5], [6, 7], samples=0)


def test_detects_masked_diffusion_configs_only():
    assert MaskPredictDecoder.detects({"model_type": "llada", "architectures": ["LLaDAModelLM"], "mask_token_id": 126336})
    assert MaskPredictDecoder.detects({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "mask_token_id": 5})
    assert MaskPredictDecoder.detects({"declab_family": "maskpredict"})
    assert not MaskPredictDecoder.detects({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    assert not MaskPredictDecoder.detects({"model_type": "mamba2"})


def test_memory_counts_weights_prefix_and_canvas():
    dec = decoders.load("maskpredict-tiny", device="cpu", impl="ref", block_length=8)
    kv_per_token = 2 * 2 * 2 * 16 * 4
    mem = dec.memory(2, 100)
    assert mem.weight_bytes == dec.weight_bytes()
    assert mem.state_bytes == 2 * 112 * kv_per_token
    assert mem.step_write_bytes == 2 * 8 * kv_per_token
    length_head = (64 + 1) * 65 * 4
    assert mem.step_read_bytes == dec.weight_bytes() - length_head + 2 * 100 * kv_per_token
    # A pass writes the current block only; without blocks, the whole canvas.
    assert dec.memory(2, 100, new_tokens=32).step_write_bytes == 2 * 8 * kv_per_token
    whole = decoders.load("maskpredict-tiny", device="cpu", impl="ref")
    assert whole.memory(2, 100, new_tokens=32).step_write_bytes == 2 * 32 * kv_per_token


def test_save_round_trip(tmp_path):
    dec = decoders.load("maskpredict-tiny", device="cpu", impl="ref", seed=3)
    dec.save(tmp_path)
    again = decoders.load(tmp_path, device="cpu", impl="ref", iterations=4)
    tokens = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(again.logits(tokens), dec.logits(tokens))
    assert again.generate([[5, 6]], 8).tokens == decoders.load("maskpredict-tiny", device="cpu", impl="ref", seed=3, iterations=4).generate([[5, 6]], 8).tokens


@gpu_only
@pytest.mark.parametrize("options", [dict(rule="low-confidence", iterations=2, block_length=16), dict(iterations=2, length_beam=2),
                                     dict(iterations=5, block_length=16)])
def test_gpu_triton_passes_match_forward_bf16(options):
    dec = decoders.load("maskpredict-tiny", device="cuda", dtype="bf16", impl="triton", **options)
    check_passes_against_forward(dec, [list(range(3, 140)), [7, 8, 9]], 32, tol=3e-2)


@gpu_only
@pytest.mark.parametrize("rule", ["mask-predict", "low-confidence"])
def test_gpu_refinement_pass_does_not_synchronise(rule):
    # Eager passes: capturing a graph synchronises by design.
    dec = decoders.load("maskpredict-tiny", device="cuda", dtype="bf16", impl="triton", rule=rule, iterations=4, cuda_graphs=False)
    state = dec.prefill([[5, 6, 7], [8, 9]], max_new_tokens=16)
    dec.step(state)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            dec.step(state)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert dec.finished(state) and math.isfinite(state.confidence.float().sum().item())


@gpu_only
@pytest.mark.parametrize("options", [dict(rule="mask-predict", iterations=6, block_length=8), dict(rule="low-confidence", iterations=8),
                                     dict(rule="mask-predict", iterations=4, length_beam=2)])
def test_gpu_graph_replay_equals_eager_passes(options):
    """Passes replayed from a block's graph write the same canvases as eager passes, block after
    block (a new graph per block), and the graph is really used."""
    prompts = [list(range(3, 40)), [7, 8, 9]]
    runs = []
    for graphs in (True, False):
        dec = decoders.load("maskpredict-tiny", device="cuda", dtype="bf16", impl="triton", seed=1, cuda_graphs=graphs, **options)
        state = dec.prefill(prompts, max_new_tokens=16)
        canvases, replayed = [], 0
        while not dec.finished(state):
            replayed += state.graph is not None
            dec.step(state)
            canvases.append(state.canvas.clone())
        runs.append((torch.stack(canvases), dec.output(state, []), replayed))
    (graph_canvases, graph_out, replayed), (eager_canvases, eager_out, none) = runs
    assert replayed > 0 and none == 0
    assert torch.equal(graph_canvases, eager_canvases) and graph_out == eager_out
