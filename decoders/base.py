"""The shared decoder interface: every family implements `prefill`, `step`, `memory`; `generate` is
written once on top of them and records the timings the harness needs.

- `Decoder.logits(tokens [B, T]) -> [B, T, V]`: one parallel forward, for scoring.
- `Decoder.prefill(prompts, max_new_tokens=..., sampling=...) -> state`: consumes the prompts and
  picks each sequence's first new token.
- `Decoder.step(state) -> StepOut`: exactly one model forward; `StepOut.committed` [B] says how
  many tokens each sequence gained (1 for the autoregressive families, 0..n for a Mask-Predict pass).
- `Decoder.memory(batch, ctx) -> Memory`: weight bytes, state bytes, bytes one decode step moves.

`AutoregressiveDecoder` is the common body of the transformer, Mamba-2 and RWKV-7 families: a family
supplies a cache, a prefill forward and a decode forward; sampling and bookkeeping stay on the device
so that a step never synchronises with the host. `RecurrentDecoder` adds what the engine and speculative
decoding need of a family whose cache is state tensors (which tensors, a view of the first rows, a
chunk forward resumed from the state).
"""

import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path

import torch

from declab_arch import quant as quantization
from declab_arch import quant_linear
from declab_arch.checkpoint import load_tokenizer, read_json
from decoders.sampling import GREEDY, Sampling, sample


# The decode steps a family may offer (`step=`): "graphed" (every family) and "persistent" (the whole
# forward as one kernel, `declab_kernels.persistent_step`: the transformer, Mamba-2 and RWKV-7, batch 1).
STEPS = ("graphed", "persistent")


class UsageError(ValueError):
    """Input the lab refuses (context over the limit, bad option); the message is one line."""


@dataclass
class StepOut:
    tokens: torch.Tensor  # [B, k] tokens this pass produced (k = 1 autoregressive; the canvas for Mask-Predict)
    committed: torch.Tensor  # [B] int32 tokens each sequence gained in this pass
    # [B, V] autoregressive: logits of the position just fed; valid until the next step (a replayed
    # CUDA graph reuses the buffer)
    logits: torch.Tensor | None = None


@dataclass
class Memory:
    weight_bytes: int
    state_bytes: int  # KV cache or recurrent state for the whole batch at this context
    step_read_bytes: int  # weights + state read by one decode step
    step_write_bytes: int  # state written by one decode step

    @property
    def step_bytes(self) -> int:
        return self.step_read_bytes + self.step_write_bytes


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per sequence
    prompt_lens: list[int]
    prefill_s: float  # prompts consumed and first tokens chosen (time to first token)
    step_s: list[float] = field(default_factory=list)  # one entry per step (one forward each)
    committed: list[float] = field(default_factory=list)  # mean tokens committed per sequence, per step
    text: list[str] | None = None

    @property
    def passes(self) -> int:
        return len(self.step_s)


class Timer:
    """Elapsed seconds between marks: CUDA events on a GPU (no synchronisation until `read`), else a monotonic clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) * 1e-3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class Decoder(ABC):
    """One model behind the shared interface.

    A family's Decoder class is its record, declared once: `family` (its name, as results and
    `declab_family` in a saved config.json name it), `arch` (its `declab_arch` module, which provides
    `preset_config(values, source)`, `read_config(folder)`, `detects(hf_config)`, `load(folder) ->
    (config, model)`, `build(config, tensors, source, seed=)` and `save(model, folder)`), `presets`
    (the prefix of its preset names: `llama` for `llama-1b`) and `state_kind`, what decoding carries:
    "kv" (a paged KV cache, truncated on rollback), "recurrent" (fixed-size state tensors, snapshot
    and restored) or "canvas" (Mask-Predict's canvas). Consumers read these instead of the name.
    """

    family: str = ""
    arch = None
    presets: str = ""
    state_kind: str = ""
    # Linear layers (name suffixes) that quantisation leaves dense, holding their dequantised values.
    quant_dense: tuple = ()
    # The decode step's kind, as records name it: "graphed" (a kernel per operation, replayed as a CUDA
    # graph on a GPU) unless a family offers another (`step="persistent"`: the transformer's, Mamba-2's, RWKV-7's).
    step_kind: str = "graphed"

    def __init__(self, model, config, *, device, dtype, impl, source, tokenizer=None, max_context=None, cuda_graphs=None,
                 quant=None):
        self.model = model.to(device=device, dtype=dtype).eval()
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.impl = impl
        self.source = source
        self.tokenizer = tokenizer
        self.max_context = max_context
        # Decode steps replay a CUDA graph on the Triton path (the reference path synchronises).
        self.cuda_graphs = (self.device.type == "cuda" and impl == "triton") if cuda_graphs is None else cuda_graphs
        # The QuantSpec of the weights the model runs on (None: dense).
        self.quant = None
        if quant is not None:
            self.quantize(quant)

    def quantize(self, quant) -> None:
        """Run on quantised weights from now on: `quant` is a name quantised on the fly ("int8",
        "int4-rtn", "int4-rtn-gN"; round-to-nearest needs no calibration) or (spec, mapping) read
        from a quantised folder. The weight objects replace the dense weights, which are freed."""
        if isinstance(quant, str):
            spec = quantization.parse_quant(quant)
            if spec.method != "rtn" and spec.bits == 4:
                raise UsageError(f"{spec.name} is calibrated (GPTQ) and cannot be quantised on the fly: make a folder with "
                                 f"python -m eval.quantize MODEL --quant {spec.name} --calib CORPUS --out FOLDER and load it (or use int4-rtn)")
            mapping = quantization.quantize_model(self.model, spec.name, dtype=self.dtype)
        else:
            spec, mapping = quant
            mapping = {n: w.to(self.device, self.dtype) for n, w in mapping.items()}
        quant_linear.install(self.model, mapping, impl=self.impl, dense=self.quant_dense)
        self.quant = spec

    @classmethod
    def detects(cls, hf_config: dict) -> bool:
        """Whether a checkpoint's config.json is of this family's format."""
        return cls.arch.detects(hf_config)

    @classmethod
    def from_preset(cls, values: dict, name: str, *, seed: int = 0, **kwargs):
        """Random weights (from `seed`) of the preset `values`, named `name`."""
        config = cls.arch.preset_config(values, name)
        return cls(cls.arch.build(config, None, name, seed=seed), config, source=name, **kwargs)

    @classmethod
    def from_checkpoint(cls, folder: Path, **kwargs):
        """The checkpoint in `folder` with its tokenizer (where the folder has one); a quantised folder
        (`declab_arch.quant.read_checkpoint`) runs on its quantised weights."""
        if quantization.is_quantized(read_json(Path(folder) / "config.json")):
            spec, mapping, tensors = quantization.read_checkpoint(folder, dtype=kwargs["dtype"])
            config, model = cls.arch.load(folder, tensors)
            kwargs["quant"] = (spec, mapping)
        else:
            config, model = cls.arch.load(folder)
        return cls(model, config, source=str(folder), tokenizer=cls.load_tokenizer(folder), **kwargs)

    @classmethod
    def load_tokenizer(cls, folder: Path):
        return load_tokenizer(folder)

    def save(self, folder: Path) -> None:
        """Write the model as a checkpoint folder naming its family (loadable by `decoders.load(folder)`)."""
        if self.quant is not None:
            raise UsageError(f"{self.source} runs on {self.quant.name} weights: save quantised folders with python -m eval.quantize")
        self.arch.save(self.model, folder)

    def describe(self) -> dict:
        """What a result record says about this decoder."""
        config = asdict(self.config) if is_dataclass(self.config) else dict(self.config)
        return {
            "family": self.family,
            "model": self.source,
            "impl": self.impl,
            "dtype": str(self.dtype).removeprefix("torch."),
            "cuda_graphs": self.cuda_graphs,
            "step": self.step_kind,
            "quant": self.quant_record(),
            "config": config,
        }

    def quant_record(self) -> dict | None:
        """The weight quantisation a record names: quant name, method, bits, group size (None: dense weights)."""
        if self.quant is None:
            return None
        s = self.quant
        return {"name": s.name, "method": s.method, "bits": s.bits, "format": "int8" if s.bits == 8 else f"int4-g{s.group_size}",
                "group_size": s.group_size}

    @property
    def eos_token_id(self) -> int | None:
        eos = getattr(self.config, "eos_token_id", None)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = self.tokenizer.eos_token_id
        return eos[0] if isinstance(eos, list) else eos

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def weight_bytes(self) -> int:
        """Parameter bytes, each quantised layer at its packed size (codes, scales, zeros)."""
        return quant_linear.weight_bytes(self.model)

    @torch.inference_mode()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens, device=self.device)
        self.check_context(tokens.shape[-1])
        return self.model(tokens)

    def check_context(self, length: int) -> None:
        if self.max_context is not None and length > self.max_context:
            raise UsageError(f"context of {length} tokens is over {self.source}'s maximum of {self.max_context}")

    def encode_prompts(self, prompts) -> list[list[int]]:
        """Prompts as token lists: a [B, T] tensor, a list of token lists, or strings (with a tokenizer)."""
        if isinstance(prompts, torch.Tensor):
            return prompts.reshape(-1, prompts.shape[-1]).tolist()
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], str):
            if self.tokenizer is None:
                raise UsageError(f"{self.source} has no tokenizer: pass token ids, not strings")
            return [self.tokenizer.encode(p) for p in prompts]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UsageError("every prompt needs at least one token")
        return [list(map(int, p)) for p in prompts]

    @abstractmethod
    def prefill(self, prompts, *, max_new_tokens: int, sampling: Sampling = GREEDY):
        """Consume the prompts; returns the family's state, ready for `step`."""

    @abstractmethod
    def step(self, state) -> StepOut:
        """Exactly one model forward over `state`, updating it in place."""

    @abstractmethod
    def finished(self, state) -> bool:
        """Host-side: whether `generate` should stop stepping."""

    @abstractmethod
    def output(self, state, steps: list[StepOut]) -> list[list[int]]:
        """New tokens per sequence, from the state and the step outputs `generate` collected."""

    @abstractmethod
    def memory(self, batch: int, ctx: int, *, new_tokens: int = 1) -> Memory:
        """Bytes for `batch` sequences at context `ctx` (prompt + generated); `new_tokens` is how many
        tokens are being generated (Mask-Predict's canvas; the autoregressive families ignore it)."""

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens: int, sampling: Sampling = GREEDY, *, stop_at_eos: bool = False) -> Generation:
        """Prefill, then step until done; per-step times come from CUDA events (or a monotonic clock).

        With `stop_at_eos`, every sequence's output is cut after its first end-of-sequence token and
        stepping ends once all have one (one host synchronisation per step).
        """
        if max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompts = self.encode_prompts(prompts)
        timer = Timer(self.device)
        timer.mark()
        state = self.prefill(prompts, max_new_tokens=max_new_tokens, sampling=sampling)
        timer.mark()
        steps, committed = [], []
        eos = self.eos_token_id if stop_at_eos else None
        while not self.finished(state):
            out = self.step(state)
            timer.mark()
            steps.append(StepOut(out.tokens.clone(), out.committed.clone()))
            committed.append(out.committed)
            if eos is not None and all(eos in seq for seq in self.output(state, steps)):
                break
        times = timer.intervals()
        tokens = self.output(state, steps)
        if eos is not None:
            tokens = [seq[: seq.index(eos) + 1] if eos in seq else seq for seq in tokens]
        gen = Generation(
            tokens=tokens,
            prompt_lens=[len(p) for p in prompts],
            prefill_s=times[0],
            step_s=times[1:],
            committed=[c.float().mean().item() for c in committed],
        )
        if self.tokenizer is not None:
            gen.text = [self.tokenizer.decode(t) for t in tokens]
        self.release(state)
        return gen

    def release(self, state) -> None:
        """Give back what the state holds (KV blocks); the default holds nothing shared."""


@dataclass
class ARState:
    """Decode state of an autoregressive family: the family's cache plus the token to feed next."""

    cache: object
    next_tokens: torch.Tensor  # [B] int64, sampled but not yet fed
    positions: torch.Tensor  # [B] int64, position of next_tokens (= tokens already in the cache)
    first_tokens: torch.Tensor  # [B] tokens chosen by prefill
    first_logits: torch.Tensor  # [B, V] logits of each prompt's last position
    sampling: Sampling
    generator: torch.Generator | None
    steps_left: int
    prompt_lens: list[int]
    ones: torch.Tensor  # [B] int32, tokens committed per step
    graph: "torch.cuda.CUDAGraph | None" = None  # the captured step, replayed from the second step on
    graph_logits: torch.Tensor | None = None  # [B, V] the graph's static output


def record_graph(device, generator, run):
    """(graph, run()'s outputs, static) with run() recorded into a CUDA graph. Recording runs
    nothing, so state that run() updates is not advanced; `generator` (or None), used by run()'s
    sampling, is registered so that every replay draws fresh numbers."""
    graph = torch.cuda.CUDAGraph()
    if generator is not None:
        graph.register_generator_state(generator)
    torch.cuda.synchronize(device)
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


class AutoregressiveDecoder(Decoder):
    """prefill/step/generate for families that add one token per sequence per forward."""

    def new_cache(self, prompt_lens: list[int], max_len: int):
        """The family's cache for sequences of up to `max_len` tokens."""
        raise NotImplementedError

    def prefill_forward(self, cache, prompts: list[list[int]]) -> torch.Tensor:
        """Consume the prompts into the cache; logits [B, V] of each prompt's last token."""
        raise NotImplementedError

    def decode_forward(self, cache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed tokens [B] at positions [B]; logits [B, V]. Must not synchronise with the host."""
        raise NotImplementedError

    @torch.inference_mode()
    def prefill(self, prompts, *, max_new_tokens: int, sampling: Sampling = GREEDY) -> ARState:
        prompts = self.encode_prompts(prompts)
        lens = [len(p) for p in prompts]
        self.check_context(max(lens) + max_new_tokens)
        cache = self.new_cache(lens, max(lens) + max_new_tokens)
        logits = self.prefill_forward(cache, prompts)
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        first = sample(logits, sampling, generator, impl=self.impl)
        return ARState(
            cache=cache,
            next_tokens=first.clone(),
            positions=torch.tensor(lens, device=self.device, dtype=torch.int64),
            first_tokens=first,
            first_logits=logits,
            sampling=sampling,
            generator=generator,
            steps_left=max_new_tokens - 1,
            prompt_lens=lens,
            ones=torch.ones(len(lens), dtype=torch.int32, device=self.device),
        )

    def forward_and_sample(self, state: ARState) -> torch.Tensor:
        """One decode forward and on-device sampling, updating the state's buffers: what a graph captures."""
        logits = self.decode_forward(state.cache, state.next_tokens, state.positions)
        # Sampling (its argmax included, see declab_kernels/argmax) is launched without PDL and ends with the
        # kernel that writes the next tokens and advances the positions: the next step's kernels start
        # only after it (and everything before it) has finished, which the recurrent decoders rely on to
        # load each layer's state before its PDL wait (`state_ready`).
        sample(logits, state.sampling, state.generator, impl=self.impl, out=state.next_tokens, advance=state.positions)
        return logits

    @torch.inference_mode()
    def step(self, state: ARState) -> StepOut:
        """The first step runs eagerly (compiling and autotuning every kernel), then, with CUDA graphs
        on, the same step is captured once and later steps replay it."""
        if state.graph is not None:
            state.graph.replay()
            logits = state.graph_logits
        else:
            logits = self.forward_and_sample(state)
            if self.cuda_graphs and state.steps_left > 1:
                state.graph, state.graph_logits = self.capture(state)
        state.steps_left -= 1
        return StepOut(tokens=state.next_tokens.unsqueeze(1), committed=state.ones, logits=logits)

    def capture(self, state: ARState):
        """Record one step into a CUDA graph (recording runs nothing, so the state is not advanced)."""
        return record_graph(self.device, state.generator, lambda: self.forward_and_sample(state))

    def finished(self, state: ARState) -> bool:
        return state.steps_left <= 0

    def output(self, state: ARState, steps: list[StepOut]) -> list[list[int]]:
        return torch.cat([state.first_tokens.unsqueeze(1)] + [s.tokens for s in steps], dim=1).tolist()


class RecurrentDecoder(AutoregressiveDecoder):
    """An autoregressive family whose cache is fixed-size state tensors (Mamba-2, RWKV-7): what the
    engine's state runner and speculative decoding call, so neither names a family.

    A family declares `state_fields`, its cache's state tensors (dataclass fields) with the dimension
    that indexes the batch (`{"ssm": 1}` for ssm [L, B, ...]), and implements `chunk_forward`; with
    `new_cache` and `decode_forward` (an `AutoregressiveDecoder`'s) that is all they need.
    """

    state_fields: dict[str, int] = {}

    def state_tensors(self, cache) -> list[tuple[torch.Tensor, int]]:
        """The cache's state tensors with their batch dimension."""
        return [(getattr(cache, name), dim) for name, dim in self.state_fields.items()]

    def rows_view(self, cache, rows: int):
        """The cache's first `rows` sequences: its state tensors narrowed (same storage), other fields as they are."""
        return replace(cache, **{name: getattr(cache, name).narrow(dim, 0, rows) for name, dim in self.state_fields.items()})

    def chunk_forward(self, cache, tokens: torch.Tensor, positions: list[int], lengths: list[int], *,
                      rows: list[int] | None = None, logits: str = "last") -> torch.Tensor | None:
        """Continue sequences by a chunk each from the state the cache holds: row j of tokens [b, T]
        (right-padded) has lengths[j] >= 1 real tokens at positions[j].. and is cache row rows[j]
        (default: every row of the cache, in order). The state after the chunk replaces the state before it. Returns the
        logits of each row's last real token [b, V] (logits="last"), of every position [b, T, V]
        ("all"), or nothing ("none")."""
        raise NotImplementedError
