"""The Mask-Predict family: a bidirectional masked LM (`declab_arch.maskpredict`) decoded by iterative refinement.

A canvas of N mask tokens follows the prompt; every `step` is one forward pass that predicts the
masked positions of the current block and decides which predictions to keep. Rules (`rule=`):

- `"mask-predict"` (Ghazvininejad et al. 2019): pass t of T predicts every masked position (only
  those: a kept token keeps its token and confidence), then re-masks the n_t = L*(T-t)//T least
  confident tokens anywhere in the block, so a token kept earlier may be revised;
- `"low-confidence"` (LLaDA, Nie et al. 2025): pass t commits the k_t = L*t//T - L*(t-1)//T most
  confident masked predictions and never re-masks; with `threshold=` instead of a count, every masked
  prediction above the threshold is committed, at least the most confident one per pass, so the
  number of passes adapts (one host synchronisation per pass, to see whether the block is done).

Confidence is the model's probability of the chosen token (greedy argmax, or sampled), with the mask
token excluded from the distribution, so the output never contains a mask. Ties go to the leftmost
position. `iterations` is T per block (default: the block width, one token per pass).

Blocks (`block_length=`, semi-autoregressive): the canvas is split into blocks decoded left to
right. With `prefix_cache=True` (default) the prompt and the finished blocks are a prefix whose K/V
sits in the paged cache: the prompt's K/V is computed once in prefill, a finished block's once, in
the first pass of the next block (as a second query segment of the same packed forward, attending to
the prefix and itself), and each pass writes only the current block's K/V after the prefix. The
prefix never sees later tokens, which is exactly the segment attention of
`declab_arch.maskpredict.MaskPredictLM.hidden(segments=...)` (prompt 0, block k: k+1). With
`prefix_cache=False` every pass recomputes prompt + whole canvas with full bidirectional attention
(LLaDA's own decoding; future blocks are all masks).

Length (`length_beam=`): by default the canvas is fixed at N = max_new_tokens (`generate(...,
stop_at_eos=True)` ends each output at its first end-of-sequence token and stops once every sequence
has one among its final tokens). With `length_beam=l` the length head proposes the l most likely
lengths (<= N); the l candidate canvases share the prompt's K/V blocks (fork) and are decoded
together, and each sequence keeps the candidate with the best mean log-probability.

Scoring (`loglikelihood`, lm-eval's loglikelihood) is a Monte-Carlo ELBO, a lower bound, of one of
two models: `score_bound="prefix"` (default with the prefix cache) scores with the context blind to
the continuation, as prefix-cached decoding runs the model; `score_bound="bidirectional"` (default
without it) lets the context see the masked continuation, as LLaDA scores. `describe()["scoring"]`
says which one a result used.

`kv_dtype="fp8"` stores the prefix cache's pages in e4m3 with one exponent per row
(`decoders.kv_cache`), as the transformer family does.

`StepOut.committed` [B] counts the tokens each sequence's canvas gained in the pass (unmasked after
minus before; with a length beam, those of the most likely length's candidate), so tokens per pass
read like the autoregressive families' one token per step.
"""

import math
from dataclasses import dataclass, field

import torch

from declab_arch import llama, maskpredict
from decoders.base import Decoder, Memory, StepOut, UsageError, record_graph
from decoders.kv_cache import PagedKVCache, kv_token_bytes, resolve_kv_dtype
from decoders.sampling import GREEDY, Sampling, sample

RULES = ("mask-predict", "low-confidence")
# What `loglikelihood` bounds: "prefix", the context blind to the continuation (what prefix-cached
# decoding computes); "bidirectional", the context seeing the masked continuation (LLaDA's scoring).
BOUNDS = ("prefix", "bidirectional")


@dataclass
class PassPlan:
    """One pass's packed forward: which tokens, at which positions, where their K/V goes, which rows are the canvas."""

    gather: torch.Tensor  # [Ntok] int64, flat index into CanvasState.seq of each packed token
    positions: torch.Tensor  # [Ntok] int64
    batch: llama.PagedBatch
    logit_index: torch.Tensor  # [R] packed rows of the current block's canvas positions
    dense: torch.Tensor  # [R] index of each such row into the block [E * W]


@dataclass
class CanvasState:
    kv: PagedKVCache
    seqs: list[int]  # KV sequence of each entry (E = batch * beam entries, sequence-major)
    block_tables: torch.Tensor  # [E, max_blocks] int32
    slots: list[torch.Tensor]  # per entry [P_e + L_e] int64 cache slot of each position (CPU)
    seq: torch.Tensor  # [E, Pmax + N] int64: prompt right-aligned before column Pmax, canvas after it
    confidence: torch.Tensor  # [E, N] float32 probability of each canvas token when it was predicted
    active: torch.Tensor  # [E, N] bool, canvas column < the entry's length
    prompt_lens: list[int]  # [B]
    entry_prompt_lens: list[int]  # [E]
    lengths: list[int]  # [E] canvas length of each entry (N without a length beam)
    width: int  # block width W
    num_blocks: int
    beam: int
    iterations: int  # T per block
    sampling: Sampling
    generator: torch.Generator | None
    block: int = 0
    passes_in_block: int = 0
    t: torch.Tensor | None = None  # [1] int64 passes done in the current block, on the device
    plans: tuple[PassPlan, PassPlan] | None = field(default=None, repr=False)
    block_lengths: torch.Tensor | None = None  # [E] int64 active columns of the current block
    graph: "torch.cuda.CUDAGraph | None" = field(default=None, repr=False)  # the block's later pass, captured
    graph_out: tuple | None = field(default=None, repr=False)  # its static outputs (see `_refine`)

    @property
    def canvas(self) -> torch.Tensor:
        """[E, N] view of the canvas columns."""
        return self.seq[:, self.seq.shape[1] - self.confidence.shape[1] :]


def _positive_int(name: str, value, *, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")
    return value


def _ranks(score: torch.Tensor, descending: bool) -> torch.Tensor:
    """[E, W] rank of each column within its row (0 = first); ties keep the leftmost first."""
    order = torch.sort(score, dim=1, descending=descending, stable=True).indices
    steps = torch.arange(score.shape[1], device=score.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, steps)


class MaskPredictDecoder(Decoder):
    family = "maskpredict"
    arch = maskpredict
    presets = "maskpredict"
    state_kind = "canvas"

    def __init__(self, model, config, *, iterations: int | None = None, rule: str | None = None, block_length: int | None = None,
                 threshold: float | None = None, length_beam: int | None = None, prefix_cache: bool = True, page_size: int = 16, score_bound: str | None = None,
                 kv_dtype=None, **kwargs):
        super().__init__(model, config, max_context=config.max_position_embeddings, **kwargs)
        # None: the cache stores the model's dtype (see `kv_dtype`).
        self._kv_dtype = resolve_kv_dtype(kv_dtype, self.dtype, self.device, self.impl)
        # A threshold decides on the host after every pass whether the block is done: no graph replay.
        self.cuda_graphs = self.cuda_graphs and threshold is None
        self.iterations = _positive_int("iterations", iterations, allow_none=True)
        self.block_length = _positive_int("block_length", block_length, allow_none=True)
        self.length_beam = _positive_int("length_beam", length_beam, allow_none=True)
        self.rule = rule or ("low-confidence" if threshold is not None else "mask-predict")
        if self.rule not in RULES:
            raise UsageError(f"unknown rule {self.rule!r} (known: {', '.join(RULES)})")
        if threshold is not None:
            if self.rule != "low-confidence":
                raise UsageError("threshold applies to rule='low-confidence' only")
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < 1:
                raise UsageError(f"threshold must be a probability in (0, 1), got {threshold!r}")
            if iterations is not None:
                raise UsageError("threshold decides the number of passes: give iterations or threshold, not both")
        self.threshold = threshold
        if self.length_beam is not None:
            if not config.max_predicted_length:
                raise UsageError(f"length_beam needs a length head, and {self.source} has none (max_predicted_length is 0)")
            if self.block_length is not None:
                raise UsageError("length_beam decodes each candidate length as one block: drop block_length")
        self.prefix_cache = bool(prefix_cache)
        self.score_bound = score_bound or ("prefix" if self.prefix_cache else "bidirectional")
        if self.score_bound not in BOUNDS:
            raise UsageError(f"unknown score_bound {score_bound!r} (known: {', '.join(BOUNDS)})")
        self.page_size = page_size
        self.mask_token_id = config.mask_token_id

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the prefix cache stores: float8_e4m3fn for kv_dtype="fp8", else the model's dtype (or the one asked for)."""
        return self._kv_dtype or self.dtype

    def describe(self) -> dict:
        out = super().describe()
        out["decoding"] = {
            "rule": self.rule, "iterations": self.iterations, "block_length": self.block_length, "threshold": self.threshold,
            "length_beam": self.length_beam, "prefix_cache": self.prefix_cache,
        }
        out["scoring"] = {"bound": self.score_bound}
        out["kv_dtype"] = str(self.kv_dtype).removeprefix("torch.")
        return out

    @torch.inference_mode()
    def prefill(self, prompts, *, max_new_tokens: int, sampling: Sampling = GREEDY) -> CanvasState:
        prompts = self.encode_prompts(prompts)
        N = _positive_int("max_new_tokens (the canvas size)", max_new_tokens)
        W = self.block_length or N
        if W > N or N % W:
            raise UsageError(f"block_length {W} must divide the canvas of {N} tokens (max_new_tokens)")
        lens = [len(p) for p in prompts]
        self.check_context(max(lens) + N)
        B, beam = len(prompts), self.length_beam or 1
        kv = PagedKVCache(self.config.num_hidden_layers, self.config.num_key_value_heads, self.config.head_dim, block_size=self.page_size,
                          num_blocks=B * beam * -(-(max(lens) + N) // self.page_size), dtype=self.kv_dtype, device=self.device)
        parents = [kv.add_sequence() for _ in prompts]
        prompt_slots = [kv.append(s, n) for s, n in zip(parents, lens)]
        lengths = [[N]] * B
        if self.prefix_cache or self.length_beam:
            hidden = self._encode_prompts(kv, parents, prompts, prompt_slots)
            if self.length_beam:
                lengths = self._propose_lengths(hidden, lens, N).tolist()
        seqs, entry_lens, entry_prompt_lens = [], [], []
        for parent, n, cands in zip(parents, lens, lengths):
            for c, length in enumerate(cands):
                if c == 0:
                    seq = parent
                elif self.prefix_cache:
                    # The candidates share the prompt's blocks; a shared partly filled block is copied on append.
                    seq = kv.fork(parent)
                else:
                    seq = kv.add_sequence()
                    kv.append(seq, n)
                seqs.append(seq)
                entry_lens.append(length)
                entry_prompt_lens.append(n)
        for seq, length in zip(seqs, entry_lens):
            kv.append(seq, length)
        slots = []
        for seq, n, length in zip(seqs, entry_prompt_lens, entry_lens):
            pos = torch.arange(n + length)
            table = torch.tensor(kv.blocks[seq], dtype=torch.int64)
            slots.append(table[pos // self.page_size] * self.page_size + pos % self.page_size)
        E, Pmax, dev = len(seqs), max(lens), self.device
        seq_buf = torch.full((E, Pmax + N), self.mask_token_id, dtype=torch.int64)
        for e, n in enumerate(entry_prompt_lens):
            seq_buf[e, Pmax - n : Pmax] = torch.tensor(prompts[e // beam])
        active = torch.arange(N)[None, :] < torch.tensor(entry_lens)[:, None]
        generator = None if sampling.greedy else torch.Generator(device=dev).manual_seed(sampling.seed)
        return CanvasState(
            kv=kv, seqs=seqs, block_tables=kv.block_table(seqs), slots=slots, seq=seq_buf.to(dev),
            confidence=torch.ones(E, N, device=dev), active=active.to(dev), prompt_lens=lens, entry_prompt_lens=entry_prompt_lens,
            lengths=entry_lens, width=W, num_blocks=N // W, beam=beam, iterations=self.iterations or W, sampling=sampling,
            generator=generator, t=torch.zeros(1, dtype=torch.int64, device=dev),
        )

    def _encode_prompts(self, kv, seqs, prompts, prompt_slots) -> torch.Tensor:
        """One bidirectional forward over the packed prompts, writing their K/V; hidden states [sum P, d]."""
        dev = self.device
        lens = [len(p) for p in prompts]
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        batch = llama.PagedBatch(
            k_cache=kv.k, v_cache=kv.v, k_scale=kv.k_scale, v_scale=kv.v_scale, block_tables=kv.block_table(seqs),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            slot_mapping=torch.cat(prompt_slots).to(dev), decode=False, causal=False, cu_seqlens_q=cu.to(dev), max_seqlen_q=max(lens),
            impl=self.impl,
        )
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)
        positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
        return self.model.hidden_paged(tokens, positions, batch)

    def _propose_lengths(self, hidden, lens, N) -> torch.Tensor:
        """[B, beam] the most likely canvas lengths in 1..min(max_predicted_length, N), best first."""
        cap = min(self.config.max_predicted_length, N)
        if self.length_beam > cap:
            raise UsageError(f"length_beam {self.length_beam} is more than the {cap} lengths the head can propose within {N} new tokens")
        owner = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(self.device)
        logits = self.model.length_logits(hidden, owner, len(lens))[:, 1 : cap + 1]
        return logits.topk(self.length_beam, dim=-1).indices.cpu() + 1

    def _plans(self, state: CanvasState) -> tuple[PassPlan, PassPlan]:
        """The packed forwards of the current block: its first pass (which also computes the finished
        block's K/V when the prefix is cached) and its later passes."""
        first = self._plan(state, commit=self.prefix_cache and state.block > 0)
        return first, (self._plan(state, commit=False) if self.prefix_cache and state.block > 0 else first)

    def _plan(self, state: CanvasState, *, commit: bool) -> PassPlan:
        k, W = state.block, state.width
        stride, Pmax = state.seq.shape[1], state.seq.shape[1] - state.confidence.shape[1]
        gather, positions, slots, rows, q_lens, seq_lens, logit_index, dense = [], [], [], [], [], [], [], []

        def segment(e, first, last, seen, canvas_from=None):
            """Query positions [first, last) of entry e attending to `seen` positions; canvas rows from `canvas_from`."""
            P = state.entry_prompt_lens[e]
            start = len(gather)
            for p in range(first, last):
                gather.append(e * stride + Pmax - P + p)
                if canvas_from is not None and canvas_from <= p - P < canvas_from + W:
                    logit_index.append(start + p - first)
                    dense.append(e * W + p - P - canvas_from)
            positions.extend(range(first, last))
            slots.append(state.slots[e][first:last])
            rows.append(e)
            q_lens.append(last - first)
            seq_lens.append(seen)

        for e, (P, L) in enumerate(zip(state.entry_prompt_lens, state.lengths)):
            end = P + min(L, (k + 1) * W)
            if not self.prefix_cache:
                segment(e, 0, P + L, P + L, canvas_from=k * W)
                continue
            if commit:
                segment(e, P + (k - 1) * W, P + k * W, P + k * W)
            segment(e, P + k * W, end, end, canvas_from=k * W)
        cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        batch = llama.PagedBatch(
            k_cache=state.kv.k, v_cache=state.kv.v, k_scale=state.kv.k_scale, v_scale=state.kv.v_scale,
            block_tables=state.block_tables[self._to_device(torch.tensor(rows))],
            seq_lens=self._to_device(torch.tensor(seq_lens, dtype=torch.int32)), slot_mapping=self._to_device(torch.cat(slots)),
            decode=False, causal=False, cu_seqlens_q=self._to_device(cu), max_seqlen_q=max(q_lens), impl=self.impl,
        )
        return PassPlan(
            gather=self._to_device(torch.tensor(gather)), positions=self._to_device(torch.tensor(positions)), batch=batch,
            logit_index=self._to_device(torch.tensor(logit_index)), dense=self._to_device(torch.tensor(dense)),
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        # Pinned memory makes the copy asynchronous, so entering a block does not wait for the GPU.
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _predict(self, logits: torch.Tensor, state: CanvasState) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [R] and their probabilities [R] from logits [R, V] (mask token excluded)."""
        logp = maskpredict.token_log_probs(logits, self.mask_token_id)
        tokens = sample(logp, state.sampling, state.generator, impl=self.impl)
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).exp()

    def _refine(self, state: CanvasState, plan: PassPlan):
        """One refinement pass of the current block on the device alone (what a CUDA graph captures):
        the forward, the prediction, the rule's update of the block's tokens and confidences in place,
        and the pass counter `t`. Returns (tokens [E, W], committed [E] int32, logits [R, V],
        still_masked [E, W])."""
        k, W, T, E = state.block, state.width, state.iterations, len(state.seqs)
        tokens = state.seq.view(-1)[plan.gather]
        logits = self.model.forward_paged(tokens, plan.positions, plan.batch, plan.logit_index)
        pred, conf = self._predict(logits, state)
        # [E, W] views of the current block
        block = state.canvas[:, k * W : (k + 1) * W]
        block_conf = state.confidence[:, k * W : (k + 1) * W]
        active = state.active[:, k * W : (k + 1) * W]
        pred_d = torch.full((E * W,), self.mask_token_id, dtype=torch.int64, device=self.device)
        pred_d[plan.dense] = pred
        pred_d = pred_d.view(E, W)
        conf_d = torch.zeros(E * W, device=self.device)
        conf_d[plan.dense] = conf
        conf_d = conf_d.view(E, W)
        masked = (block == self.mask_token_id) & active
        L, t = state.block_lengths, state.t
        if self.rule == "mask-predict":
            new_tokens = torch.where(masked, pred_d, block)
            new_conf = torch.where(masked, conf_d, block_conf)
            remask_count = L * (T - t - 1) // T
            low = _ranks(new_conf.masked_fill(~active, math.inf), descending=False)
            still_masked = active & (low < remask_count[:, None])
            new_tokens = new_tokens.masked_fill(still_masked, self.mask_token_id)
        else:
            high = _ranks(conf_d.masked_fill(~masked, -math.inf), descending=True)
            if self.threshold is not None:
                commit = masked & ((conf_d > self.threshold) | (high == 0))
            else:
                commit = masked & (high < (L * (t + 1) // T - L * t // T)[:, None])
            new_tokens = torch.where(commit, pred_d, block)
            new_conf = torch.where(commit, conf_d, block_conf)
            still_masked = masked & ~commit
        committed = (masked.sum(1) - still_masked.sum(1)).to(torch.int32)
        block.copy_(new_tokens)
        block_conf.copy_(new_conf)
        t.add_(1)
        return new_tokens, committed, logits, still_masked

    def _capture(self, state: CanvasState, plan: PassPlan):
        """Record one later pass of the current block (recording runs nothing: the state is not advanced)."""
        return record_graph(self.device, state.generator, lambda: self._refine(state, plan))

    @torch.inference_mode()
    def step(self, state: CanvasState) -> StepOut:
        """One refinement pass. With CUDA graphs on, a block's second pass runs eagerly and is then
        captured, when at least two passes of the block are left to replay it; the graph is dropped
        when the block ends (the next block's views and plans differ)."""
        k, W, T = state.block, state.width, state.iterations
        if state.plans is None:
            state.plans = self._plans(state)
            state.block_lengths = state.active[:, k * W : (k + 1) * W].sum(1)
        if state.graph is not None:
            state.graph.replay()
            new_tokens, committed, logits, still_masked = state.graph_out
        else:
            plan = state.plans[0 if state.passes_in_block == 0 else 1]
            new_tokens, committed, logits, still_masked = self._refine(state, plan)
            if self.cuda_graphs and state.passes_in_block >= 1 and T - state.passes_in_block - 1 >= 2:
                state.graph, state.graph_out = self._capture(state, plan)
        state.passes_in_block += 1
        if self.threshold is not None:
            done = not bool(still_masked.any())
        else:
            done = state.passes_in_block == T
        if done:
            state.block += 1
            state.passes_in_block = 0
            state.plans = None
            state.graph, state.graph_out = None, None
            state.t.zero_()
        B = len(state.prompt_lens)
        return StepOut(tokens=new_tokens.reshape(B, state.beam * W), committed=committed.view(B, state.beam)[:, 0], logits=logits)

    def finished(self, state: CanvasState) -> bool:
        return state.block >= state.num_blocks

    def output(self, state: CanvasState, steps: list[StepOut]) -> list[list[int]]:
        """Each sequence's final tokens: the whole canvas (or the best length candidate) once finished;
        before that, the prefix no later pass can change."""
        canvas = state.canvas.tolist()
        B, beam = len(state.prompt_lens), state.beam
        if self.finished(state):
            if beam == 1:
                return canvas
            score = torch.where(state.active, state.confidence.log(), 0.0).sum(1) / torch.tensor(state.lengths, device=self.device)
            best = score.view(B, beam).argmax(1).tolist()
            return [canvas[b * beam + c][: state.lengths[b * beam + c]] for b, c in enumerate(best)]
        if beam > 1:
            return [[] for _ in range(B)]
        final = state.block * state.width
        out = []
        for row in canvas:
            n = final
            if self.rule == "low-confidence":
                # Committed tokens are never re-masked: the run of them after the finished blocks is final.
                while n < len(row) and row[n] != self.mask_token_id:
                    n += 1
            out.append(row[:n])
        return out

    def release(self, state: CanvasState) -> None:
        for s in state.seqs:
            state.kv.free(s)

    @torch.inference_mode()
    def loglikelihood(self, context_tokens, continuation_tokens, samples: int = 32, *, seed: int = 0, batch_size: int = 16,
                      bound: str | None = None) -> float:
        """Monte-Carlo estimate of a lower bound on log p(continuation | context) (LLaDA's estimator).

        Each sample draws l ~ U{1..L} (L = continuation length), masks l continuation positions chosen
        uniformly, and adds L/l times the log-probabilities of the true tokens there; the mean over
        samples is an unbiased estimate of the masked-diffusion ELBO, which is <= the log-likelihood.
        For a one-token continuation it is the exact log-probability (one forward suffices). `bound`
        (default the decoder's `score_bound`) chooses the attention: "prefix", the context does not
        see the continuation (the model as prefix-cached decoding runs it); "bidirectional", it does.
        The continuation ends the sequence, as the canvas does when decoding.
        """
        bound = bound or self.score_bound
        if bound not in BOUNDS:
            raise UsageError(f"unknown bound {bound!r} (known: {', '.join(BOUNDS)})")
        context, cont = [int(t) for t in context_tokens], [int(t) for t in continuation_tokens]
        if not cont:
            raise UsageError("the continuation to score is empty")
        _positive_int("samples", samples)
        P, L = len(context), len(cont)
        self.check_context(P + L)
        if L == 1:
            samples = 1
        gen = torch.Generator().manual_seed(seed)
        counts = torch.randint(1, L + 1, (samples,), generator=gen)
        order = torch.stack([torch.randperm(L, generator=gen) for _ in range(samples)])
        # [S, L] the positions each sample masks: the first l of a random order.
        masked = torch.empty_like(order, dtype=torch.bool).scatter_(1, order, torch.arange(L).expand(samples, L) < counts[:, None])
        target = torch.tensor(cont)
        noisy = torch.where(masked, self.mask_token_id, target)
        tokens = torch.cat([torch.tensor(context, dtype=torch.int64).expand(samples, P), noisy], dim=1).to(self.device)
        segments = (torch.arange(P + L) >= P).long().expand(samples, P + L).to(self.device) if bound == "prefix" else None
        total = 0.0
        for i in range(0, samples, batch_size):
            part = slice(i, i + batch_size)
            hidden = self.model.hidden(tokens[part], segments=None if segments is None else segments[part])
            logp = maskpredict.token_log_probs(self.model.head(hidden[:, P:]), self.mask_token_id)
            picked = logp.gather(-1, target.to(self.device).expand(logp.shape[0], L).unsqueeze(-1)).squeeze(-1).cpu()
            weight = L / counts[part].double()
            total += float(((picked.double() * masked[part]).sum(1) * weight).sum())
        return total / samples

    def memory(self, batch: int, ctx: int, *, new_tokens: int | None = None) -> Memory:
        """Bytes at context `ctx` (prompt + canvas); `new_tokens` is the canvas size N, of which one pass
        writes a block (default the block length, else the whole context, exact for prefix_cache=False)."""
        c = self.config
        kv_per_token = kv_token_bytes(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.kv_dtype)
        weights = self.weight_bytes()
        # A pass reads the embedding rows it needs, not the table (a tied table is read whole as the head); the length head only in prefill.
        embed = self.model.model.embed_tokens.weight
        length_head = getattr(self.model, "length_head", None)
        unread = (0 if c.tie_word_embeddings else embed.numel() * embed.element_size()) + (
            sum(p.numel() * p.element_size() for p in length_head.parameters()) if length_head is not None else 0)
        written = min(self.block_length or new_tokens or ctx, new_tokens or ctx)
        if not self.prefix_cache:
            written = ctx
        blocks = -(-ctx // self.page_size)
        return Memory(
            weight_bytes=weights,
            state_bytes=batch * blocks * self.page_size * kv_per_token,
            step_read_bytes=weights - unread + batch * ctx * kv_per_token,
            step_write_bytes=batch * written * kv_per_token,
        )
