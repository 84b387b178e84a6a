"""Speculative decoding (decoders.speculative): greedy output equals plain greedy decoding for every
target/draft family pair and k = 1..6, the rejection rule keeps the target's distribution, and
rollback leaks no KV blocks. CPU, float32, impl="ref", tiny presets."""

import json
import subprocess
import sys

import pytest
import torch

import decoders
from declab_arch.checkpoint import CONFIG_DIR, read_json
from decoders.sampling import Sampling
from decoders.transformer import TransformerDecoder
from declab_arch.draft_heads import DraftHeads
from decoders.speculative import Draft, ModelDraft, NgramDraft, Proposal, accept_sampling

FAMILIES = ["llama-tiny", "mamba2-tiny", "rwkv7-tiny"]
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3], [40, 41, 42, 43, 44]]
NEW = 14
# Per chi-square test: the chance a correct rule fails it (the seed is fixed, so a pass is stable).
FALSE_ALARM = 1e-3


def load(name, seed=0, **options):
    return decoders.load(name, device="cpu", dtype="float32", impl="ref", seed=seed, **options)


@pytest.fixture(scope="module")
def targets():
    return {name: load(name) for name in FAMILIES}


@pytest.fixture(scope="module")
def drafts():
    # Other weights than the targets' (seed 1), so drafts are wrong as well as right.
    return {name: load(name, seed=1) for name in FAMILIES}


@pytest.fixture(scope="module")
def plain(targets):
    return {name: t.generate(PROMPTS, max_new_tokens=NEW).tokens for name, t in targets.items()}


class Oracle(Draft):
    """Proposes the target's own greedy continuation (every draft accepted), or with `wrong` that
    continuation plus one (every draft rejected)."""

    name = "oracle"

    def __init__(self, plain_tokens, vocab, wrong=False):
        self.plain, self.vocab, self.wrong = plain_tokens, vocab, wrong

    def start(self, prompts, max_len):
        return None

    def propose(self, state, pending, positions, contexts, k, sampling, generator):
        rows = []
        for b, ctx in enumerate(contexts):
            done = len(ctx) - len(PROMPTS[b])
            future = (self.plain[b] + [0] * (k + 1))[done : done + k]
            rows.append([(t + 1) % self.vocab if self.wrong else t for t in future])
        return Proposal(torch.tensor(rows), None)


@pytest.mark.parametrize("k", range(1, 7))
@pytest.mark.parametrize("draft", FAMILIES)
@pytest.mark.parametrize("target", FAMILIES)
def test_greedy_equals_plain(targets, drafts, plain, target, draft, k):
    spec = decoders.speculative(targets[target], drafts[draft], k=k)
    assert spec.generate(PROMPTS, max_new_tokens=NEW).tokens == plain[target]


@pytest.mark.parametrize("target", FAMILIES)
def test_greedy_equals_plain_ngram_and_recurrent_steps(targets, drafts, plain, target):
    for k in (2, 5):
        assert decoders.speculative(targets[target], "ngram", k=k).generate(PROMPTS, max_new_tokens=NEW).tokens == plain[target]
    if target != "llama-tiny":
        spec = decoders.speculative(targets[target], drafts["llama-tiny"], k=3, recurrent_verify="steps")
        assert spec.generate(PROMPTS, max_new_tokens=NEW).tokens == plain[target]


@pytest.mark.parametrize("k", range(1, 7))
@pytest.mark.parametrize("target", FAMILIES)
def test_always_right_and_always_wrong_drafts(targets, plain, target, k):
    t = targets[target]
    right = decoders.speculative(t, Oracle(plain[target], t.vocab_size), k=k)
    state = right.prefill(PROMPTS, max_new_tokens=NEW)
    while not right.finished(state):
        committed = right.step(state).committed.tolist()
        # Every draft accepted: k + 1 tokens a step until the budget cuts the last one.
        assert all(c == min(k + 1, NEW - len(toks) + c) for c, toks in zip(committed, state.new_tokens))
    assert right.output(state, []) == plain[target]
    assert right.acceptance(state)["acceptance_by_position"] == [1.0] * k
    right.release(state)
    wrong = decoders.speculative(t, Oracle(plain[target], t.vocab_size, wrong=True), k=k)
    gen = wrong.generate(PROMPTS, max_new_tokens=NEW)
    assert gen.tokens == plain[target]
    assert gen.passes == NEW - 1 and all(c == 1 for c in gen.committed)


def test_no_block_leaks_after_many_rejections(plain):
    target = load("llama-tiny", num_blocks=64)
    pool = target.pool.pool
    spec = decoders.speculative(target, Oracle(plain["llama-tiny"], target.vocab_size, wrong=True), k=6)
    for _ in range(3):
        state = spec.prefill(PROMPTS, max_new_tokens=NEW)
        while not spec.finished(state):
            spec.step(state)
            held = sum(target.pool.blocks_needed(p) for p in state.positions)
            assert pool.num_blocks - pool.num_free == held
            assert [target.pool.lengths[s] for s in state.cache.seqs] == state.positions
        assert spec.output(state, []) == plain["llama-tiny"]
        spec.release(state)
        assert pool.num_free == pool.num_blocks


def test_ngram_lookup():
    draft = NgramDraft(max_ngram=3)
    assert draft.lookup([1, 2, 3, 9, 7, 1, 2, 3], 3) == [9, 7, 1]
    # The latest earlier occurrence wins, and a short continuation is padded with its last token.
    assert draft.lookup([4, 5, 1, 6, 5, 1, 8, 1], 3) == [8, 1, 1]
    assert draft.lookup([4, 5, 6], 2) == [6, 6]


def rule_samples(p, q, n, seed=0, rule=accept_sampling):
    """Committed tokens of n independent verifications: drafts drawn from q [k, V], target p [k+1, V]."""
    g = torch.Generator().manual_seed(seed)
    k, V = q.shape
    drafted = torch.multinomial(q, n, replacement=True, generator=g).T  # [n, k]
    accepted, nxt = rule(p.expand(n, k + 1, V), q.expand(n, k, V), drafted, g)
    return drafted, accepted, nxt


def position_counts(drafted, accepted, nxt, j, V):
    """Counts over V of the token committed at position j, among verifications committing > j tokens."""
    rows = accepted >= j
    token = torch.where(accepted[rows] == j, nxt[rows], drafted[rows, min(j, drafted.shape[1] - 1)])
    return torch.bincount(token, minlength=V).double()


def chi2_quantile(p: float, df: int) -> float:
    """The chi-square distribution's p-quantile (Wilson-Hilferty: within 1% from df = 3 on)."""
    z = torch.special.ndtri(torch.tensor(p, dtype=torch.float64)).item()
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def chi_square_ok(counts, probs):
    expected = counts.sum() * probs.double()
    keep = expected > 0
    if counts[~keep].sum() > 0:
        return False
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return stat < chi2_quantile(1 - FALSE_ALARM, int(keep.sum()) - 1)


def test_rejection_rule_keeps_target_distribution():
    V, k, n = 6, 3, 60000
    p = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1, 0.0], [0.05, 0.05, 0.3, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.1, 0.1, 0.5], [0.2] * 5 + [0.0]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.2, 0.2, 0.2], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1], [1 / 6] * 6])
    drafted, accepted, nxt = rule_samples(p, q, n)
    for j in range(k + 1):
        assert chi_square_ok(position_counts(drafted, accepted, nxt, j, V), p[j]), f"position {j}"

    def accept_all(p, q, drafted, g):
        return torch.full((drafted.shape[0],), drafted.shape[1]), p[:, -1].multinomial(1, generator=g).squeeze(1)

    # The same test refuses a rule that keeps the draft's distribution instead.
    drafted, accepted, nxt = rule_samples(p, q, n, rule=accept_all)
    assert not chi_square_ok(position_counts(drafted, accepted, nxt, 0, V), p[0])


def test_sampling_with_the_target_as_its_own_draft_accepts_everything(targets):
    t = targets["mamba2-tiny"]
    spec = decoders.speculative(t, load("mamba2-tiny"), k=3)
    state = spec.prefill(PROMPTS, max_new_tokens=NEW, sampling=Sampling(temperature=0.8, top_k=50, seed=3))
    while not spec.finished(state):
        spec.step(state)
    # p == q: min(1, p/q) = 1 at every position.
    assert spec.acceptance(state)["acceptance_by_position"] == [1.0] * 3
    assert [len(x) for x in spec.output(state, [])] == [NEW] * len(PROMPTS)
    spec.release(state)


def test_usage_errors(targets):
    with pytest.raises(decoders.UsageError, match="k must be"):
        decoders.speculative(targets["llama-tiny"], "ngram", k=0)
    small = TransformerDecoder.from_preset({**read_json(CONFIG_DIR / "llama-tiny.json"), "vocab_size": 256}, "llama-tiny-256",
                                           device="cpu", dtype=torch.float32, impl="ref")
    with pytest.raises(decoders.UsageError, match="vocab_size"):
        decoders.speculative(targets["llama-tiny"], small, k=2)
    with pytest.raises(decoders.UsageError, match="autoregressive"):
        decoders.speculative(load("maskpredict-tiny"), "ngram", k=2)
    with pytest.raises(decoders.UsageError, match="draft"):
        decoders.speculative(targets["llama-tiny"], "medusa", k=2)
    with pytest.raises(decoders.UsageError, match="CUDA"):
        decoders.speculative(targets["llama-tiny"], "ngram", k=2, cuda_graphs=True)


class SecondWrong(ModelDraft):
    """A draft model whose second proposal is always changed: one draft is accepted a step."""

    def propose(self, *args):
        proposal = super().propose(*args)
        proposal.tokens[:, 1] = (proposal.tokens[:, 1] + 1) % self.decoder.vocab_size
        return proposal


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_rollback_with_the_target_weights(targets, plain, family):
    # The draft has the target's weights, so its first proposal is right whenever its rollback
    # (recurrent state after the kept tokens, transformer position) left it in the right state.
    spec = decoders.speculative(targets[family], SecondWrong(load(family)), k=4)
    state = spec.prefill(PROMPTS, max_new_tokens=NEW)
    while not spec.finished(state):
        spec.step(state)
    assert spec.output(state, []) == plain[family]
    assert spec.acceptance(state)["acceptance_by_position"] == [1.0, 0.0, 0.0, 0.0]
    spec.release(state)


def recurrent_state(cache):
    # Mamba-2's conv ring holds, beside the window, a slot no step reads: compare the SSM state.
    return [cache.ssm] if hasattr(cache, "ssm") else [cache.shift, cache.wkv]


@pytest.mark.parametrize("verify", ["chunk", "steps"])
@pytest.mark.parametrize("pair", [("mamba2-tiny", "rwkv7-tiny"), ("rwkv7-tiny", "mamba2-tiny")])
def test_rolled_back_states_equal_a_fresh_prefill(targets, pair, verify):
    """After every step the target's and the draft's recurrent states are those of the context
    (prompt + committed tokens but the pending one) consumed from scratch."""
    target, draft = targets[pair[0]], load(pair[1])
    spec = decoders.speculative(target, SecondWrong(draft), k=4, recurrent_verify=verify)
    state = spec.prefill(PROMPTS, max_new_tokens=NEW)
    while not spec.finished(state):
        spec.step(state)
        consumed = [c[:-1] for c in state.contexts]
        for dec, cache in ((target, state.cache), (draft, state.draft_state.cache)):
            fresh = dec.new_cache([len(c) for c in consumed], max(map(len, consumed)))
            dec.prefill_forward(fresh, consumed)
            for got, want in zip(recurrent_state(cache), recurrent_state(fresh)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    spec.release(state)


def test_compare_spec_option(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "decoders.compare", "--no-progress", "--models", "llama-tiny", "--ctx", "64",
                               "--new-tokens", "12", "--out", str(tmp_path / "out.jsonl"), *args], capture_output=True, text=True, timeout=300)

    done = run("--spec", "draft=mamba2-tiny,k=3")
    assert done.returncode == 0, done.stderr
    # The last stdout line is short; the full record is the one appended to --out.
    (point,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert point["status"] == "ok" and point["speculative"]["k"] == 3 and point["speculative"]["draft"]["family"] == "mamba2"
    assert 1 <= point["tokens_per_pass"] <= 4
    bad = run("--spec", "draft=maskpredict-tiny,k=3")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["error: --spec: draft 'maskpredict-tiny' is maskpredict, not autoregressive (transformer, mamba2, rwkv7)"]


@pytest.fixture(scope="module")
def heads_folder(tmp_path_factory):
    heads = DraftHeads(64, 6)
    torch.manual_seed(0)
    for block in heads.blocks:
        torch.nn.init.normal_(block.weight, std=0.5)
    folder = tmp_path_factory.mktemp("heads")
    heads.save(folder)
    return folder


@pytest.mark.parametrize("k", [1, 3, 6])
def test_draft_heads_greedy_equals_plain(targets, plain, heads_folder, k):
    target = targets["llama-tiny"]
    spec = decoders.speculative(target, f"heads:{heads_folder}", k=k)
    state = spec.prefill(PROMPTS, max_new_tokens=NEW)
    while not spec.finished(state):
        spec.step(state)
        # The heads keep the hidden state of the last consumed token (the one that chose the pending token).
        for b, ctx in enumerate(state.contexts):
            if state.remaining[b] > 0:
                fresh = target.model.hidden(torch.tensor([ctx[:-1]]))[0, -1]
                torch.testing.assert_close(state.draft_state.hidden[b], fresh, rtol=1e-4, atol=1e-5)
    assert spec.output(state, []) == plain["llama-tiny"]
    spec.release(state)


def test_draft_heads_refusals(targets, heads_folder):
    with pytest.raises(decoders.UsageError, match="transformer"):
        decoders.speculative(targets["mamba2-tiny"], f"heads:{heads_folder}", k=2)
    with pytest.raises(decoders.UsageError, match="more than the 6"):
        decoders.speculative(targets["llama-tiny"], f"heads:{heads_folder}", k=7)


@pytest.mark.gpu
@pytest.mark.parametrize("draft", FAMILIES + ["ngram"])
@pytest.mark.parametrize("target", FAMILIES)
def test_gpu_triton_greedy_equals_plain(target, draft):
    """On the Triton kernels (float32): the verify forward (chunked prefill / scan) against plain
    decode steps, eager and with the draft steps and verify forward graph-captured."""
    t = decoders.load(target, device="cuda", dtype="float32", impl="triton")
    d = draft if draft == "ngram" else decoders.load(draft, device="cuda", dtype="float32", impl="triton", seed=1)
    want = t.generate(PROMPTS, max_new_tokens=NEW).tokens
    for verify in ("chunk", "steps") if target != "llama-tiny" else ("chunk",):
        for graphs in (False, True):
            spec = decoders.speculative(t, d, k=4, recurrent_verify=verify, cuda_graphs=graphs)
            assert spec.generate(PROMPTS, max_new_tokens=NEW).tokens == want, (verify, graphs)


@pytest.mark.gpu
@pytest.mark.parametrize("target", FAMILIES)
def test_gpu_bf16_graphs_equal_eager(target):
    """In bf16 the captured draft steps and verify forward replay exactly what the eager step computes."""
    t = decoders.load(target, device="cuda", impl="triton")
    for draft in [decoders.load(d, device="cuda", impl="triton", seed=1) for d in FAMILIES] + ["ngram"]:
        for verify in ("chunk", "steps") if target != "llama-tiny" else ("chunk",):
            eager, graphed = (decoders.speculative(t, draft, k=3, recurrent_verify=verify, cuda_graphs=g).generate(PROMPTS, max_new_tokens=NEW).tokens
                              for g in (False, True))
            assert graphed == eager, (getattr(draft, "source", draft), verify)


@pytest.mark.gpu
def test_gpu_bf16_sampling_and_heads_run(heads_folder):
    t = decoders.load("llama-tiny", device="cuda", impl="triton")
    for draft in (decoders.load("rwkv7-tiny", device="cuda", impl="triton"), f"heads:{heads_folder}"):
        spec = decoders.speculative(t, draft, k=4, cuda_graphs=True)
        gen = spec.generate(PROMPTS, max_new_tokens=NEW, sampling=Sampling(temperature=1.0, seed=1))
        assert [len(x) for x in gen.tokens] == [NEW] * len(PROMPTS)
        assert all(0 <= tok < t.vocab_size for seq in gen.tokens for tok in seq)


def tiny_vocab(name, vocab, seed):
    family = decoders.family_of(name)
    values = {**read_json(CONFIG_DIR / f"{name}.json"), "vocab_size": vocab, "bos_token_id": 0, "eos_token_id": 1}
    if family == "mamba2":
        # The reference scan pads every row to a whole chunk: short chunks keep thousands of rows cheap.
        values["chunk_size"] = 4
    return decoders.family_class(family).from_preset(values, f"{name}-v{vocab}", seed=seed, device="cpu", dtype=torch.float32, impl="ref")


@pytest.mark.parametrize("target_name, draft_name", [("llama-tiny", "mamba2-tiny"), ("mamba2-tiny", "llama-tiny")])
def test_sampled_continuations_follow_the_target(target_name, draft_name):
    """2500 sampled 3-token continuations (k = 2, so the first step verifies both later tokens) against
    the target's exact joint distribution over all 4^3 continuations, chi-square at FALSE_ALARM."""
    V, n, prompt = 4, 2500, [1, 2, 3]
    target, draft = tiny_vocab(target_name, V, 0), tiny_vocab(draft_name, V, 1)
    sampling = Sampling(temperature=1.0, seed=5)
    gen = decoders.speculative(target, draft, k=2).generate([prompt] * n, max_new_tokens=3, sampling=sampling)
    seqs = torch.tensor(gen.tokens)
    counts = torch.bincount(seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2], minlength=V**3).double()
    grid = torch.cartesian_prod(*[torch.arange(V)] * 3)  # [V^3, 3] every continuation
    with torch.no_grad():
        probs = torch.softmax(target.logits(torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], 1)).double(), -1)
    L = len(prompt)
    exact = probs[:, L - 1].gather(1, grid[:, :1]) * probs[:, L].gather(1, grid[:, 1:2]) * probs[:, L + 1].gather(1, grid[:, 2:])
    exact = exact.squeeze(1)
    # Cells expected fewer than 5 times are pooled into one, as the chi-square approximation needs.
    small = exact * n < 5
    pooled_counts = torch.cat([counts[~small], counts[small].sum().view(1)])
    pooled_exact = torch.cat([exact[~small], exact[small].sum().view(1)])
    assert chi_square_ok(pooled_counts, pooled_exact)
