"""The measuring harness: one point = (decoder, context, batch), measured the same way for every family.

For a point at context `ctx` the prompt has `ctx - new_tokens` tokens, so decoding runs at `ctx`.
Per point: time to first token (prefill), per-step decode latency p50/p90/p99, decode tokens/s per
sequence and aggregate (tokens committed per step, so Mask-Predict passes count what they commit),
prefill tokens/s, peak memory, state bytes, the largest batch whose state would fit at this context
(GPU only, by the memory model: `largest_batch`), the roofline step time (bytes one step must move over
the copy bandwidth measured in the same run) and MBU (roofline time / measured median step time).
Warm-up (compilation, autotuning: the timed generation once, untimed) runs before the timed
generation and is reported separately.

On the CPU (the reference path, or Triton's interpreter) the figures exercise the code path and are
not performance measurements: other processes share the cores and a step's time can swing many
times over between runs. `pin_cpu_threads` fixes the thread counts, and each point is timed
`CPU_REPEATS` times: the record is the run with the median decode rate, with every run's rate and
their spread ((max - min) / median), so the swing is in the record, not hidden in it.

`check_against_reference` is the correctness gate: a decoder whose kernels disagree with the
reference path after a short or a long prompt is not timed.
"""

import copy
import math
import os
import statistics
import time

import torch

from declab_arch import quant_linear
from decoders.base import Decoder
from declab_kernels import timing


# Timed generations of a point on the CPU (one on a GPU, where CUDA events time a quiet device).
CPU_REPEATS = 3


def pin_cpu_threads() -> int:
    """Fix the CPU thread counts for a run: half the cores this process may use, at least one
    (OMP_NUM_THREADS when the user set it), and one inter-op thread. Returns the intra-op count,
    which the records carry."""
    if "OMP_NUM_THREADS" in os.environ:
        threads = torch.get_num_threads()
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        # Half: the default (one thread per core) on a shared two-core machine made the tiny presets'
        # steps 10x slower and their repeats differ by up to 40x; one thread there ran at 1-1.5 ms
        # with repeats within 5-30%.
        threads = max(1, cores // 2)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        # Settable once, before any inter-op work: a second sweep in one process keeps the first's.
        pass
    return threads


# Memory bandwidth by the vendors' datasheets, bytes/s, by the device name CUDA reports (longest match
# first): the peak that published MBU figures are quoted against.
NOMINAL_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100": 1.555e12,
}


def nominal_bandwidth(device_name: str) -> float | None:
    """The datasheet memory bandwidth of a GPU named `device_name`, None for one not in the table."""
    for key in sorted(NOMINAL_BANDWIDTH, key=len, reverse=True):
        if key in device_name:
            return NOMINAL_BANDWIDTH[key]
    return None


def ceilings(device) -> dict:
    """Copy bandwidth and matmul rate of this device, measured now, beside its nominal bandwidth."""
    device = torch.device(device)
    nominal = nominal_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return {"copy_bytes_per_s": timing.copy_bandwidth(device), "matmul_flops": timing.matmul_flops(device),
            "nominal_bytes_per_s": nominal}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def with_impl(decoder: Decoder, impl: str, dtype: torch.dtype | None = None) -> Decoder:
    """The same decoder on another kernel implementation (weights shared), or with a copy of its
    weights in another dtype. CUDA graphs stay on only for the Triton path."""
    other = copy.copy(decoder)
    other.impl = impl
    other.cuda_graphs = decoder.cuda_graphs and impl == "triton"
    if dtype is not None and dtype != decoder.dtype:
        other.model = copy.deepcopy(decoder.model).to(dtype)
        other.dtype = dtype
    if decoder.quant is not None and impl != decoder.impl:
        # The quantised layers carry their impl (the module-called paths have no impl argument): a
        # copy of the model (packed weights, small) computes on the other one.
        if other.model is decoder.model:
            other.model = copy.deepcopy(decoder.model)
        quant_linear.set_impl(other.model, impl)
    return other


def relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def gate_logits(decoder: Decoder, prompt: torch.Tensor, forced: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Logits of prefill and a few teacher-forced steps (the same tokens fed to every implementation,
    so a near-tie cannot send two implementations down different paths); for a family without a
    next token to force (Mask-Predict), the first refinement pass."""
    state = decoder.prefill(prompt, max_new_tokens=new_tokens)
    forcing = hasattr(state, "next_tokens")
    logits = [state.first_logits] if forcing else []
    for i in range(forced.shape[1] if forcing else 1):
        if forcing:
            state.next_tokens.copy_(forced[:, i])
        # Copied now: a replayed CUDA graph writes every step's logits into the same buffer.
        logits.append(decoder.step(state).logits.float().clone())
    decoder.release(state)
    return torch.cat([t.float().reshape(-1) for t in logits])


def check_against_reference(decoder: Decoder, *, new_tokens: int, tokens: int = 48, long_tokens: int = 2048, seed: int = 0) -> dict:
    """The correctness gate: `decoder`'s logits against the reference path run in float32, after a
    prompt of `tokens` and after one of `long_tokens` (clipped to the decoder's context), so a kernel
    wrong only beyond the first few hundred positions is refused too.

    In float32 the kernels must agree with the reference to 1e-3 (relative RMS). In bf16/fp16 the
    reference path in the same dtype has rounding error of its own; the kernels pass when their error
    against the float32 reference is at most 1.5x the reference path's own (plus 1e-3), so a kernel
    bug cannot hide behind a loose fixed tolerance and random-weight rounding cannot fail a good one.
    `ok` needs every length to pass; rel_rms and tolerance are those of the length closest to failing,
    `lengths` has each one's.
    """
    if decoder.impl == "ref":
        return {"ok": True, "rel_rms": 0.0, "tolerance": 0.0}
    room = decoder.max_context - new_tokens if decoder.max_context else long_tokens
    lengths = sorted({tokens, max(tokens, min(long_tokens, room))})
    g = torch.Generator().manual_seed(seed)
    forced = torch.randint(0, decoder.vocab_size, (1, min(4, new_tokens - 1)), generator=g).to(decoder.device)
    checks = {}
    # One float32 copy of the weights serves every length.
    truth_decoder = with_impl(decoder, "ref", torch.float32)
    for length in lengths:
        prompt = torch.randint(0, decoder.vocab_size, (1, length), generator=g)
        with torch.inference_mode():
            ours = gate_logits(decoder, prompt, forced, new_tokens)
            truth = gate_logits(truth_decoder, prompt, forced, new_tokens)
            err = relative_rms(ours, truth)
            if decoder.dtype == torch.float32:
                tolerance = 1e-3
            else:
                tolerance = 1.5 * relative_rms(gate_logits(with_impl(decoder, "ref"), prompt, forced, new_tokens), truth) + 1e-3
        checks[length] = {"ok": err <= tolerance, "rel_rms": err, "tolerance": tolerance}
    del truth_decoder
    worst = max(checks.values(), key=lambda c: c["rel_rms"] / c["tolerance"])
    return {"ok": all(c["ok"] for c in checks.values()), "rel_rms": worst["rel_rms"], "tolerance": worst["tolerance"], "lengths": checks}


# Share of the free device memory a point's state (KV cache or recurrent state) may take; the rest is
# left to activations, workspaces and the allocator.
FIT_FRACTION = 0.9


def free_bytes(device) -> int:
    """Device memory a new allocation can have: free on the GPU plus what PyTorch's allocator holds
    unused (an earlier point's released cache)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def fits(decoder: Decoder, batch: int, ctx: int, new_tokens: int) -> str | None:
    """Why a point cannot fit in device memory, or None when it may."""
    if decoder.device.type != "cuda":
        return None
    need = decoder.memory(batch, ctx, new_tokens=new_tokens).state_bytes
    free = free_bytes(decoder.device)
    if need > FIT_FRACTION * free:
        return f"needs {need / 1e9:.1f} GB of state/KV, {free / 1e9:.1f} GB free"
    return None


def largest_batch(decoder: Decoder, ctx: int, new_tokens: int, free: int) -> int:
    """The largest batch whose state at `ctx` fits in `free` bytes by the rule of `fits` (the memory
    model's state bytes, so an fp8 KV cache counts its 1-byte rows and their exponents)."""
    per_sequence = decoder.memory(1, ctx, new_tokens=new_tokens).state_bytes
    return int(FIT_FRACTION * free // per_sequence)


def measure(decoder: Decoder, *, ctx: int, batch: int, new_tokens: int, ceiling: dict, seed: int = 0, repeats: int | None = None) -> dict:
    """Measure one point; returns the record (without environment fields). `repeats` timed
    generations (default: one on a GPU, CPU_REPEATS on the CPU); the record is the one with the
    median decode rate, beside every run's rate and their spread."""
    prompt_len = ctx - new_tokens
    if prompt_len < 1:
        raise ValueError(f"context {ctx} leaves no prompt for {new_tokens} new tokens")
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, decoder.vocab_size, (batch, prompt_len), generator=g)
    cuda = decoder.device.type == "cuda"
    # Before the point allocates anything: the largest batch whose state would fit beside the model.
    max_batch_fits = largest_batch(decoder, ctx, new_tokens, free_bytes(decoder.device)) if cuda else None

    t0 = time.perf_counter()
    # The timed generation once untimed: every kernel, including those specialised on the prompt's
    # length, is compiled and tuned here, so the TTFT below is not compilation (it was 1.4 s of
    # llama-1b's 4k TTFT when the warm-up used a short prompt).
    decoder.generate(prompts, max_new_tokens=new_tokens)
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(decoder.device)
    runs = []
    for _ in range(repeats or (1 if cuda else CPU_REPEATS)):
        gen = decoder.generate(prompts, max_new_tokens=new_tokens)
        steps = gen.step_s
        first_step_ms = None
        if decoder.cuda_graphs and len(steps) > 1:
            # The first step runs eagerly and captures the graph: reported apart, like the warm-up.
            first_step_ms, steps = steps[0] * 1e3, steps[1:]
        rate = statistics.fmean(gen.committed) / statistics.median(steps) if steps else 0.0
        runs.append((rate, gen, steps, first_step_ms))
    rates = [r[0] for r in runs]
    # The median run (the lower middle of an even count), so one disturbed run does not set the figure.
    _, gen, steps, first_step_ms = sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]

    mem = decoder.memory(batch, ctx, new_tokens=new_tokens)
    record = {
        "ctx": ctx,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "warmup_s": warmup_s,
        "ttft_ms": gen.prefill_s * 1e3,
        "prefill_tok_s": batch * prompt_len / gen.prefill_s,
        "passes": gen.passes,
        "first_step_ms": first_step_ms,
        "weight_bytes": mem.weight_bytes,
        "state_bytes": mem.state_bytes,
        "step_bytes": mem.step_bytes,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(decoder.device) if cuda else None,
        "max_batch_fits": max_batch_fits,
        "repeats": len(runs),
    }
    if len(runs) > 1 and steps:
        record["decode_tok_s_per_seq_runs"] = rates
        record["spread"] = (max(rates) - min(rates)) / statistics.median(rates)
    if steps:
        step_median = statistics.median(steps)
        tokens_per_pass = statistics.fmean(gen.committed)
        roofline_s = mem.step_bytes / ceiling["copy_bytes_per_s"]
        record.update(
            {
                "step_ms_p50": step_median * 1e3,
                "step_ms_p90": percentile(steps, 90) * 1e3,
                "step_ms_p99": percentile(steps, 99) * 1e3,
                "tokens_per_pass": tokens_per_pass,
                "decode_tok_s_per_seq": tokens_per_pass / step_median,
                "decode_tok_s": batch * tokens_per_pass / step_median,
                "roofline_ms": roofline_s * 1e3,
                "achieved_bytes_per_s": mem.step_bytes / step_median,
                "mbu": roofline_s / step_median,
                # Against the datasheet's peak, as published MBU figures are (None off the table).
                "mbu_nominal": mem.step_bytes / ceiling["nominal_bytes_per_s"] / step_median if ceiling.get("nominal_bytes_per_s") else None,
            }
        )
    return record
