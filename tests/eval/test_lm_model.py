"""The `declab` lm-eval model: loglikelihood against the lab's logits, is_greedy both ways, rolling
windows that score every token once, generate_until's stops, for every family (test_hf_parity
compares the requests with lm-eval's own hf model)."""

import math

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import make_disjoint_window  # noqa: E402

from eval.lm_model import DecLabLM, rolling_windows  # noqa: E402

AUTOREGRESSIVE = ["llama-tiny", "mamba2-tiny", "rwkv7-tiny"]


def make_lm(preset, **kwargs):
    return DecLabLM(pretrained=preset, **{"dtype": "float32", "device": "cpu", "impl": "ref", "max_length": 48, "batch_size": 3, **kwargs})


@pytest.fixture(scope="module", params=AUTOREGRESSIVE)
def lm(request):
    return make_lm(request.param)


def reference_loglik(lm, ctx, cont):
    """Sum of log-softmax of the lab's own logits (`Decoder.logits`) over the continuation, one sequence alone."""
    tokens = torch.tensor([ctx + cont])
    logp = torch.log_softmax(lm.decoder.logits(tokens[:, :-1]).float(), -1)[0]
    return sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))


def greedy(lm, ctx, n):
    return lm.decoder.generate([ctx], max_new_tokens=n).tokens[0]


def test_ref_loglikelihood_equals_logits(lm):
    g = torch.Generator().manual_seed(0)
    reqs = []
    for n_ctx, n_cont in [(5, 3), (17, 1), (9, 6), (2, 2)]:
        ctx = torch.randint(0, 256, (n_ctx,), generator=g).tolist()
        cont = torch.randint(0, 256, (n_cont,), generator=g).tolist()
        reqs.append((("", ""), ctx, cont))
    got = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    for (_, ctx, cont), (ll, _) in zip(reqs, got):
        want = reference_loglik(lm, ctx, cont)
        assert abs(ll - want) / abs(want) < 1e-4


def test_ref_is_greedy_both_ways(lm):
    ctx = [256, 10, 20, 30, 40]
    cont = greedy(lm, ctx, 4)
    wrong = cont[:-1] + [(cont[-1] + 1) % 256]
    (_, yes), (_, no) = lm._loglikelihood_tokens([(None, ctx, cont), (None, ctx, wrong)], disable_tqdm=True)
    assert yes is True and no is False


def test_ref_context_whitespace_moves_into_continuation(lm):
    (ll, _), = lm.loglikelihood([Instance("loglikelihood", {}, ("abc  ", "def"), 0)], disable_tqdm=True)
    ctx = lm.tok_encode("abc")
    cont = lm.tok_encode("abc  def")[len(ctx) :]
    assert lm.tok_decode(cont) == "  def"
    assert math.isclose(ll, reference_loglik(lm, ctx, cont), rel_tol=1e-4)


def test_rolling_windows_cover_each_token_once():
    tokens = list(range(1, 101))
    for max_length in (7, 16, 100, 128):
        windows = [make_disjoint_window(w) for w in rolling_windows(tokens, 0, max_length)]
        assert sum((cont for _, cont in windows), []) == tokens
        assert all(len(ctx) + len(cont) - 1 <= max_length for ctx, cont in windows)
        # Each window is conditioned on the tokens right before it (the prefix token for the first).
        starts = [0] + [len(c) for _, c in windows][:-1]
        assert [ctx[-1] for ctx, _ in windows] == [0] + [tokens[sum(starts[: i + 1]) - 1] for i in range(1, len(windows))]


def test_ref_rolling_equals_windowed_logits(lm):
    text = "the quick brown fox jumps over the lazy dog, " * 3
    got, = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    tokens = lm.tok_encode(text)
    assert tokens[0] == lm.prefix_token_id and len(tokens) > 2 * lm.max_length
    want = sum(reference_loglik(lm, ctx, cont) for ctx, cont in map(make_disjoint_window, rolling_windows(tokens, lm.prefix_token_id, lm.max_length)))
    assert math.isclose(got, want, rel_tol=1e-4)


def gen(lm, context, **kwargs):
    return lm.generate_until([Instance("generate_until", {}, (context, kwargs), 0)], disable_tqdm=True)[0]


def test_ref_generate_until_stops(lm, monkeypatch):
    # A random preset may emit ids above the byte range (decoded as nothing): pick a prompt whose text is long enough.
    prompt = next(p for p in ("hello", "abc", "the cat", "xyz 12", "0000") if len(gen(lm, p, until=[], max_gen_toks=12)) >= 6)
    free = gen(lm, prompt, until=[], max_gen_toks=12)
    ids = greedy(lm, lm.tok_encode(prompt), 12)
    assert free == lm.tok_decode(ids)
    # max_gen_toks
    assert gen(lm, prompt, until=[], max_gen_toks=5) == lm.tok_decode(ids[:5])
    # a stop string taken from the free text cuts right before its first occurrence
    stop = free[3:5]
    assert gen(lm, prompt, until=["never there", stop], max_gen_toks=12) == free.split(stop)[0]
    # end-of-sequence: make the 4th generated token the end-of-sequence token
    monkeypatch.setattr(DecLabLM, "eot_token_id", property(lambda self: ids[3]))
    assert gen(lm, prompt, until=[], max_gen_toks=12) == lm.tok_decode(ids[: ids.index(ids[3])])


def test_ref_batched_requests_keep_order(lm):
    reqs = [Instance("loglikelihood", {}, (c, " x"), i) for i, c in enumerate(["a", "a longer context here", "mid ctx"])]
    batched = lm.loglikelihood(reqs, disable_tqdm=True)
    alone = [lm.loglikelihood([r], disable_tqdm=True)[0] for r in reqs]
    for (a, ga), (b, gb) in zip(batched, alone):
        assert math.isclose(a, b, rel_tol=1e-4) and ga == gb


def test_ref_maskpredict_montecarlo_and_greedy():
    lm = make_lm("maskpredict-tiny", samples=4, iterations=2)
    ctx = [256, 5, 6, 7]
    (ll, _), = lm._loglikelihood_tokens([(None, ctx, [8])], disable_tqdm=True)
    # For one token the bound is exact: the model's log-probability at a masked position after the
    # context, the context blind to it (the prefix bound).
    from declab_arch.maskpredict import token_log_probs

    mask = lm.decoder.mask_token_id
    logits = lm.decoder.model(torch.tensor([ctx + [mask]]), segments=(torch.arange(len(ctx) + 1) >= len(ctx)).long()[None])
    assert ll == pytest.approx(token_log_probs(logits, mask)[0, -1, 8].item(), rel=1e-5)
    cont = lm.decoder.generate([ctx], max_new_tokens=3).tokens[0]
    wrong = cont[:-1] + [(cont[-1] + 1) % 256]
    (_, yes), (_, no) = lm._loglikelihood_tokens([("req-a", ctx, cont), ("req-b", ctx, wrong)], disable_tqdm=True)
    assert yes is True and no is False
    # A rolling window (request None) is scored without decoding: its is_greedy is never read.
    (ll_window, greedy), = lm._loglikelihood_tokens([(None, ctx, cont)], disable_tqdm=True)
    assert greedy is False and ll_window == pytest.approx(lm.decoder.loglikelihood(ctx, cont, samples=4), rel=1e-5)
    assert isinstance(gen(lm, "hello", until=[], max_gen_toks=6), str)


def test_ref_maskpredict_batched_greedy_equals_one_at_a_time():
    """is_greedy decoded in batches (one per continuation length) says what decoding each request
    alone says, right and wrong continuations mixed, contexts of different lengths."""
    alone = make_lm("maskpredict-tiny", samples=4, iterations=2, batch_size=1)
    batched = make_lm("maskpredict-tiny", samples=4, iterations=2, batch_size=6)
    requests = []
    for n, ctx in enumerate([[256, 5, 6, 7], [256, 9], [256, 3, 1, 4, 1, 5], [256, 40, 41]]):
        cont = alone.decoder.generate([ctx], max_new_tokens=1 + n % 3).tokens[0]
        requests += [(f"right-{n}", ctx, cont), (f"wrong-{n}", ctx, cont[:-1] + [(cont[-1] + 1) % 256])]
    got = batched._loglikelihood_tokens(requests, disable_tqdm=True)
    want = alone._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in want] == [True, False] * 4
    assert all(math.isclose(a, b, rel_tol=1e-4) for (a, _), (b, _) in zip(got, want))


def test_ref_model_args_win_over_cli_defaults():
    lm = DecLabLM.create_from_arg_string("pretrained=llama-tiny,dtype=float32,batch_size=5,max_length=32,impl=ref", {"batch_size": 1, "device": "cpu"})
    assert lm.batch_size == 5 and lm.max_length == 32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", AUTOREGRESSIVE)
def test_gpu_triton_bf16_scores_match_ref_fp32(preset):
    """The scores lm-eval sees on the GPU (Triton kernels, bf16 weights) agree with the fp32 reference."""
    fast = DecLabLM(pretrained=preset, dtype="bfloat16", device="cuda", impl="triton", max_length=256, batch_size=4)
    ref = DecLabLM(pretrained=preset, dtype="float32", device="cuda", impl="ref", max_length=256, batch_size=4)
    g = torch.Generator().manual_seed(1)
    reqs = [(None, torch.randint(0, 256, (n,), generator=g).tolist(), torch.randint(0, 256, (7,), generator=g).tolist()) for n in (3, 100, 249)]
    for (a, _), (b, _) in zip(fast._loglikelihood_tokens(reqs, disable_tqdm=True), ref._loglikelihood_tokens(reqs, disable_tqdm=True)):
        assert abs(a - b) / abs(b) < 0.02
    text = "abc def ghi " * 60
    a, = fast.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    b, = ref.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    assert abs(a - b) / abs(b) < 0.02
    assert isinstance(gen(fast, "hello", until=["\n"], max_gen_toks=16), str)
