"""Where the batch-1 decode attention spends its time inside a graphed llama step (GPU only).

    python -m declab_bench.attention_timeline OUT.jsonl [--model llama-1b] [--ctx 4096,32768]

A copy of `declab_kernels/paged_attention/triton.py` is patched to read `%globaltimer` in every program at
six points (start, start again where the kernel waited on the previous one until it stopped using
PDL, after the seq_len load, after the K/V loop, after the split-K ticket, after the merge's store)
and store them per layer; the decoder's decode calls are routed to
that copy, a few steps run from the CUDA graph, and the stamps of the last replay are summarised
in ns from the first program's second stamp, as medians over layers 1.. (layer 0 follows the
embedding, not a GEMV). `prev_t5_to_t1` is the time from a layer's merge to the next layer's first
program: the GEMVs and norms in between. The patch asserts that it
applied, so a changed kernel fails here instead of giving no stamps. Results of one run are in
results/step_ab.jsonl (the records with `median_ns`).
"""

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

import decoders
import declab_kernels.paged_attention as pa
from decoders.base import Timer

SOURCE = Path(__file__).resolve().parent.parent / "declab_kernels" / "paged_attention" / "triton.py"
STAMP = ('tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [split], dtype=tl.int64, '
         'is_pure=False, pack=1)')
PHASES = ("t0_min", "t0_max", "t1_max", "t2_med", "t3_med", "t3_max", "t4_max", "t5", "prev_t5_to_t1")


def _replace(src, old, new):
    if src.count(old) != 1:
        raise SystemExit(f"the decode kernel changed: cannot place a stamp at {old.strip()[:60]!r}")
    return src.replace(old, new)


def patched_source():
    src = SOURCE.read_text()
    src = _replace(src, "    stride_cos=0, ROPE: tl.constexpr = False,\n):",
                   "    stride_cos=0, ROPE: tl.constexpr = False, probe_ptr=None, probe_layer=0,\n):")
    src = _replace(src, """):
    split = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
""", f"""):
    split = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    pidx = (b * tl.num_programs(1) + hk) * tl.num_programs(0) + split
    nprog = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    pbase = probe_ptr + probe_layer * 6 * nprog + pidx
    t0 = {STAMP}
    t1 = {STAMP}
    seq_len = tl.load(seq_lens_ptr + b)
    t2 = {STAMP} + seq_len.to(tl.int64) * 0
    tl.store(pbase, t0)
    tl.store(pbase + nprog, t1)
    tl.store(pbase + 2 * nprog, t2)
""")
    src = _replace(src, """        if n_valid == 1:
            # The only split""", f"""        t3 = {STAMP} + tl.sum(acc, axis=1).to(tl.int64) * 0
        tl.store(pbase + 3 * nprog, tl.max(t3, 0))
        if n_valid == 1:
            # The only split""")
    src = _replace(src, """            ticket = tl.atomic_add(cnt, 1, sem="acq_rel")
""", f"""            ticket = tl.atomic_add(cnt, 1, sem="acq_rel")
            tl.store(pbase + 4 * nprog, {STAMP} + ticket.to(tl.int64) * 0)
""")
    src = _replace(src, """                tl.store(red_ptrs, (red / den[:, None]).to(out_ptr.dtype.element_ty), mask=red_mask)
""", f"""                tl.store(red_ptrs, (red / den[:, None]).to(out_ptr.dtype.element_ty), mask=red_mask)
                tl.store(pbase + 5 * nprog, {STAMP} + tl.sum(tl.sum(red, 1), 0).to(tl.int64) * 0)
""")
    return _replace(src, "        **rope_args,\n    )", "        **rope_args, **PROBE_ARGS(),\n    )")


def load_probe(state):
    path = Path(tempfile.mkdtemp()) / "paged_attention_probe.py"
    path.write_text(patched_source())
    spec = importlib.util.spec_from_file_location("paged_attention_probe", path)
    mod = importlib.util.module_from_spec(spec)

    def probe_args():
        # One slot per layer: the eager step and the captured one each make 16 calls.
        args = dict(probe_ptr=state["buf"], probe_layer=state["calls"] % state["layers"])
        state["calls"] += 1
        return args

    mod.PROBE_ARGS = probe_args
    spec.loader.exec_module(mod)
    return mod


def timeline(model, ctx, out):
    state = {"calls": 0}
    probe = load_probe(state)
    pa._triton = lambda: probe
    dec = decoders.load(model, device="cuda", impl="triton")
    layers = dec.config.num_hidden_layers
    state.update(layers=layers, buf=torch.zeros(layers * 6 * 4096, dtype=torch.int64, device="cuda"))
    st = dec.prefill(torch.randint(0, dec.vocab_size, (1, ctx - 50)), max_new_tokens=40)
    for _ in range(3):  # eager (compiles), captured, replayed
        dec.step(st)
    timer = Timer(dec.device)
    timer.mark()
    for _ in range(10):
        dec.step(st)
        timer.mark()
    step_us = statistics.median(timer.intervals()) * 1e6
    nprog = st.cache.workspace.num_splits * dec.config.num_key_value_heads
    buf = state["buf"][: layers * 6 * nprog].view(layers, 6, nprog).cpu().double()
    rows = []
    for layer in range(layers):
        t0, t1, t2, t3, t4, t5 = buf[layer]
        base = t1.min()
        merged = t5[t5 > 0]
        row = dict(layer=layer, t0_min=float(t0.min() - base), t0_max=float(t0.max() - base),
                   t1_max=float(t1.max() - base), t2_med=float(t2.median() - base), t3_med=float(t3.median() - base),
                   t3_max=float(t3.max() - base), t4_max=float(t4.max() - base),
                   t5=float(merged.max() - base) if len(merged) else None)
        if layer:
            prev = buf[layer - 1][5]
            row["prev_t5_to_t1"] = float(t1.min() - prev[prev > 0].max())
        rows.append(row)
    median = {k: statistics.median([r[k] for r in rows[1:] if r.get(k) is not None]) for k in PHASES}
    rec = dict(model=model, ctx=ctx, step_us=step_us, splits=st.cache.workspace.num_splits, layers=rows,
               median_ns=median, sha=os.environ.get("DECLAB_GIT_SHA"), gpu=torch.cuda.get_device_name(),
               pdl=os.environ.get("DECLAB_PDL", "1") != "0")
    print(model, ctx, f"step {step_us:.1f} us", json.dumps(median), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")
    dec.release(st)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--ctx", default="4096,32768", help="comma-separated context lengths in tokens")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (the stamps are inline PTX)")
    for ctx in (int(c) for c in args.ctx.split(",")):
        timeline(args.model, ctx, args.out)


if __name__ == "__main__":
    main()
