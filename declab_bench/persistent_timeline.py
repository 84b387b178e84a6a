"""Where the time of one persistent decode step goes (GPU only).

    python -m declab_bench.persistent_timeline --out OUT.jsonl [--model llama-1b] [--ctx 4k,32k,128k]
    python -m declab_bench.persistent_timeline --out OUT.jsonl --model mamba2-1.3b --ctx 4k
    python -m declab_bench.persistent_timeline --out OUT.jsonl --model rwkv7-1.5b --ctx 4k

For each context: a prompt of ctx - 1 random tokens is prefilled, the step is built a second time
over the same cache (a transformer's pages, a Mamba-2 or RWKV-7 model's states) with `timeline=True` (every item stamps `%globaltimer` as it starts, when its
wait is over and when it ends, with its SM), launched a few times, and the last launch is summarised
per stage: items, the span from the stage's first start to its last end, the summed wait (start to
wait over: weight loads in flight, then spinning) and the summed work (wait over to end), and the
median program's idle time at the end of the step. The step's span is the whole forward minus
the launch. `stalled` says whether a wait gave up (then the stamps show where). One JSON line per context is appended to --out as it finishes; a table is printed and
the last stdout line is one JSON document.
"""

import dataclasses
import json
import statistics
import sys

import torch

import decoders
from decoders.cli import JsonlSink, Parser, check_records_file, run_command
from decoders.compare import parse_ctx
from decoders.records import environment
from declab_kernels.persistent_step import schedule

LAUNCHES = 5


def summarise(rows: list[dict], programs: int) -> dict:
    """Per stage and for the whole step, from `PersistentStep.timeline()` rows."""
    stages = {}
    for name in schedule.STAGE_NAMES:
        mine = [r for r in rows if r["stage"] == name]
        if mine:
            stages[name] = {"items": len(mine), "span_us": (max(r["end_ns"] for r in mine) - min(r["start_ns"] for r in mine)) / 1e3,
                            "wait_us": sum(r["ready_ns"] - r["start_ns"] for r in mine) / 1e3,
                            "work_us": sum(r["end_ns"] - r["ready_ns"] for r in mine) / 1e3}
    span = max(r["end_ns"] for r in rows)
    ends = [max((r["end_ns"] for r in rows if r["program"] == p), default=0) for p in range(programs)]
    return {"step_span_us": span / 1e3, "idle_at_end_us_median": statistics.median(span - e for e in ends) / 1e3, "stages": stages}


def run(args) -> int:
    ctxs = parse_ctx(args.ctx)
    decoders.check_model(args.model, context=max(ctxs))
    sink = JsonlSink(check_records_file(args.out, "--out"))
    device = decoders.parse_device("cuda")
    dec = decoders.load(args.model, device=device, step="persistent", seed=args.seed)
    records = []
    g = torch.Generator().manual_seed(args.seed)
    for ctx in ctxs:
        prompt = torch.randint(0, dec.vocab_size, (1, ctx - 1), generator=g)
        state = dec.prefill(prompt, max_new_tokens=LAUNCHES + 1)
        step = dec.persistent_step(state.cache, timeline=True)
        # The positions do not advance: every launch writes the same K/V row (a Mamba-2 or RWKV-7 model's
        # states move on, at the same cost); the last launch is the one read.
        for _ in range(LAUNCHES):
            step(state.next_tokens, state.positions)
        torch.cuda.synchronize(device)
        record = {"kind": "persistent_timeline", "model": args.model, "ctx": ctx, "programs": step.programs, "stalled": step.stalled(),
                  "tiles": dataclasses.asdict(step.tiles), "num_splits": getattr(step.shape, "num_splits", None),
                  **summarise(step.timeline(), step.programs), **environment(device)}
        dec.release(state)
        sink.append(record)
        records.append(record)
        print(f"{args.model} ctx {ctx}: step {record['step_span_us']:.1f} us, median program idle at the end "
              f"{record['idle_at_end_us_median']:.1f} us, P {step.programs}")
        for name, s in record["stages"].items():
            print(f"  {name:5s} {s['items']:6d} items  span {s['span_us']:8.1f} us  wait {s['wait_us']:10.1f} us  work {s['work_us']:10.1f} us")
    print(json.dumps({"out": str(args.out), "points": [{k: r[k] for k in ("model", "ctx", "step_span_us", "programs")} for r in records]}))
    return 0


def build_parser():
    p = Parser(prog="python -m declab_bench.persistent_timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b", help="a llama, Mamba-2 or RWKV-7 preset or checkpoint folder (default llama-1b)")
    p.add_argument("--ctx", default="4k,32k,128k", help="contexts (default 4k,32k,128k)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON lines file, appended context by context")
    return p


def main(argv=None) -> int:
    return run_command(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
