"""Peers: the libraries a user would run instead of the lab, measured in the same sweep, the same way.

    python -m decoders.compare --models llama-1b,mamba2-1.3b,rwkv7-1.5b --peers hf,mamba_ssm,fla

Each peer runs the lab model's shape (its config dataclass, so presets and checkpoint folders alike)
with random weights of its own, on the same prompts, through `harness.measure`: the same warm-up,
the same TTFT (prompt in, first new token chosen), one timer mark per generated token (CUDA events,
a monotonic clock on the CPU) and the same record fields. Bytes and roofline come from the lab
decoder's `memory()` of the same shape. Rows, selected by the `--peers` name:

| --peers     | row            | family      | what runs                                                        |
|-------------|----------------|-------------|------------------------------------------------------------------|
| `hf`        | `hf-eager`     | transformer | transformers `LlamaForCausalLM.generate`, dynamic cache, eager   |
| `hf`        | `hf-compile`   | transformer | the same with a static cache; generate compiles its decode step  |
| `hf`        | `hf-mamba2`    | mamba2      | transformers `Mamba2ForCausalLM.generate` (mamba-ssm kernels when importable) |
| `mamba_ssm` | `mamba_ssm-cg` | mamba2      | mamba-ssm `MambaLMHeadModel.generate(cg=True)` (CUDA graphs)     |
| `fla`       | `fla-rwkv7`    | rwkv7       | flash-linear-attention `RWKV7ForCausalLM` through HF `generate`   |

A peer that cannot be imported or needs a GPU it does not have is `unavailable`; one selected for a
family it does not run is `not applicable`; both are recorded with the reason, never dropped.
"""

import dataclasses
import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from decoders.base import Decoder, Generation, Memory, Timer

# The --peers names, in the order rows are run.
PACKAGES = ("hf", "mamba_ssm", "fla")


@dataclass(frozen=True)
class Peer:
    name: str  # the row: hf-eager, mamba_ssm-cg, ...
    package: str  # the --peers name that selects it
    family: str  # the lab family whose shapes it runs
    module: str  # what must import for it to run
    cpu_reason: str | None  # why it does not run on the CPU, when it does not
    cuda_graphs: bool  # whether its decode steps replay CUDA graphs
    timing: str  # how the per-token marks are taken
    build: Callable  # (lab config, device, dtype) -> model
    run: Callable  # (model, prompts [B, P] on the device, new tokens, timer) -> output ids [B, P + new]


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


def hf_llama(config, device, dtype, *, static: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    # The lab's LlamaConfig fields are HF's names. No end-of-sequence token: every run decodes
    # exactly the tokens asked for, as the lab's generate does.
    model = on_device(LlamaForCausalLM, LlamaConfig(**{**dataclasses.asdict(config), "eos_token_id": None}), device, dtype)
    if static:
        # On an accelerator, generate compiles the decode forward (mode "reduce-overhead": CUDA
        # graphs) whenever the cache is static.
        model.generation_config.cache_implementation = "static"
    return model


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


def fla_rwkv7(config, device, dtype):
    from fla.models import RWKV7Config, RWKV7ForCausalLM

    # The lab's RWKV7Config fields are fla's names.
    return on_device(RWKV7ForCausalLM, RWKV7Config(**{**dataclasses.asdict(config), "eos_token_id": None}), device, dtype)


PEERS = [
    Peer(name="hf-eager", package="hf", family="transformer", module="transformers", cpu_reason=None, cuda_graphs=False,
         timing=HF_TIMING, build=lambda c, d, t: hf_llama(c, d, t, static=False), run=hf_generate),
    Peer(name="hf-compile", package="hf", family="transformer", module="transformers",
         cpu_reason="transformers compiles generate's decode step on an accelerator only", cuda_graphs=True,
         timing=HF_TIMING, build=lambda c, d, t: hf_llama(c, d, t, static=True), run=hf_generate_static),
    Peer(name="hf-mamba2", package="hf", family="mamba2", module="transformers", cpu_reason=None, cuda_graphs=False,
         timing=HF_TIMING, build=hf_mamba2, run=hf_generate),
    Peer(name="mamba_ssm-cg", package="mamba_ssm", family="mamba2", module="mamba_ssm",
         cpu_reason="generate(cg=True) captures CUDA graphs", cuda_graphs=True,
         timing=MAMBA_SSM_TIMING, build=mamba_ssm_model, run=mamba_ssm_generate),
    Peer(name="fla-rwkv7", package="fla", family="rwkv7", module="fla",
         cpu_reason="fla's Triton kernels autotune on a GPU", cuda_graphs=False,
         timing=HF_TIMING, build=fla_rwkv7, run=hf_generate),
]


def rows(package: str, family: str) -> list[Peer]:
    """The rows `--peers package` runs for a model of `family` (empty: not applicable)."""
    return [p for p in PEERS if p.package == package and p.family == family]


def import_reason(module: str) -> str | None:
    """Why `module` cannot be imported, or None when it can."""
    try:
        if module == "mamba_ssm":
            import_mamba_ssm()
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
        out.append(peer if reason is None else Absent(peer.name, "unavailable", reason))
    return out


def version_of(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", None)
    except Exception:
        return None


def describe(peer: Peer | Absent, lab: Decoder | None, model: str, family: str) -> dict:
    """What a result record says about a peer row (`model` is the lab's preset or folder)."""
    record = {"family": family, "model": f"{peer.name}:{model}", "peer": peer.name, "preset": model}
    if isinstance(peer, Peer):
        record.update(
            impl=None,
            library=f"{peer.module} {version_of(peer.module)}",
            dtype=str(lab.dtype).removeprefix("torch."),
            cuda_graphs=peer.cuda_graphs,
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
