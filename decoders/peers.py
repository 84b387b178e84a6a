"""Peers: the libraries a user would run instead of the lab, measured in the same sweep, the same way.

    python -m decoders.compare --models llama-1b,mamba2-1.3b,rwkv7-1.5b --peers hf,gpt-fast,mamba_ssm,fla --gpt-fast CHECKOUT

Each peer runs the lab model's shape (its config dataclass, so presets and checkpoint folders alike)
with random weights of its own, on the same prompts, through `harness.measure`: the same warm-up,
the same TTFT (prompt in, first new token chosen), one timer mark per generated token (CUDA events,
a monotonic clock on the CPU) and the same record fields. Bytes and roofline come from the lab
decoder's `memory()` of the same shape. Rows, selected by the `--peers` name:

| --peers     | row            | family      | what runs                                                        |
|-------------|----------------|-------------|------------------------------------------------------------------|
| `hf`        | `hf-eager`     | transformer | transformers `LlamaForCausalLM.generate`, dynamic cache, eager   |
| `hf`        | `hf-compile`   | transformer | the same, sdpa, static cache; generate compiles its decode step (fullgraph, CUDA graphs) |
| `gpt-fast`  | `gpt-fast`     | transformer | a gpt-fast checkout's `Transformer`, its prefill and compiled `decode_one_token` |
| `hf`        | `hf-mamba2`    | mamba2      | transformers `Mamba2ForCausalLM.generate` (mamba-ssm kernels when importable) |
| `mamba_ssm` | `mamba_ssm-cg` | mamba2      | mamba-ssm `MambaLMHeadModel.generate(cg=True)` (CUDA graphs), causal-conv1d's CUDA kernels |
| `fla`       | `fla-rwkv7`    | rwkv7       | flash-linear-attention `RWKV7ForCausalLM` through HF `generate` (eager: the reference) |
| `fla`       | `fla-rwkv7-cg` | rwkv7       | the same model: prefill with its Cache, then its one-token forward replayed from a CUDA graph |

A peer that cannot be imported, needs a GPU it does not have, or would run without the kernels it is
meant to run (mamba-ssm without causal-conv1d's CUDA kernels) is `unavailable`; one selected for a
family it does not run is `not applicable`; both are recorded with the reason, never dropped. Every
measured row's record carries `peer_config`: what was compiled, CUDA graphs, the cache, the
attention and the kernels that ran, so a ratio against it can name the configuration.

The gpt-fast peer runs the upstream project's own code from the user's checkout (`--gpt-fast PATH`
or `DECLAB_GPT_FAST`); nothing of it is copied into the lab.
"""

import contextlib
import dataclasses
import importlib
import inspect
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from decoders.base import Decoder, Generation, Memory, Timer

# The --peers names, in the order rows are run.
PACKAGES = ("hf", "gpt-fast", "mamba_ssm", "fla")

# Where the gpt-fast checkout is found when compare's --gpt-fast does not name one.
GPT_FAST_ENV = "DECLAB_GPT_FAST"


@dataclass(frozen=True)
class Peer:
    name: str  # the row: hf-eager, mamba_ssm-cg, ...
    package: str  # the --peers name that selects it
    family: str  # the lab family whose shapes it runs
    module: str  # what must import for it to run
    cpu_reason: str | None  # why it does not run on the CPU, when it does not
    timing: str  # how the per-token marks are taken
    build: Callable  # (lab config, device, dtype) -> model
    run: Callable  # (model, prompts [B, P] on the device, new tokens, timer) -> output ids [B, P + new]
    settings: Callable  # (lab config, device) -> the record's peer_config: compiled, cuda_graphs, cache, attention, kernels


@dataclass(frozen=True)
class Absent:
    """A requested peer that yields no measurement for a model, and why."""

    name: str
    status: str  # "unavailable" | "not applicable"
    reason: str


HF_TIMING = "CUDA event (CPU: monotonic clock) at each call of a generate stopping criterion, once per new token"
# mamba-ssm's streamer receives each token on the host: one synchronisation per step, as HF generate has.
MAMBA_SSM_TIMING = "CUDA event at each call of mamba-ssm's generate streamer, once per new token"


def mark_each_token(timer: Timer, never: torch.Tensor):
    """A stopping criterion that marks `timer` and never stops: HF generate calls it once per new
    token, right after the token is chosen (the first call ends prefill)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class MarkEachToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            timer.mark()
            return never

    return StoppingCriteriaList([MarkEachToken()])


def hf_generate(model, prompts: torch.Tensor, new_tokens: int, timer: Timer) -> torch.Tensor:
    never = torch.zeros(prompts.shape[0], dtype=torch.bool, device=prompts.device)
    timer.mark()
    return model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        do_sample=False,
        stopping_criteria=mark_each_token(timer, never),
    )


def hf_generate_static(model, prompts: torch.Tensor, new_tokens: int, timer: Timer) -> torch.Tensor:
    # generate sizes a static cache to the longest any earlier call on this model asked for (to spare
    # a recompilation); each point gets a cache of its own length, as a fresh process would.
    model._previous_max_cache_length = prompts.shape[1] + new_tokens
    return hf_generate(model, prompts, new_tokens, timer)


def on_device(cls, config, device, dtype):
    """`cls(config)` initialised on `device` (random weights) and cast to `dtype`."""
    with torch.device(device):
        model = cls(config)
    return model.to(dtype).eval()


# What hf-compile asks of generate: transformers' own compiled decoding (mode "reduce-overhead": CUDA
# graphs), with the whole decode forward in one graph, and one static specialisation per cache length
# (a point's static cache differs in length from the last point's; dynamic=None would recompile it with
# symbolic shapes, which a fresh process never sees).
HF_COMPILE = dict(fullgraph=True, dynamic=False, mode="reduce-overhead")


def hf_llama(config, device, dtype, *, static: bool):
    from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

    # The lab's LlamaConfig fields are HF's names. No end-of-sequence token: every run decodes
    # exactly the tokens asked for, as the lab's generate does.
    hf = LlamaConfig(**{**dataclasses.asdict(config), "eos_token_id": None}, attn_implementation="sdpa")
    model = on_device(LlamaForCausalLM, hf, device, dtype)
    if static:
        # On an accelerator, generate compiles the decode forward whenever the cache is static.
        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = CompileConfig(**HF_COMPILE)
    return model


def hf_llama_settings(config, device, *, static: bool) -> dict:
    cuda = torch.device(device).type == "cuda"
    if not static:
        return {"compiled": None, "cuda_graphs": False, "cache": "DynamicCache", "attention": "sdpa", "kernels": "PyTorch eager"}
    compiled = ", ".join(f"{k}={v}" for k, v in HF_COMPILE.items())
    return {
        "compiled": f"decode forward: torch.compile {compiled} (generate's CompileConfig); prefill eager" if cuda else None,
        "cuda_graphs": cuda,
        "cache": "StaticCache sized to the point (prompt + new tokens)",
        "attention": "sdpa",
        "kernels": "Inductor-generated Triton, cuBLAS GEMMs, PyTorch's SDPA kernel" if cuda else "PyTorch eager",
    }


def gpt_fast_path() -> Path | None:
    """The gpt-fast checkout the peer runs from (compare's --gpt-fast sets the variable), or None."""
    value = os.environ.get(GPT_FAST_ENV)
    return Path(value) if value else None


def gpt_fast_problem(path: Path) -> str | None:
    """Why `path` is not a gpt-fast checkout the peer can run from, or None when it is."""
    if not path.is_dir():
        return f"gpt-fast checkout {str(path)!r} is not a folder"
    missing = [name for name in ("model.py", "generate.py") if not (path / name).is_file()]
    if missing:
        return f"gpt-fast checkout {str(path)!r} has no {' or '.join(missing)}"
    return None


def gpt_fast_args(config) -> dict:
    """gpt-fast `ModelArgs` fields for the lab's LlamaConfig (pure Python: no checkout needed).

    gpt-fast derives head_dim as dim // n_head and has no attention bias, so a shape it cannot
    express raises ValueError; Llama-3 rope scaling maps onto its `rope_scaling` dict.
    """
    c = config
    if c.attention_bias:
        raise ValueError("gpt-fast's attention has no bias; this model has attention_bias")
    if c.head_dim != c.hidden_size // c.num_attention_heads:
        raise ValueError(f"gpt-fast takes head_dim = dim // n_head = {c.hidden_size // c.num_attention_heads}; this model has {c.head_dim}")
    scaling = c.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"gpt-fast has no {kind!r} rope scaling (only Llama-3's)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return dict(
        block_size=c.max_position_embeddings, vocab_size=c.vocab_size, n_layer=c.num_hidden_layers, n_head=c.num_attention_heads,
        n_local_heads=c.num_key_value_heads, dim=c.hidden_size, intermediate_size=c.intermediate_size, rope_base=c.rope_theta,
        norm_eps=c.rms_norm_eps, rope_scaling={k: scaling[k] for k in keys} if kind == "llama3" else None,
    )


# gpt-fast's modules once imported: model, generate, its decode_one_token as written, and the Inductor
# and functorch flags its generate.py sets at import (applied around the peer's runs only).
GPT_FAST = {}


def config_changes(modules, before: dict) -> dict:
    """{(module, key): value} of the flags that differ from `before` (one get_config_copy() per module)."""
    return {(m, k): v for m in modules for k, v in m.get_config_copy().items() if before[m][k] != v}


def import_gpt_fast() -> dict:
    """gpt-fast's `model` and `generate` modules, imported from the checkout (sys.path), once.

    generate.py sets Inductor flags process-wide at import; they are undone here and applied around
    the gpt-fast runs only, so the other rows of a sweep compile as they would on their own. Its
    tokenizer module needs sentencepiece and tiktoken, which a run on token ids never calls: when they
    do not import, a stand-in `tokenizer` module lets generate.py import. Raises ImportError.
    """
    import importlib.machinery
    import types

    import torch._functorch.config
    import torch._inductor.config

    path = gpt_fast_path()
    if path is None:
        raise ImportError(f"no gpt-fast checkout: pass --gpt-fast PATH or set {GPT_FAST_ENV}")
    problem = gpt_fast_problem(path)
    if problem:
        raise ImportError(problem)
    path = path.resolve()
    if GPT_FAST:
        if GPT_FAST["path"] != path:
            raise ImportError(f"gpt-fast was imported from {GPT_FAST['path']} in this process, not {path}")
        return GPT_FAST
    for name in ("model", "generate", "tokenizer"):
        found = getattr(sys.modules.get(name), "__file__", None)
        if found is not None and Path(found).resolve().parent != path:
            raise ImportError(f"a module named {name!r} from {found} is already imported; gpt-fast's {name}.py would clash with it")
    sys.path.insert(0, str(path))
    if "tokenizer" not in sys.modules:
        try:
            importlib.import_module("tokenizer")
        except ImportError:
            stand_in = types.ModuleType("tokenizer")
            stand_in.__spec__ = importlib.machinery.ModuleSpec("tokenizer", None)

            def get_tokenizer(*args, **kwargs):
                raise RuntimeError("the lab runs gpt-fast on token ids; its tokenizer needs sentencepiece and tiktoken")

            stand_in.get_tokenizer = get_tokenizer
            sys.modules["tokenizer"] = stand_in
    flags = (torch._inductor.config, torch._functorch.config)
    before = {m: m.get_config_copy() for m in flags}
    model = importlib.import_module("model")
    generate = importlib.import_module("generate")
    changes = config_changes(flags, before)
    for module, key in changes:
        setattr(module, key, before[module][key])
    GPT_FAST.update(path=path, model=model, generate=generate, decode_one_token=generate.decode_one_token, flags=changes)
    return GPT_FAST


@contextlib.contextmanager
def gpt_fast_flags():
    """generate.py's Inductor / functorch flags, set for the duration (compilation happens inside)."""
    flags = GPT_FAST["flags"]
    saved = {(m, k): getattr(m, k) for m, k in flags}
    for (m, k), v in flags.items():
        setattr(m, k, v)
    try:
        yield
    finally:
        for (m, k), v in saved.items():
            setattr(m, k, v)


# generate.py's main() defaults to sampling (temperature 0.8, top-k 200); the lab decodes greedily, so
# the peer asks gpt-fast's own sample() for temperature 0 and no top-k (its argmax, up to ties).
GPT_FAST_SAMPLING = dict(temperature=0.0, top_k=None)


def gpt_fast_model(config, device, dtype):
    """gpt-fast's `Transformer` of the lab's shape, random weights in `dtype`; on a GPU its
    decode_one_token compiled the way its generate.py main() compiles it."""
    gf = import_gpt_fast()
    args = gpt_fast_args(config)
    fields = gf["model"].ModelArgs.__dataclass_fields__
    if "rope_scaling" not in fields:
        args.pop("rope_scaling")
    with torch.device(device):
        model = gf["model"].Transformer(gf["model"].ModelArgs(**args))
    if config.tie_word_embeddings:
        # The lab's checkpoint ties the output head to the embedding (the same bytes read per step either way).
        model.output.weight = model.tok_embeddings.weight
    model = model.to(dtype).eval()
    decode = gf["decode_one_token"]
    if torch.device(device).type == "cuda":
        # As generate.py's main() with --compile. dynamic=False: each point's cache length is compiled
        # as a fresh process would see it (its only shape), not re-traced with symbolic shapes.
        decode = torch.compile(decode, mode="reduce-overhead", fullgraph=True, dynamic=False)
    gf["generate"].decode_one_token = decode
    return model


def gpt_fast_generate(model, prompts: torch.Tensor, new_tokens: int, timer: Timer) -> torch.Tensor:
    """generate.py's generate() without speculation, on per-row prompts: setup_caches, prefill,
    decode_n_tokens (its callback marks each new token)."""
    gf = GPT_FAST
    batch, prompt_len = prompts.shape
    device = prompts.device
    length = gf["model"].find_multiple(prompt_len + new_tokens, 8)
    if (model.max_batch_size, model.max_seq_length) != (batch, length):
        # setup_caches only ever grows the cache; each point gets one of its own length, as a fresh process would.
        model.max_batch_size = model.max_seq_length = -1
        with torch.device(device):
            model.setup_caches(max_batch_size=batch, max_seq_length=prompt_len + new_tokens)
    with gpt_fast_flags(), torch.no_grad(), warnings.catch_warnings():
        # decode_n_tokens' sdp_kernel context is deprecated in newer torch: one warning per step otherwise.
        warnings.filterwarnings("ignore", message=r".*sdp_kernel\(\)` is deprecated", category=FutureWarning)
        timer.mark()
        first = gf["generate"].prefill(model, prompts, torch.arange(0, prompt_len, device=device), **GPT_FAST_SAMPLING).clone()
        timer.mark()
        input_pos = torch.tensor([prompt_len], device=device, dtype=torch.int)
        rest, _ = gf["generate"].decode_n_tokens(
            model, first.view(batch, -1), input_pos, new_tokens - 1, callback=lambda token: timer.mark(), **GPT_FAST_SAMPLING
        )
    return torch.cat([prompts, first.view(batch, 1), *rest], dim=1)


def gpt_fast_rope(config, fields) -> str:
    """What the gpt-fast row's rope is against the lab config's (`fields`: the checkout's ModelArgs fields)."""
    try:
        scaling = gpt_fast_args(config)["rope_scaling"]
    except ValueError as e:
        # The build refuses such a shape (an error row); its record still says why.
        return f"not built: {e}"
    if scaling is None:
        return "none, as the lab's config"
    if "rope_scaling" in fields:
        return "llama3, as the lab's config"
    return "none: this checkout's ModelArgs has no rope_scaling (the lab's config scales; the step's cost is the same)"


def gpt_fast_settings(config, device) -> dict:
    cuda = torch.device(device).type == "cuda"
    gf = import_gpt_fast()
    flags = ", ".join(f"{k}={v}" for (_, k), v in sorted(gf["flags"].items(), key=lambda kv: kv[0][1]))
    rope = gpt_fast_rope(config, gf["model"].ModelArgs.__dataclass_fields__)
    return {
        "compiled": f"decode_one_token: torch.compile mode=reduce-overhead fullgraph=True dynamic=False; prefill eager; flags {flags}"
        if cuda else None,
        "cuda_graphs": cuda,
        "cache": "gpt-fast KVCache, static, setup_caches to the point (prompt + new tokens)",
        "attention": "F.scaled_dot_product_attention with a boolean mask; decode steps under decode_n_tokens' math-only sdp_kernel",
        "kernels": "Inductor-generated Triton (attention included) and cuBLAS GEMMs" if cuda else "PyTorch eager",
        "sampling": "sample(temperature=0, top_k=None)",
        "rope_scaling": rope,
    }


def import_mamba_ssm():
    """Import mamba-ssm for peer runs and cross-checks (never on the lab's own path).

    mamba-ssm built without its CUDA extension (MAMBA_SKIP_CUDA_BUILD=TRUE) still has its Triton
    kernels, but its package imports the Mamba-1 `selective_scan_cuda` module at load; a stand-in
    module lets that import succeed, and calling anything that needs the extension still fails.
    Raises ImportError when mamba-ssm is not installed.
    """
    import importlib.machinery
    import importlib.util
    import types

    if importlib.util.find_spec("mamba_ssm") is None:
        raise ImportError("mamba-ssm is not installed (pip install -e '.[peers]', see the README)")
    if "selective_scan_cuda" not in sys.modules and importlib.util.find_spec("selective_scan_cuda") is None:
        stand_in = types.ModuleType("selective_scan_cuda")
        # Importers that look the module up again (find_spec) need a spec on it.
        stand_in.__spec__ = importlib.machinery.ModuleSpec("selective_scan_cuda", None)
        sys.modules["selective_scan_cuda"] = stand_in
    import mamba_ssm

    return mamba_ssm


def hf_mamba2(config, device, dtype):
    if torch.device(device).type == "cuda":
        # transformers picks mamba-ssm's kernels when its modelling module is first imported and the
        # package imports; a build without the CUDA extension needs the stand-in to import.
        try:
            import_mamba_ssm()
        except ImportError:
            pass
    from transformers import Mamba2Config, Mamba2ForCausalLM

    c = config
    hf = Mamba2Config(
        vocab_size=c.vocab_size, hidden_size=c.d_model, num_hidden_layers=c.n_layer, state_size=c.d_state,
        conv_kernel=c.d_conv, expand=c.expand, head_dim=c.headdim, num_heads=c.nheads, n_groups=c.ngroups,
        chunk_size=c.chunk_size, use_conv_bias=c.conv_bias, use_bias=c.bias, layer_norm_epsilon=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings, time_step_limit=c.dt_limit, bos_token_id=c.bos_token_id, eos_token_id=None,
    )
    return on_device(Mamba2ForCausalLM, hf, device, dtype)


def mamba_ssm_model(config, device, dtype):
    import_mamba_ssm()
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    c = config
    ssm_cfg = dict(
        layer="Mamba2", d_state=c.d_state, d_conv=c.d_conv, expand=c.expand, headdim=c.headdim, ngroups=c.ngroups,
        chunk_size=c.chunk_size, bias=c.bias, conv_bias=c.conv_bias, dt_limit=c.dt_limit,
    )
    # pad_vocab_size_multiple=1: the lab's vocab_size is already the padded table.
    ms = MambaConfig(d_model=c.d_model, n_layer=c.n_layer, vocab_size=c.vocab_size, ssm_cfg=ssm_cfg, pad_vocab_size_multiple=1, tie_embeddings=c.tie_embeddings)
    # Built in `dtype` directly: mamba-ssm keeps A_log, D and dt_bias in float32 that way.
    return MambaLMHeadModel(ms, device=device, dtype=dtype).eval()


class MarkEachPut:
    """A mamba-ssm streamer that marks `timer` at each `put`: once with the prompt before prefill,
    then once per new token (after mamba-ssm copies it to the host)."""

    def __init__(self, timer: Timer):
        self.timer = timer

    def put(self, value):
        self.timer.mark()

    def end(self):
        pass


def mamba_ssm_generate(model, prompts: torch.Tensor, new_tokens: int, timer: Timer) -> torch.Tensor:
    from mamba_ssm.utils.generation import decode

    if "streamer" not in inspect.signature(decode).parameters:
        raise RuntimeError("this mamba-ssm's generate takes no streamer: no per-token marks (mamba-ssm >= 2.2 has one)")
    return model.generate(prompts, max_length=prompts.shape[1] + new_tokens, cg=True, streamer=MarkEachPut(timer))


def mamba_ssm_kernels() -> dict:
    """The kernels mamba-ssm's Mamba-2 layer calls in generate, as its module resolved them at import
    (None: that part would fall back to a PyTorch stand-in). Raises ImportError without mamba-ssm."""
    import_mamba_ssm()
    from mamba_ssm.modules import mamba2

    try:
        importlib.import_module("causal_conv1d_cuda")
        conv_cuda = True
    except (ImportError, OSError):
        conv_cuda = False
    conv = conv_cuda and mamba2.causal_conv1d_fn is not None and mamba2.causal_conv1d_update is not None
    return {
        "conv1d": "causal-conv1d CUDA: causal_conv1d_fn (prefill), causal_conv1d_update (decode)" if conv else None,
        "ssm_prefill": "mamba-ssm Triton SSD: mamba_chunk_scan_combined",
        "ssm_decode": "mamba-ssm Triton: selective_state_update" if mamba2.selective_state_update is not None else None,
    }


def mamba_ssm_kernel_reason() -> str | None:
    """Why mamba_ssm-cg would not run the kernels it is meant to (then the row is unavailable, not a
    slower stand-in), or None."""
    kernels = mamba_ssm_kernels()
    if kernels["conv1d"] is None:
        return "causal-conv1d's CUDA kernels do not import (causal_conv1d_cuda); mamba-ssm would run a PyTorch conv1d instead"
    if kernels["ssm_decode"] is None:
        return "mamba-ssm's Triton selective_state_update does not import; its decode would run a PyTorch stand-in"
    return None


def mamba_ssm_settings(config, device) -> dict:
    return {
        "compiled": None,
        "cuda_graphs": True,
        "cache": "mamba-ssm InferenceParams: conv and SSM state per layer; one-token step captured per batch size and length",
        "attention": None,
        "kernels": mamba_ssm_kernels(),
    }


def fla_rwkv7(config, device, dtype):
    from fla.models import RWKV7Config, RWKV7ForCausalLM

    # The lab's RWKV7Config fields are fla's names.
    return on_device(RWKV7ForCausalLM, RWKV7Config(**{**dataclasses.asdict(config), "eos_token_id": None}), device, dtype)


class FlaGraphStep:
    """One-token forward of an fla model with its Cache, replayed from a CUDA graph (run eagerly off
    the GPU, which is how the CPU tests exercise it).

    fla's Cache replaces each layer's state tensors at every forward; the step feeds the forward fixed
    tensors instead (the graph's inputs), copies the new states back into them and feeds the greedy
    token back as the next input, so one replay is one decode step with no host work. The states are
    of fixed size, so one capture per batch size serves every context."""

    def __init__(self, model, cache, batch: int, device: torch.device):
        self.model, self.cache = model, cache
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)  # [B, 1]
        self.states = [{k: v.clone() for k, v in layer.state.items() if isinstance(v, torch.Tensor)} for layer in cache.layers]
        self.graph = None
        if device.type == "cuda":
            self.capture()

    def body(self):
        for layer, static in zip(self.cache.layers, self.states):
            layer.state.update(static)
        logits = self.model(input_ids=self.token, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits  # [B, 1, V]
        for layer, static in zip(self.cache.layers, self.states):
            for key, tensor in static.items():
                tensor.copy_(layer.state[key])
        self.token.copy_(logits[:, -1].argmax(-1, keepdim=True))

    def capture(self):
        saved = [{k: v.clone() for k, v in static.items()} for static in self.states], self.token.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # Triton autotuning and first-call work must not happen inside the capture.
        with torch.cuda.stream(side):
            for _ in range(3):
                self.body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.body()
        self.load(*saved)

    def load(self, states: list[dict], token: torch.Tensor):
        """Decode on from these layer states and this token [B, 1] (copied into the step's inputs)."""
        for static, new in zip(self.states, states):
            for key, tensor in static.items():
                tensor.copy_(new[key])
        self.token.copy_(token)

    def step(self) -> torch.Tensor:
        """One decode step: the next token [B, 1], a copy."""
        if self.graph is None:
            self.body()
        else:
            self.graph.replay()
        return self.token.clone()


def fla_graph_generate(model, prompts: torch.Tensor, new_tokens: int, timer: Timer) -> torch.Tensor:
    """Prefill with fla's Cache (its chunk kernels), then greedy decode steps of `FlaGraphStep`, one
    timer mark per new token. The step is captured once per batch size (in the harness's warm-up)."""
    from fla.models.utils import Cache

    batch = prompts.shape[0]
    steps = model.__dict__.setdefault("declab_graph_steps", {})
    with torch.no_grad():
        timer.mark()
        cache = Cache()
        logits = model(input_ids=prompts, past_key_values=cache, use_cache=True, logits_to_keep=1).logits  # [B, 1, V]
        first = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        prefilled = [dict(layer.state) for layer in cache.layers]
        if batch not in steps:
            steps[batch] = FlaGraphStep(model, cache, batch, prompts.device)
        step = steps[batch]
        step.load(prefilled, first)
        timer.mark()
        tokens = [first]
        for _ in range(new_tokens - 1):
            tokens.append(step.step())
            timer.mark()
    return torch.cat([prompts, *tokens], dim=1)


def fla_graph_settings(config, device) -> dict:
    cuda = torch.device(device).type == "cuda"
    return {
        "compiled": None,
        "cuda_graphs": cuda,
        "cache": "fla Cache; decode on fixed state tensors (recurrent and token-shift state per layer), copied back each step",
        "attention": None,
        "kernels": "fla Triton: chunk_rwkv7 (prefill), fused_mul_recurrent_rwkv7 (decode step, one CUDA graph per batch size)",
    }


def fla_settings(config, device) -> dict:
    return {
        "compiled": None,
        "cuda_graphs": False,
        "cache": "fla Cache (recurrent and token-shift state per layer) through HF generate",
        "attention": None,
        "kernels": "fla Triton: chunk_rwkv7 (prefill), fused_mul_recurrent_rwkv7 (decode, one token under no_grad)",
    }


def hf_mamba2_settings(config, device) -> dict:
    return {
        "compiled": None,
        "cuda_graphs": False,
        "cache": "Mamba2 cache through HF generate",
        "attention": None,
        "kernels": "transformers' choice: mamba-ssm / causal-conv1d kernels when they import, else its PyTorch path",
    }



FLA_GRAPH_TIMING = "CUDA event after prefill and after each replay of the decode step's graph, once per new token"
GPT_FAST_TIMING = "CUDA event (CPU: monotonic clock) after prefill and at each call of decode_n_tokens' callback, once per new token"

PEERS = [
    Peer(name="hf-eager", package="hf", family="transformer", module="transformers", cpu_reason=None, timing=HF_TIMING,
         build=lambda c, d, t: hf_llama(c, d, t, static=False), run=hf_generate,
         settings=lambda c, d: hf_llama_settings(c, d, static=False)),
    Peer(name="hf-compile", package="hf", family="transformer", module="transformers",
         cpu_reason="transformers compiles generate's decode step on an accelerator only", timing=HF_TIMING,
         build=lambda c, d, t: hf_llama(c, d, t, static=True), run=hf_generate_static,
         settings=lambda c, d: hf_llama_settings(c, d, static=True)),
    Peer(name="gpt-fast", package="gpt-fast", family="transformer", module="gpt-fast", cpu_reason=None, timing=GPT_FAST_TIMING,
         build=gpt_fast_model, run=gpt_fast_generate, settings=gpt_fast_settings),
    Peer(name="hf-mamba2", package="hf", family="mamba2", module="transformers", cpu_reason=None, timing=HF_TIMING,
         build=hf_mamba2, run=hf_generate, settings=hf_mamba2_settings),
    Peer(name="mamba_ssm-cg", package="mamba_ssm", family="mamba2", module="mamba_ssm",
         cpu_reason="generate(cg=True) captures CUDA graphs", timing=MAMBA_SSM_TIMING,
         build=mamba_ssm_model, run=mamba_ssm_generate, settings=mamba_ssm_settings),
    Peer(name="fla-rwkv7", package="fla", family="rwkv7", module="fla",
         cpu_reason="fla's Triton kernels autotune on a GPU", timing=HF_TIMING,
         build=fla_rwkv7, run=hf_generate, settings=fla_settings),
    Peer(name="fla-rwkv7-cg", package="fla", family="rwkv7", module="fla",
         cpu_reason="fla's Triton kernels autotune on a GPU", timing=FLA_GRAPH_TIMING,
         build=fla_rwkv7, run=fla_graph_generate, settings=fla_graph_settings),
]

# What a peer needs beyond importing, checked on the device it runs on: None, or why it would not run as intended.
KERNEL_CHECKS = {"mamba_ssm-cg": lambda: mamba_ssm_kernel_reason()}


def rows(package: str, family: str) -> list[Peer]:
    """The rows `--peers package` runs for a model of `family` (empty: not applicable)."""
    return [p for p in PEERS if p.package == package and p.family == family]


def import_reason(module: str) -> str | None:
    """Why `module` cannot be imported, or None when it can."""
    try:
        if module == "mamba_ssm":
            import_mamba_ssm()
        elif module == "gpt-fast":
            import_gpt_fast()
        else:
            importlib.import_module(module)
    except Exception as e:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    return None


def plan(package: str, model: str, family: str, device: torch.device) -> list[Peer | Absent]:
    """The rows of `--peers package` for `model`: runnable peers, or why there is none."""
    found = rows(package, family)
    if not found:
        families = sorted({p.family for p in PEERS if p.package == package})
        return [Absent(package, "not applicable", f"{model} is {family}; {package} runs only {' and '.join(families)} models")]
    out = []
    for peer in found:
        reason = import_reason(peer.module)
        if reason is None and peer.cpu_reason and device.type != "cuda":
            reason = f"needs a CUDA device: {peer.cpu_reason}"
        if reason is None and peer.name in KERNEL_CHECKS:
            reason = KERNEL_CHECKS[peer.name]()
        out.append(peer if reason is None else Absent(peer.name, "unavailable", reason))
    return out


def gpt_fast_library() -> str:
    """'gpt-fast <commit>' when the checkout the peer imported is a git repository of its own, else
    'gpt-fast (checkout without git)'."""
    import subprocess

    path = GPT_FAST["path"]
    try:
        done = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "gpt-fast (checkout without git)"
    lines = done.stdout.split()
    # A folder inside another repository would answer with that repository's commit.
    if done.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != path:
        return "gpt-fast (checkout without git)"
    return f"gpt-fast {lines[1]}"


def version_of(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", None)
    except Exception:
        return None


def describe(peer: Peer | Absent, lab: Decoder | None, model: str, family: str) -> dict:
    """What a result record says about a peer row (`model` is the lab's preset or folder)."""
    record = {"family": family, "model": f"{peer.name}:{model}", "peer": peer.name, "preset": model}
    if isinstance(peer, Peer):
        settings = peer.settings(lab.config, lab.device)
        record.update(
            impl=None,
            library=gpt_fast_library() if peer.module == "gpt-fast" else f"{peer.module} {version_of(peer.module)}",
            dtype=str(lab.dtype).removeprefix("torch."),
            cuda_graphs=settings["cuda_graphs"],
            peer_config=settings,
            timing=peer.timing,
            config=lab.describe()["config"],
        )
    return record


def build(peer: Peer, lab: Decoder, seed: int = 0):
    """The peer's model of the lab decoder's shape, random weights, on its device and dtype."""
    torch.manual_seed(seed)
    return peer.build(lab.config, lab.device, lab.dtype)


class PeerDecoder:
    """A peer behind what `harness.measure` calls (`generate`, `memory`, `device`, `vocab_size`,
    `cuda_graphs`). The harness warms it up on the timed shape itself, which is what the peers whose
    step is compiled or captured for one length (static cache, mamba-ssm's graph cache) need."""

    # For the harness this means "the first timed step captures a graph and is set apart"; a peer
    # compiles and captures in its warm-up run, so every timed step counts.
    cuda_graphs = False

    def __init__(self, peer: Peer, model, lab: Decoder):
        self.peer, self.model, self.lab = peer, model, lab
        self.device = lab.device
        self.vocab_size = lab.vocab_size

    def memory(self, batch: int, ctx: int, *, new_tokens: int = 1) -> Memory:
        return self.lab.memory(batch, ctx, new_tokens=new_tokens)

    def generate(self, prompts, max_new_tokens: int) -> Generation:
        """One run of the peer's own generate (in its own grad mode) with a timer mark per new token."""
        prompts = torch.as_tensor(prompts).to(self.device)
        timer = Timer(self.device)
        out = self.peer.run(self.model, prompts, max_new_tokens, timer)
        times = timer.intervals()
        if len(times) != max_new_tokens:
            raise RuntimeError(f"{self.peer.name}: {len(times)} timer marks for {max_new_tokens} new tokens")
        return Generation(
            tokens=out[:, prompts.shape[1] :].tolist(),
            prompt_lens=[prompts.shape[1]] * prompts.shape[0],
            prefill_s=times[0],
            step_s=times[1:],
            committed=[1.0] * (len(times) - 1),
        )
