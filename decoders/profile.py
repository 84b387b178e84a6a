"""`python -m decoders.profile`: where one decode step's time goes, kernel by kernel.

    python -m decoders.profile --model llama-1b --ctx 4k
    python -m decoders.profile --model mamba2-1.3b --ctx 4k --batch 16 --out runs/profile.jsonl

Prefills a random prompt, takes the first decode step (eager; with CUDA graphs it also captures the
graph), times `--steps` steps with the same timer as the harness, then records `--steps` more under
the PyTorch profiler and sums the device time of each kernel (on the CPU: the self time of each
operator). The table lists kernels by time per step; the summary splits the step into time spent in
kernels and time between them (launch gaps, host work), beside the roofline of the same step. With
programmatic dependent launch on (`declab_kernels.pdl`, the default on Hopper) kernels overlap and each
one's time includes its wait for the one before: the second table, the critical path, charges each
kernel only what it added to the step (its end minus the end of the kernel that ended before it;
the charges add up to the step), and DECLAB_PDL=0 gives a breakdown without the overlap.
The record also lists `gemv_choices` (`declab_kernels.gemv.choices()`): what `gemv.linear` picked for
each projection's key (shape, dtype, fusions, weight format: cuBLAS or the unfused form, or a Triton
configuration with the fusions inside) and every candidate's time, so the GEMV rows of the table can be
read with their choice.
The record is appended to `--out` (default runs/profile.jsonl); options, model and output path are
checked before anything runs, and bad input is one line on stderr and exit code 2.
"""

import json
import os
import statistics
import sys
import tempfile

import torch
from torch.autograd import DeviceType

import decoders
from decoders.base import Timer
from decoders.compare import parse_size
from decoders.harness import ceilings, pin_cpu_threads
from declab_kernels import gemv
from decoders.records import environment
from decoders.cli import JsonlSink, Parser, check_records_file


def kernel_times(prof, on_gpu: bool) -> list[tuple[str, int, float]]:
    """(name, calls, total µs) of every kernel (GPU) or operator (CPU, self time) in a profile."""
    rows = []
    for e in prof.key_averages():
        if on_gpu:
            if e.device_type != DeviceType.CUDA:
                continue
            total = e.self_device_time_total
        else:
            total = e.self_cpu_time_total
        if total > 0:
            rows.append((e.key, e.count, float(total)))
    return sorted(rows, key=lambda r: -r[2])


def kernel_spans(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every GPU kernel in a profile, from its exported trace."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    return [(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
            if e.get("cat") == "kernel" and e.get("ph") == "X"]


def critical_path(spans: list[tuple[str, float, float]], steps: int) -> list[dict]:
    """Per kernel name, the µs a step by which its kernels moved the last kernel end forward.

    Kernels are taken in the order they end; each is charged its end minus the end of the kernel
    that ended before it. The charges add up to the span of the steps, so unlike kernel durations
    they stay a breakdown of the step when kernels overlap (programmatic dependent launch): a kernel
    that ran in another's shadow is charged only what it added after it.
    """
    rows: dict[str, list] = {}
    last = None
    for name, _, end in sorted(spans, key=lambda s: s[2]):
        row = rows.setdefault(name, [0, 0.0])
        row[0] += 1
        row[1] += end - last if last is not None else 0.0
        last = end
    out = [{"name": n, "calls_per_step": c / steps, "us_per_step": t / steps} for n, (c, t) in rows.items()]
    return sorted(out, key=lambda r: -r["us_per_step"])


def profile_step(decoder, *, ctx: int, batch: int, steps: int, seed: int = 0) -> dict:
    """Time and profile `steps` decode steps at context `ctx`; the record (without environment)."""
    if not isinstance(decoder, decoders.base.AutoregressiveDecoder):
        raise decoders.UsageError(f"{decoder.describe()['family']}: profile runs autoregressive decode steps only")
    new_tokens = 2 * steps + 1
    prompt_len = ctx - new_tokens
    if prompt_len < 1:
        raise decoders.UsageError(f"context {ctx} leaves no prompt for {new_tokens} decode steps")
    decoder.check_context(ctx)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, decoder.vocab_size, (batch, prompt_len), generator=g)
    on_gpu = decoder.device.type == "cuda"
    state = decoder.prefill(prompts, max_new_tokens=new_tokens)
    decoder.step(state)  # eager, compiles, captures the graph when CUDA graphs are on
    timer = Timer(decoder.device)
    timer.mark()
    for _ in range(steps):
        decoder.step(state)
        timer.mark()
    step_ms = statistics.median(timer.intervals()) * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            decoder.step(state)
        if on_gpu:
            torch.cuda.synchronize(decoder.device)
    decoder.release(state)
    path = critical_path(kernel_spans(prof), steps) if on_gpu else None
    rows = [{"name": name, "calls_per_step": calls / steps, "us_per_step": total / steps} for name, calls, total in kernel_times(prof, on_gpu)]
    # What `gemv.linear` picked per key ("torch": cuBLAS or the unfused form), with every candidate's time:
    # a step's GEMV kernels read with their choice.
    picks = gemv.choices()
    kernel_ms = sum(r["us_per_step"] for r in rows) / 1e3
    mem = decoder.memory(batch, ctx)
    return {
        "ctx": ctx,
        "batch": batch,
        "steps": steps,
        "step_ms": step_ms,
        "kernel_ms": kernel_ms,
        "gap_ms": step_ms - kernel_ms if on_gpu else None,
        "launches_per_step": sum(r["calls_per_step"] for r in rows) if on_gpu else None,
        "step_bytes": mem.step_bytes,
        "kernels": rows,
        "critical_path": path,
        "gemv_choices": picks,
    }


def table(record: dict, top: int) -> str:
    lines = [f"{'kernel' if record['gap_ms'] is not None else 'operator (self CPU time)':<72} {'calls':>6} {'us/step':>9} {'share':>6}"]
    for r in record["kernels"][:top]:
        share = r["us_per_step"] / 1e3 / record["step_ms"]
        lines.append(f"{r['name'][:72]:<72} {r['calls_per_step']:>6.1f} {r['us_per_step']:>9.1f} {share:>6.1%}")
    rest = record["kernels"][top:]
    if rest:
        lines.append(f"{f'({len(rest)} more)':<72} {sum(r['calls_per_step'] for r in rest):>6.1f} {sum(r['us_per_step'] for r in rest):>9.1f}")
    summary = f"step {record['step_ms']:.3f} ms, in kernels {record['kernel_ms']:.3f} ms"
    if record["gap_ms"] is not None:
        summary += f", between kernels {record['gap_ms']:.3f} ms, {record['launches_per_step']:.0f} launches"
    if record.get("roofline_ms") is not None:
        summary += f"; roofline {record['roofline_ms']:.3f} ms (MBU {record['mbu']:.2f})"
    if record.get("pdl") and record["gap_ms"] is not None:
        summary += ("\nPDL is on: kernels overlap (each one's time includes waiting for the one before), so the"
                    " shares add up to more than the step; the critical path below does not")
    lines.append(summary)
    if record.get("critical_path"):
        lines.append(f"\n{'critical path: kernel (charged its end minus the previous kernel end)':<72} {'calls':>6} {'us/step':>9} {'share':>6}")
        for r in record["critical_path"][:top]:
            share = r["us_per_step"] / 1e3 / record["step_ms"]
            lines.append(f"{r['name'][:72]:<72} {r['calls_per_step']:>6.1f} {r['us_per_step']:>9.1f} {share:>6.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = Parser(prog="python -m decoders.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="preset or checkpoint folder")
    p.add_argument("--ctx", default="4k", help="context the step runs at (default 4k)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20, help="steps timed, then as many profiled (default 20)")
    p.add_argument("--impl", default="auto", choices=["auto", "triton", "ref"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--top", type=int, default=25, help="rows of the table (default 25)")
    p.add_argument("--out", default="runs/profile.jsonl", help="JSON lines file the record is appended to (default runs/profile.jsonl)")
    a = p.parse_args(argv)
    try:
        if a.batch < 1 or a.steps < 1:
            raise decoders.UsageError("--batch and --steps must be at least 1")
        if a.top < 1:
            raise decoders.UsageError(f"--top must be at least 1, got {a.top}")
        ctx = parse_size(a.ctx)
        sink = JsonlSink(check_records_file(a.out, "--out"))
        decoders.check_model(a.model, context=ctx)
        decoder = decoders.load(a.model, device=a.device, dtype=a.dtype, impl=a.impl)
        if decoder.device.type == "cpu":
            pin_cpu_threads()
        record = profile_step(decoder, ctx=ctx, batch=a.batch, steps=a.steps)
    except decoders.USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if decoder.device.type == "cuda":
        ceiling = ceilings(decoder.device)
        record["roofline_ms"] = record["step_bytes"] / ceiling["copy_bytes_per_s"] * 1e3
        record["mbu"] = record["roofline_ms"] / record["step_ms"]
        record["copy_bytes_per_s"] = ceiling["copy_bytes_per_s"]
    record = {"kind": "profile", **decoder.describe(), **record, **environment(decoder.device)}
    print(table(record, a.top))
    if decoder.device.type == "cpu":
        print(f"CPU: these times exercise the code path ({torch.get_num_threads()} thread(s)); they are not performance measurements")
    sink.append(record)
    print(f"record appended to {sink.where}", file=sys.stderr)
    summary = ("model", "impl", "dtype", "device", "ctx", "batch", "steps", "step_ms", "kernel_ms", "gap_ms", "launches_per_step", "roofline_ms", "mbu")
    print(json.dumps({"out": sink.where, **{k: record[k] for k in summary if record.get(k) is not None}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
