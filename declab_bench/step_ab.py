"""A/B of launch-time switches in the graphed decode step, in one process (GPU only).

    python -m declab_bench.step_ab OUT.jsonl --model mamba2-1.3b --ctx 4k --batch 1,64 \
        --variant on: --variant off:DECLAB_PDL=0 --variant no_gemv_pdl:DECLAB_PDL_OFF=gemv

Each `--variant NAME:VAR=VALUE,...` sets those environment variables while its state is prefilled
and its step is run eagerly and captured into a CUDA graph (switches such as DECLAB_PDL and
DECLAB_PDL_OFF are read at launch, so the graph keeps them), then restores the environment. The
variants of one (model, context, batch) share the decoder, its weights and its per-shape GEMV
choices (made in the first variant's first step), so only the switch differs. Their graphs are then
replayed in interleaved rounds (`--rounds`, each `--steps` steps timed with CUDA events, median per
round), and each variant's greedy tokens are compared with the first variant's (`tokens_sha`; a
switch that changes no arithmetic must give the same tokens). One JSON line per (variant, round),
with the environment of the run, appended as it is measured.
"""

import argparse
import hashlib
import os
import statistics
import sys
from contextlib import contextmanager

import torch

import decoders
from decoders.base import Timer
from decoders.compare import parse_ctx, parse_ints
from decoders.records import append_jsonl, environment


def parse_variant(text: str) -> tuple[str, dict]:
    name, sep, settings = text.partition(":")
    if not sep or not name:
        raise SystemExit(f"--variant wants NAME:VAR=VALUE,... (settings may be empty), got {text!r}")
    env = {}
    for item in filter(None, settings.split(",")):
        var, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {name}: {item!r} is not VAR=VALUE")
        env[var] = value
    return name, env


@contextmanager
def environ(settings: dict):
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--model", required=True)
    p.add_argument("--ctx", default="4k", help="contexts, as decoders.compare takes them")
    p.add_argument("--batch", default="1")
    p.add_argument("--variant", action="append", required=True, help="NAME:VAR=VALUE,... (repeatable; the first is the baseline)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--experiment", default="step_ab")
    a = p.parse_args(argv)
    variants = [parse_variant(v) for v in a.variant]
    if not torch.cuda.is_available():
        raise SystemExit("step_ab times CUDA graphs: it needs a GPU")
    decoder = decoders.load(a.model, device="cuda", impl="triton")
    new_tokens = a.rounds * a.steps + 2
    for ctx in parse_ctx(a.ctx):
        for batch in parse_ints(a.batch, "--batch"):
            prompts = torch.randint(0, decoder.vocab_size, (batch, ctx - new_tokens), generator=torch.Generator().manual_seed(0))
            states, tokens = {}, {}
            for name, env in variants:
                with environ(env):
                    state = decoder.prefill(prompts, max_new_tokens=new_tokens)
                    decoder.step(state)  # eager, then captured under this variant's switches
                states[name], tokens[name] = state, []
            for r in range(a.rounds):
                for name, env in variants:
                    state, timer = states[name], Timer(decoder.device)
                    timer.mark()
                    for _ in range(a.steps):
                        tokens[name].append(decoder.step(state).tokens.clone())
                        timer.mark()
                    step_us = statistics.median(timer.intervals()) * 1e6
                    sha = hashlib.sha1(torch.cat(tokens[name], 1).cpu().numpy().tobytes()).hexdigest()[:12]
                    record = {"kind": "step_ab", "experiment": a.experiment, "model": a.model, "ctx": ctx, "batch": batch,
                              "variant": name, "variant_env": env, "round": r, "steps": a.steps, "step_us": step_us,
                              "tokens_sha": sha, **environment(decoder.device)}
                    append_jsonl(a.out, record)
                    print(f"{a.model} ctx {ctx} batch {batch} round {r} {name:>20}: {step_us:8.1f} us  tokens {sha}", flush=True)
            base = variants[0][0]
            different = [n for n, _ in variants if not torch.equal(torch.cat(tokens[n], 1), torch.cat(tokens[base], 1))]
            if different:
                print(f"tokens differ from {base}: {', '.join(different)}", flush=True)
            for state in states.values():
                decoder.release(state)
            del states
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
