"""Speculative decoding for the autoregressive families: a draft proposes k tokens, the target checks
them all in one forward, and each step commits 1..k+1 tokens drawn from the target's own distribution.

    spec = decoders.speculative(target, draft, k=4)     # draft: a Decoder with the target's vocabulary
    spec = decoders.speculative(target, "ngram", k=4)   # prompt lookup: no second model
    spec = decoders.speculative(target, "heads:runs/llama-30m-heads", k=4)   # trained draft heads (eval.train_heads)
    gen = spec.generate(prompts, max_new_tokens=64)     # the same Generation as any decoder's

Any of transformer / Mamba-2 / RWKV-7 drafts for any of them. One `step`, for every sequence:

1. draft: from the pending token t0 (committed, not yet in the target's cache) the draft proposes
   d1..dk (a draft model runs k+1 decode steps: the last only consumes dk, so that every prefix of
   the proposal has a state to return to; prompt lookup copies what followed the latest earlier
   occurrence of the context's last n-gram; draft heads read the target's hidden state at the
   position that chose t0, kept from the previous verification).
2. verify: the target consumes [t0, d1..dk] in one forward and gives logits at all k+1 positions:
   the transformer's chunked-prefill path (the K/V written into the pages, attending over the
   prefix), the recurrent families' chunked scan resumed from the carried state.
3. accept: greedy keeps the longest prefix of d equal to the target's argmax and appends the
   target's own token after it. Sampling applies the rejection rule that keeps the target's
   distribution exactly: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first
   rejection draw from norm(max(0, p_j - q_j)); when all k pass, draw the bonus token from p_k.
4. roll back: with n drafts accepted the caches keep t0, d1..dn. The transformer's rejected slots
   are released from the paged cache (`PagedKVCache.truncate`); a recurrent target either keeps a
   checkpoint of its state before the verify forward and recomputes the kept tokens from it
   (recurrent_verify="chunk") or verifies with k+1 decode steps keeping the state after each
   ("steps"); a recurrent draft keeps the state after each of its steps.

Each step synchronises with the host once, to learn how many tokens each sequence kept. The eager
step is the reference; with cuda_graphs=True (GPU) a model draft's k+1 steps, the transformer's
verify forward and the recurrent "steps" verification are captured on the second step and replayed.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from decoders.base import AutoregressiveDecoder, Decoder, Memory, StepOut, UsageError, record_graph
from decoders.sampling import GREEDY, Sampling, filtered_probs, sample

MAX_K = 16
# What a target or draft model may carry: state speculative decoding can roll back (`Decoder.state_kind`).
KINDS = ("kv", "recurrent")


def autoregressive_families() -> list[str]:
    """The registered families whose decoders roll back (named in refusals)."""
    import decoders

    return [f for f in decoders.FAMILIES if decoders.family_class(f).state_kind in KINDS]


def race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One categorical draw per row of probs [..., V] (the exponential race of `decoders.sampling`)."""
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(-1)


class Replay:
    """`fn(*inputs)` (tensors in, tensors out, no host synchronisation) run eagerly on its first call,
    which compiles and tunes every kernel; recorded into a CUDA graph on the second, its inputs then
    copied into static buffers; replayed from then on. The outputs are the graph's static tensors,
    valid until the next call. Without `enabled` every call is eager."""

    def __init__(self, fn, device, generator=None, *, enabled: bool):
        self.fn, self.device, self.generator, self.enabled = fn, device, generator, enabled
        self.calls, self.graph, self.inputs, self.outputs = 0, None, None, None

    def __call__(self, *inputs):
        self.calls += 1
        if not self.enabled or self.calls == 1:
            return self.fn(*inputs)
        if self.graph is None:
            self.inputs = [x.clone() for x in inputs]
            # Recording runs nothing: the replay below is this call's work.
            self.graph, self.outputs = record_graph(self.device, self.generator, lambda: self.fn(*self.inputs))
        else:
            for static, x in zip(self.inputs, inputs):
                static.copy_(x)
        self.graph.replay()
        return self.outputs


def accept_greedy(target_logits: torch.Tensor, drafted: torch.Tensor, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance. target_logits [B, k+1, V], drafted [B, k] -> (accepted [B], next [B]):
    the number of leading drafts equal to the target's argmax, and the target's token after them."""
    B, T, V = target_logits.shape
    best = sample(target_logits.reshape(B * T, V), GREEDY, impl=impl).view(B, T)
    accepted = (drafted == best[:, :-1]).int().cumprod(1).sum(1)
    return accepted, best.gather(1, accepted.unsqueeze(1)).squeeze(1)


def accept_sampling(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule. p [B, k+1, V] target probabilities, q [B, k, V] the draft probabilities
    drafted [B, k] were drawn from -> (accepted [B], next [B]); `next` is the residual draw at the
    first rejection, or the bonus draw from p_k when every draft is accepted."""
    B, T, V = p.shape
    p_d = p[:, :-1].gather(2, drafted.unsqueeze(2)).squeeze(2)
    q_d = q.gather(2, drafted.unsqueeze(2)).squeeze(2)
    u = torch.rand(p_d.shape, generator=generator, device=p.device)
    # u < p/q written without the division: a draft the target gives no mass is never accepted.
    accepted = (u * q_d < p_d).int().cumprod(1).sum(1)
    rows = torch.arange(B, device=p.device)
    # q is 0 after the last draft, so the residual there is p_k itself (the bonus token).
    q_pad = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)
    residual = (p[rows, accepted] - q_pad[rows, accepted]).clamp_min(0)  # [B, V]
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[rows, accepted])
    return accepted, race(residual, generator)


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] int64 drafted tokens
    probs: torch.Tensor | None  # [B, k, V] the distributions they were drawn from; None: deterministic (one-hot)


class Draft(ABC):
    """What proposes tokens: a state per generation, proposals, and rollback to the kept prefix."""

    name: str = ""

    @abstractmethod
    def start(self, prompts: list[list[int]], max_len: int):
        """The draft's state after consuming the prompts."""

    @abstractmethod
    def propose(self, state, pending: torch.Tensor, positions: list[int], contexts: list[list[int]], k: int,
                sampling: Sampling, generator: torch.Generator | None) -> Proposal:
        """k tokens after pending [B] (the last token of each context, at positions[b])."""

    def rollback(self, state, keep: list[int]) -> None:
        """Of [pending, d1..dk] the first keep[b] tokens stay consumed by sequence b."""

    def release(self, state) -> None:
        """Give back what the state holds."""

    def describe(self) -> dict:
        return {"kind": self.name}


def snapshot(dec, cache) -> list[torch.Tensor]:
    """Copies of a recurrent decoder's state tensors."""
    return [t.clone() for t, _ in dec.state_tensors(cache)]


def restore_rows(dec, cache, saved: list[list[torch.Tensor] | None], choice: list[int]) -> None:
    """Row b of the cache becomes row b of saved[choice[b]] (None: the cache as it is)."""
    groups = {}
    for b, c in enumerate(choice):
        if saved[c] is not None:
            groups.setdefault(c, []).append(b)
    for c, rows in groups.items():
        index = torch.tensor(rows, device=saved[c][0].device)
        for (t, dim), s in zip(dec.state_tensors(cache), saved[c]):
            if len(rows) == t.shape[dim]:
                t.copy_(s)
            else:
                t.index_copy_(dim, index, s.index_select(dim, index))


@dataclass
class ModelDraftState:
    cache: object
    positions: list[int]  # tokens each sequence's cache holds
    saved: list = field(default_factory=list)  # recurrent: state before the proposal and after each draft step
    replay: Replay | None = None  # the k+1 draft steps, graph-captured with cuda_graphs


class ModelDraft(Draft):
    """A draft model of any autoregressive family, decoding on its own cache."""

    name = "model"

    def __init__(self, decoder: AutoregressiveDecoder):
        self.decoder = decoder
        self.cuda_graphs = False  # set by the SpeculativeDecoder

    def describe(self) -> dict:
        return {"kind": self.name, **self.decoder.describe()}

    def start(self, prompts, max_len):
        cache = self.decoder.new_cache([len(p) for p in prompts], max_len)
        self.decoder.prefill_forward(cache, prompts)
        return ModelDraftState(cache, [len(p) for p in prompts])

    def propose(self, state, pending, positions, contexts, k, sampling, generator):
        if state.replay is None:
            state.replay = Replay(lambda token, pos: self.draft_steps(state.cache, token, pos, k, sampling, generator),
                                  self.decoder.device, generator, enabled=self.cuda_graphs)
        tokens, probs, saved = state.replay(pending, torch.tensor(state.positions, device=self.decoder.device))
        state.saved = saved
        return Proposal(tokens, probs)

    def draft_steps(self, cache, token, pos, k, sampling, generator):
        """k+1 decode steps from token [B] at pos [B]: (drafted [B, k], their distributions [B, k, V] or
        None when greedy, the recurrent states before the first step and after each but the last)."""
        dec = self.decoder
        recurrent = dec.state_kind == "recurrent"
        saved = [snapshot(dec, cache)] if recurrent else []
        drafted, probs = [], []
        for j in range(k + 1):
            logits = dec.decode_forward(cache, token, pos + j)
            if recurrent:
                # After the last step the live cache is that state: nothing to copy.
                saved.append(snapshot(dec, cache) if j < k else None)
            if j == k:
                break
            if sampling.greedy:
                token = sample(logits, GREEDY, impl=dec.impl)
            else:
                q = filtered_probs(logits, sampling)
                token = race(q, generator)
                probs.append(q)
            drafted.append(token)
        return torch.stack(drafted, 1), torch.stack(probs, 1) if probs else None, saved

    def rollback(self, state, keep):
        if self.decoder.state_kind == "recurrent":
            restore_rows(self.decoder, state.cache, state.saved, keep)
            state.saved = []
        # A transformer draft's K/V past a position is rewritten before it is read again.
        state.positions = [p + n for p, n in zip(state.positions, keep)]

    def release(self, state):
        self.decoder.release(ARStateView(state.cache))


@dataclass
class ARStateView:
    """The one field a family's `release` reads."""

    cache: object


class NgramDraft(Draft):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last
    n-gram (n from max_ngram down to min_ngram); no match proposes the last token repeated."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise UsageError(f"ngram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def describe(self) -> dict:
        return {"kind": self.name, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}

    def start(self, prompts, max_len):
        return None

    def lookup(self, context: list[int], k: int) -> list[int]:
        L = len(context)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            tail = context[L - n:]
            for i in range(L - n - 1, -1, -1):
                if context[i : i + n] == tail:
                    follow = context[i + n : i + n + k]
                    return follow + [follow[-1]] * (k - len(follow))
        return [context[-1]] * k

    def propose(self, state, pending, positions, contexts, k, sampling, generator):
        tokens = torch.tensor([self.lookup(c, k) for c in contexts], device=pending.device)
        return Proposal(tokens, None)


@dataclass
class HeadsDraftState:
    hidden: torch.Tensor | None = None  # [B, d] the target's hidden state that chose each pending token


class HeadsDraft(Draft):
    """Medusa-style heads (`declab_arch.draft_heads`) on a transformer target's final hidden state:
    head j proposes the token j positions after the pending one, all k from one hidden state. The
    first step, before any verification has given a hidden state, proposes the pending token repeated."""

    name = "heads"
    wants_hidden = True

    def __init__(self, heads, target: AutoregressiveDecoder, source: str = ""):
        if target.state_kind != "kv":
            raise UsageError(f"draft heads read a transformer's hidden states; the target is {target.family}")
        if heads.hidden_size != target.config.hidden_size:
            raise UsageError(f"draft heads of hidden size {heads.hidden_size} do not fit {target.source} ({target.config.hidden_size})")
        self.heads = heads.to(device=target.device, dtype=target.dtype).eval()
        self.target, self.source = target, source

    def describe(self) -> dict:
        return {"kind": self.name, "model": self.source, "heads": self.heads.k}

    def start(self, prompts, max_len):
        return HeadsDraftState()

    def propose(self, state, pending, positions, contexts, k, sampling, generator):
        if state.hidden is None:
            return Proposal(pending.unsqueeze(1).expand(-1, k).contiguous(), None)
        logits = self.heads(state.hidden, self.target.model.head)[:k]  # [k, B, V]
        if sampling.greedy:
            return Proposal(logits.argmax(-1).T.contiguous(), None)
        q = filtered_probs(logits.flatten(0, 1), sampling).view(*logits.shape).transpose(0, 1)  # [B, k, V]
        return Proposal(race(q, generator), q.contiguous())

    def observe(self, state, hidden: torch.Tensor, accepted: torch.Tensor) -> None:
        """hidden [B, T, d] of the verified positions; the next pending token came from position accepted[b]."""
        state.hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), accepted]


def as_draft(draft, target: AutoregressiveDecoder) -> Draft:
    if isinstance(draft, Draft):
        return draft
    if draft == "ngram":
        return NgramDraft()
    if isinstance(draft, str) and draft.startswith("heads:"):
        from declab_arch import draft_heads

        folder = draft.removeprefix("heads:")
        return HeadsDraft(draft_heads.load(folder), target, source=folder)
    if isinstance(draft, AutoregressiveDecoder):
        return ModelDraft(draft)
    raise UsageError(f"a draft is an autoregressive Decoder, 'ngram' or 'heads:FOLDER', got {draft!r}")


@dataclass
class SpecState:
    cache: object  # the target's cache
    draft_state: object
    pending: torch.Tensor  # [B] int64, committed, not yet consumed by target or draft
    positions: list[int]  # tokens in each sequence's target cache
    contexts: list[list[int]]  # prompt + committed tokens, per sequence (host)
    new_tokens: list[list[int]]
    remaining: list[int]  # tokens each sequence may still commit
    sampling: Sampling
    generator: torch.Generator | None
    prompt_lens: list[int]
    rounds: int = 0  # verifications that had at least one sequence still generating
    verified: int = 0  # (sequence, verification) pairs of sequences still generating
    committed_total: int = 0  # tokens those verifications committed
    replay: Replay | None = None  # the target's verify forward, graph-captured with cuda_graphs
    accepted_at: list[int] = field(default_factory=list)  # [k] how often draft position j+1 was accepted
    offered_at: list[int] = field(default_factory=list)  # [k] ... of how many verifications it could be committed in


class SpeculativeDecoder(Decoder):
    """A target decoder whose steps are speculative: draft, verify, accept, roll back."""

    family = "speculative"

    def __init__(self, target: AutoregressiveDecoder, draft, k: int = 4, *, recurrent_verify: str = "chunk", cuda_graphs: bool = False):
        if not isinstance(target, AutoregressiveDecoder) or target.state_kind not in KINDS:
            raise UsageError(f"speculative decoding needs an autoregressive target ({', '.join(autoregressive_families())}), got {getattr(target, 'family', target)!r}")
        if not 1 <= k <= MAX_K:
            raise UsageError(f"k must be from 1 to {MAX_K}, got {k}")
        if recurrent_verify not in ("chunk", "steps"):
            raise UsageError(f"recurrent_verify must be 'chunk' or 'steps', got {recurrent_verify!r}")
        self.draft = as_draft(draft, target)
        if isinstance(self.draft, ModelDraft):
            d = self.draft.decoder
            if d.state_kind not in KINDS:
                raise UsageError(f"a draft model must be autoregressive ({', '.join(autoregressive_families())}), got {d.family!r}")
            if d.vocab_size != target.vocab_size:
                raise UsageError(f"draft {d.source} has vocab_size {d.vocab_size}, the target {target.source} {target.vocab_size}: they must match")
            if d.device != target.device:
                raise UsageError(f"draft on {d.device}, target on {target.device}: put them on one device")
        if isinstance(self.draft, HeadsDraft) and k > self.draft.heads.k:
            raise UsageError(f"k = {k} is more than the {self.draft.heads.k} trained draft heads")
        if cuda_graphs and target.device.type != "cuda":
            raise UsageError(f"cuda_graphs needs a CUDA device, the target is on {target.device}")
        self.target, self.k, self.recurrent_verify = target, k, recurrent_verify
        if isinstance(self.draft, ModelDraft):
            self.draft.cuda_graphs = cuda_graphs
        self.model, self.config, self.device, self.dtype = target.model, target.config, target.device, target.dtype
        self.impl, self.tokenizer, self.max_context = target.impl, target.tokenizer, target.max_context
        self.source = f"{target.source}+spec({self.draft.describe().get('model', self.draft.name)},k={k})"
        # Graph-captured: a model draft's k+1 steps, the transformer's verify forward and the
        # recurrent "steps" verification (the "chunk" one groups rows on the host and stays eager).
        self.cuda_graphs = cuda_graphs

    def describe(self) -> dict:
        return {**self.target.describe(), "family": self.target.family, "model": self.source, "cuda_graphs": self.cuda_graphs,
                "speculative": {"k": self.k, "recurrent_verify": self.recurrent_verify, "draft": self.draft.describe()}}

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    def logits(self, tokens):
        return self.target.logits(tokens)

    def memory(self, batch: int, ctx: int, *, new_tokens: int = 1) -> Memory:
        """The target's bytes at ctx plus a draft model's (its state and one step's traffic per drafted token)."""
        mem = self.target.memory(batch, ctx + self.k + 1)
        if isinstance(self.draft, ModelDraft):
            d = self.draft.decoder.memory(batch, ctx + self.k + 1)
            steps = self.k + 1
            return Memory(mem.weight_bytes + d.weight_bytes, mem.state_bytes + d.state_bytes,
                          mem.step_read_bytes + steps * d.step_read_bytes, mem.step_write_bytes + steps * d.step_write_bytes)
        return mem

    @torch.inference_mode()
    def prefill(self, prompts, *, max_new_tokens: int, sampling: Sampling = GREEDY) -> SpecState:
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompts = self.encode_prompts(prompts)
        lens = [len(p) for p in prompts]
        # Verification looks k+1 positions past the last committed token.
        max_len = max(lens) + max_new_tokens + self.k + 1
        self.check_context(max_len)
        t = self.target
        cache = t.new_cache(lens, max_len)
        logits = t.prefill_forward(cache, prompts)
        if t.state_kind == "kv":
            # Blocks are claimed as verification needs them and released on rollback.
            for s, n in zip(cache.seqs, lens):
                cache.kv.truncate(s, n)
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        first = sample(logits, sampling, generator, impl=self.impl)
        first_host = first.tolist()
        return SpecState(
            cache=cache,
            draft_state=self.draft.start(prompts, max_len),
            pending=first,
            positions=list(lens),
            contexts=[p + [f] for p, f in zip(prompts, first_host)],
            new_tokens=[[f] for f in first_host],
            remaining=[max_new_tokens - 1] * len(prompts),
            sampling=sampling,
            generator=generator,
            prompt_lens=lens,
            accepted_at=[0] * self.k,
            offered_at=[0] * self.k,
        )

    @torch.inference_mode()
    def step(self, state: SpecState) -> StepOut:
        k, T = self.k, self.k + 1
        proposal = self.draft.propose(state.draft_state, state.pending, state.positions, state.contexts, k, state.sampling, state.generator)
        fed = torch.cat([state.pending.unsqueeze(1), proposal.tokens], dim=1)  # [B, T]
        logits, saved, hidden = self.verify(state, fed)  # [B, T, V]
        if state.sampling.greedy:
            accepted, nxt = accept_greedy(logits, proposal.tokens, self.impl)
        else:
            B, _, V = logits.shape
            p = filtered_probs(logits.reshape(B * T, V), state.sampling).view(B, T, V)
            q = proposal.probs if proposal.probs is not None else torch.nn.functional.one_hot(proposal.tokens, V).float()
            accepted, nxt = accept_sampling(p, q, proposal.tokens, state.generator)
        if hidden is not None:
            self.draft.observe(state.draft_state, hidden, accepted)
        # One copy to the host: [B, 2 + k] of accepted count, next token, drafts.
        host = torch.cat([accepted.unsqueeze(1), nxt.unsqueeze(1), proposal.tokens], dim=1).tolist()
        accepted_host, nxt_host, drafted_host = [h[0] for h in host], [h[1] for h in host], [h[2:] for h in host]
        keep, gained = [], []
        for b, n in enumerate(accepted_host):
            left = state.remaining[b]
            new = (drafted_host[b][:n] + [nxt_host[b]])[:left]
            if left > 0:
                state.verified += 1
                state.committed_total += len(new)
                # Draft j can be committed only while the budget has room for it.
                for j in range(min(k, left)):
                    state.offered_at[j] += 1
                    state.accepted_at[j] += j < n
            # A finished sequence keeps nothing: its caches stay where they were.
            keep.append(min(n + 1, left))
            gained.append(new)
            state.new_tokens[b] += new
            state.contexts[b] += new
            state.remaining[b] = left - len(new)
        if any(gained):
            state.rounds += 1
        self.rollback(state.cache, saved, fed, state.positions, keep)
        self.draft.rollback(state.draft_state, keep)
        state.positions = [p + n for p, n in zip(state.positions, keep)]
        state.pending = nxt
        tokens = torch.tensor([g + [0] * (T - len(g)) for g in gained], device=self.device)
        committed = torch.tensor([len(g) for g in gained], dtype=torch.int32, device=self.device)
        return StepOut(tokens=tokens, committed=committed, logits=logits[:, -1])

    def verify(self, state: SpecState, fed: torch.Tensor):
        """Target logits [B, T, V] of the fed tokens [B, T] at state.positions[b].., consumed into the
        cache; what rollback needs (recurrent: the checkpoint, or the state after each position); and,
        for draft heads, the transformer's hidden states [B, T, d]."""
        t, cache, positions = self.target, state.cache, state.positions
        start = torch.tensor(positions, device=t.device)
        if t.state_kind == "kv":
            wants_hidden = getattr(self.draft, "wants_hidden", False)
            # Host side: claim the slots (new blocks as needed); the forward reads them as tensors.
            slots = torch.cat([cache.kv.append(s, fed.shape[1]) for s in cache.seqs]).to(t.device)
            tables = cache.kv.block_table(cache.seqs, width=cache.block_tables.shape[1])
            if state.replay is None:
                state.replay = Replay(lambda *x: verify_transformer(t, cache, *x, return_hidden=wants_hidden), t.device,
                                      enabled=self.cuda_graphs)
            out = state.replay(fed, start, slots, tables)
            return (out[0], None, out[1]) if wants_hidden else (out, None, None)
        if self.recurrent_verify == "steps":
            if state.replay is None:
                state.replay = Replay(lambda fed, start: verify_steps(t, cache, fed, start), t.device, enabled=self.cuda_graphs)
            logits, saved = state.replay(fed, start)
            return logits, saved, None
        saved = snapshot(t, cache)
        return t.chunk_forward(cache, fed, positions, [fed.shape[1]] * fed.shape[0], logits="all"), saved, None

    def rollback(self, cache, saved, fed: torch.Tensor, positions: list[int], keep: list[int]) -> None:
        """Each target sequence b keeps the first keep[b] fed tokens."""
        t, T = self.target, fed.shape[1]
        if t.state_kind == "kv":
            for s, p, n in zip(cache.seqs, positions, keep):
                cache.kv.truncate(s, p + n)
            return
        if self.recurrent_verify == "steps":
            restore_rows(t, cache, saved, keep)
            return
        redo = [b for b, n in enumerate(keep) if n < T]
        if not redo:
            return
        restore_subset(t, cache, saved, redo)
        again = [b for b in redo if keep[b] > 0]
        if again:
            rows = torch.tensor(again, device=t.device)
            t.chunk_forward(cache, fed[rows], [positions[b] for b in again], [keep[b] for b in again], rows=again, logits="none")

    def finished(self, state: SpecState) -> bool:
        return all(r <= 0 for r in state.remaining)

    def output(self, state: SpecState, steps: list[StepOut]) -> list[list[int]]:
        return [list(t) for t in state.new_tokens]

    def release(self, state: SpecState) -> None:
        self.target.release(ARStateView(state.cache))
        self.draft.release(state.draft_state)

    def acceptance(self, state: SpecState) -> dict:
        """Mean tokens committed per verification (per sequence still generating) and how often
        each draft position was accepted (of the verifications whose budget could commit it)."""
        v = max(1, state.verified)
        by_position = [a / max(1, o) for a, o in zip(state.accepted_at, state.offered_at)]
        return {"mean_accepted_length": state.committed_total / v, "acceptance_by_position": by_position,
                "verifications": state.verified, "rounds": state.rounds}


def restore_subset(dec, cache, saved: list[torch.Tensor], rows: list[int]) -> None:
    index = torch.tensor(rows, device=saved[0].device)
    for (t, dim), s in zip(dec.state_tensors(cache), saved):
        t.index_copy_(dim, index, s.index_select(dim, index))


def verify_steps(dec, cache, fed: torch.Tensor, start: torch.Tensor):
    """A recurrent target's verification as decode steps: logits [B, T, V] and the states before the
    first and after each step but the last (the live cache is the state after it)."""
    saved, logits = [snapshot(dec, cache)], []
    for j in range(fed.shape[1]):
        logits.append(dec.decode_forward(cache, fed[:, j], start + j))
        saved.append(snapshot(dec, cache) if j < fed.shape[1] - 1 else None)
    return torch.stack(logits, 1), saved


def verify_transformer(dec, cache, fed: torch.Tensor, start: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, *,
                       return_hidden: bool = False):
    """The fed tokens [B, T] at positions start [B].. through the chunked-prefill path: K/V written into
    the claimed slots [B * T] (block tables [B, W]), each query attending over its sequence's prefix
    and the fed tokens before it. Logits [B, T, V] (and with return_hidden the hidden states [B, T, d])."""
    from declab_arch import llama

    B, T = fed.shape
    kv, dev = cache.kv, dec.device
    batch = llama.PagedBatch(
        k_cache=kv.k,
        v_cache=kv.v,
        k_scale=kv.k_scale,
        v_scale=kv.v_scale,
        block_tables=tables,
        seq_lens=(start + T).to(torch.int32),
        slot_mapping=slots,
        decode=False,
        cu_seqlens_q=torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=dev),
        max_seqlen_q=T,
        impl=dec.impl,
    )
    pos = (start.unsqueeze(1) + torch.arange(T, device=dev)).flatten()
    if return_hidden:
        logits, hidden = dec.model.forward_paged(fed.flatten(), pos, batch, return_hidden=True)
        return logits.view(B, T, -1), hidden.view(B, T, -1)
    return dec.model.forward_paged(fed.flatten(), pos, batch).view(B, T, -1)


def speculative(target: AutoregressiveDecoder, draft, k: int = 4, **options) -> SpeculativeDecoder:
    """`target` decoding speculatively with `draft` (an autoregressive Decoder with the same vocabulary,
    'ngram', 'heads:FOLDER' for trained draft heads, or a `Draft`) proposing k tokens per step. options: recurrent_verify="chunk" | "steps",
    cuda_graphs=True (on a GPU: the draft steps and the verify forward graph-captured)."""
    return SpeculativeDecoder(target, draft, k, **options)


@dataclass
class SpecOption:
    """A command line's `--spec draft=PRESET_OR_FOLDER|ngram|heads:FOLDER,k=4[,verify=chunk|steps][,graphs=0|1]`, parsed."""

    draft: str
    k: int = 4
    recurrent_verify: str = "chunk"
    cuda_graphs: bool = False
    loaded: dict = field(default_factory=dict, repr=False)

    def wrap(self, target: AutoregressiveDecoder) -> SpeculativeDecoder:
        """`target` decoding speculatively; a draft model is loaded once, on the target's device, dtype and impl."""
        draft = self.draft
        if draft != "ngram" and not draft.startswith("heads:"):
            if draft not in self.loaded:
                import decoders

                self.loaded[draft] = decoders.load(draft, device=target.device, dtype=target.dtype, impl=target.impl)
            draft = self.loaded[draft]
        return speculative(target, draft, self.k, recurrent_verify=self.recurrent_verify, cuda_graphs=self.cuda_graphs)


def parse_spec(text: str, *, targets: list[str] = (), peers: list[str] = ()) -> SpecOption:
    """'draft=llama-tiny,k=4' (draft a preset, a checkpoint folder, 'ngram' or 'heads:FOLDER'; verify=chunk|steps;
    graphs=1: CUDA graphs) -> SpecOption.
    `targets` (presets or folders) must be autoregressive; `peers` must be empty (they do not speculate)."""
    fields = {}
    for part in filter(None, text.split(",")):
        key, eq, value = part.partition("=")
        if not eq or key.strip() not in ("draft", "k", "verify", "graphs"):
            raise UsageError(f"--spec {text!r}: expected draft=PRESET_OR_FOLDER|ngram|heads:FOLDER,k=N[,verify=chunk|steps][,graphs=0|1], got {part!r}")
        fields[key.strip()] = value.strip()
    if "draft" not in fields:
        raise UsageError(f"--spec {text!r} names no draft (draft=PRESET_OR_FOLDER or draft=ngram)")
    try:
        k = int(fields.get("k", 4))
    except ValueError:
        raise UsageError(f"--spec k must be an integer, got {fields['k']!r}") from None
    if not 1 <= k <= MAX_K:
        raise UsageError(f"--spec k must be from 1 to {MAX_K}, got {k}")
    verify = fields.get("verify", "chunk")
    if verify not in ("chunk", "steps"):
        raise UsageError(f"--spec verify must be chunk or steps, got {verify!r}")
    graphs = fields.get("graphs", "0")
    if graphs not in ("0", "1"):
        raise UsageError(f"--spec graphs must be 0 or 1, got {graphs!r}")
    if peers:
        raise UsageError("--spec times the lab's own speculative decoding: leave out --peers")
    import decoders

    model_draft = fields["draft"] != "ngram" and not fields["draft"].startswith("heads:")
    for role, name in [("draft", fields["draft"])] * model_draft + [("model", t) for t in targets]:
        family = decoders.family_of(name)
        if decoders.family_class(family).state_kind not in KINDS:
            raise UsageError(f"--spec: {role} {name!r} is {family}, not autoregressive ({', '.join(autoregressive_families())})")
    return SpecOption(fields["draft"], k, verify, graphs == "1")
