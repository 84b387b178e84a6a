"""Offline sm_90 compile of the decode-step kernels with and without programmatic dependent launch.

    python -m declab_bench.pdl_check                  # no GPU needed; TRITON_INTERPRET must be unset
    python -m declab_bench.pdl_check --before DIR     # also compile the pre-PDL sources DIR/<folder>.py
    python -m declab_bench.pdl_check --order          # also each PDL kernel's global memory order in SASS
    python -m declab_bench.pdl_check --loop           # also each PDL kernel's main loop: SASS instructions by opcode

Every kernel that takes the `PDL` constexpr is compiled for `GPUTarget("cuda", 90, 32)` at a decode
shape (llama-1b / mamba2-1.3b / rwkv7-1.5b sizes, bf16), with PDL False and True, then assembled by
Triton's bundled ptxas. Per kernel: registers (ptxas -v) with and without PDL, whether the PTX holds
`griddepcontrol.launch_dependents` / `griddepcontrol.wait`, how many global loads come before the
wait in the PTX and in the SASS (for the GEMV: which of them are weight loads, the only ones marked
evict_first), and, with --before, whether the PDL=False PTX is the pre-PDL kernel's (`.loc` line
info stripped).

--order prints the PDL compile's global loads, stores, atomics and barriers in SASS order, runs
collapsed (`LDG x8 WAIT LDG x3 STG BAR x5 STG x7`). A load after a store or a barrier waits a memory
round trip of its own (the compiler moves no load above a store to another buffer, which might
alias, nor above a reduction's barrier): in a latency-bound decode kernel every activation load
should come before the first STG and BAR.

--loop prints the PDL compile's longest loop (the SASS from a backward branch's target to the branch):
its instruction count and opcode mix, the per-weight cost of a K loop once divided by the weights a
thread handles a trip. --ptx-version 8.8 rewrites the PTX's `.version` before ptxas, for a Triton
whose PTX is newer than the ptxas it ships (Triton 3.9's CPU wheel writes 9.x, its ptxas takes 8.8).
"""

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from decoders.cli import Parser


def _spec(label, folder, name, consts, options, ptrs=None, floats=(), unaligned=()):
    """One kernel to compile: pointers are *bf16 unless `ptrs` says otherwise, integer arguments are
    multiples of 16 (as Triton specialises them at these shapes) unless listed in `unaligned`."""
    return dict(label=label, folder=folder, name=name, consts=consts, options=options, ptrs=ptrs or {},
                floats=floats, unaligned=unaligned)


_GEMV_PTRS = {"part_ptr": "*fp32", "cnt_ptr": "*i32"}
_GEMV_1 = dict(M=1, G=1, stride_xg=0, stride_wg=0, stride_bg=0, stride_og=0, M_POW2=1, HAS_BIAS=False, DOT_PREC="tf32")
_RWKV = ("x", "delta", "weight", "bias", "prev", "mix", "out", "p0", "p1", "p2", "p3", "r", "k", "v", "u_v", "u_w",
         "u_a", "bias_w", "bias_a", "bias_v", "k_k", "k_a", "v_first", "o", "g", "r_k", "norm_w", "norm_b")
_RWKV_PTRS = dict.fromkeys(_RWKV, "*bf16")

# Decode shapes, batch 1, bf16: llama-1b (d 2048, 32/8 heads of 64, I 8192), mamba2-1.3b (d 2048,
# d_inner 4096, 64 heads of 64, N 128, 1 group, conv 4), rwkv7-1.5b (C 2048, 32 heads of 64).
SPECS = [
    _spec("gemv fma n4 k1024 s1 (M=1)", "gemv", "_gemv_kernel",
          dict(_GEMV_1, DOT=False, BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1, LOOP_STAGES=None),
          dict(num_warps=4, num_stages=3), _GEMV_PTRS),
    _spec("gemv fma n4 k1024 s1 p3 (M=1)", "gemv", "_gemv_kernel",
          dict(_GEMV_1, DOT=False, BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1, LOOP_STAGES=3),
          dict(num_warps=4, num_stages=3), _GEMV_PTRS),
    _spec("gemv fma n4 k1024 s4 (M=1)", "gemv", "_gemv_kernel",
          dict(_GEMV_1, DOT=False, BLOCK_N=4, BLOCK_K=1024, SPLIT_K=4, LOOP_STAGES=None),
          dict(num_warps=4, num_stages=3), _GEMV_PTRS),
    _spec("gemv fma n16 k512 s1 w8 (M=1)", "gemv", "_gemv_kernel",
          dict(_GEMV_1, DOT=False, BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, LOOP_STAGES=None),
          dict(num_warps=8, num_stages=3), _GEMV_PTRS),
    _spec("gemv fma n4 k1024 s1 rms (M=1)", "gemv", "_gemv_kernel",
          dict(_GEMV_1, DOT=False, BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1, LOOP_STAGES=None, NORM=2),
          dict(num_warps=4, num_stages=3), _GEMV_PTRS, floats=("eps",)),
    _spec("gemv fma n4 k1024 s1 p3 rms + swiglu (M=1)", "gemv", "_gemv_kernel",
          dict(_GEMV_1, DOT=False, BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1, LOOP_STAGES=3, NORM=2, SWIGLU=True),
          dict(num_warps=4, num_stages=3), _GEMV_PTRS, floats=("eps",)),
    _spec("gemv fma n4 k2048 s1 w8 rms scale (M=1)", "gemv", "_gemv_kernel",
          dict(_GEMV_1, DOT=False, BLOCK_N=4, BLOCK_K=2048, SPLIT_K=1, LOOP_STAGES=None, NORM=3, PARTS=64,
               PARTS_POW2=64),
          dict(num_warps=8, num_stages=3), dict(_GEMV_PTRS, z_ptr="*fp32"), floats=("eps",)),
    _spec("gemv fma n4 k1024 s1 p3 rms scale, 512 parts (M=1)", "gemv", "_gemv_kernel",
          dict(_GEMV_1, DOT=False, BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1, LOOP_STAGES=3, NORM=3, PARTS=512,
               PARTS_POW2=512),
          dict(num_warps=4, num_stages=3), dict(_GEMV_PTRS, z_ptr="*fp32"), floats=("eps",)),
    _spec("gemv fma n4 k2048 s1 w8 rms scale + fp32 residual + norm out (M=1)", "gemv", "_gemv_kernel",
          dict(_GEMV_1, DOT=False, BLOCK_N=4, BLOCK_K=2048, SPLIT_K=1, LOOP_STAGES=None, RESIDUAL=True, NORM_OUT=True,
               NORM=3, PARTS=64, PARTS_POW2=64),
          dict(num_warps=8, num_stages=3), dict(_GEMV_PTRS, z_ptr="*fp32", r_ptr="*fp32", out_ptr="*fp32",
                                                so_ptr="*fp32"), floats=("eps",)),
    _spec("gemv fma n4 k2048 s1 w8 residual (M=1)", "gemv", "_gemv_kernel",
          dict(_GEMV_1, DOT=False, BLOCK_N=4, BLOCK_K=2048, SPLIT_K=1, LOOP_STAGES=None, RESIDUAL=True),
          dict(num_warps=8, num_stages=3), _GEMV_PTRS),
    _spec("gemv fma n4 k1024 s1 select (M=1)", "gemv", "_gemv_kernel",
          dict({k: v for k, v in _GEMV_1.items() if k != "stride_xg"}, DOT=False, BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1,
               LOOP_STAGES=None, SELECT=32),
          dict(num_warps=4, num_stages=3), dict(_GEMV_PTRS, sel_ptr="*i32")),
    _spec("gemv dot n16 k256 s4 residual (M=4)", "gemv", "_gemv_kernel",
          dict(_GEMV_1, M_POW2=4, DOT=True, BLOCK_N=16, BLOCK_K=256, SPLIT_K=4, LOOP_STAGES=None, RESIDUAL=True),
          dict(num_warps=4, num_stages=4), _GEMV_PTRS),
    _spec("gemv fma n4 k2048 s1 w8 gated (M=1)", "gemv", "_gemv_kernel",
          dict(_GEMV_1, DOT=False, BLOCK_N=4, BLOCK_K=2048, SPLIT_K=1, LOOP_STAGES=None, NORM=1),
          dict(num_warps=8, num_stages=3), _GEMV_PTRS, floats=("eps",)),
    _spec("gemv dot n16 k256 s1 (M=4)", "gemv", "_gemv_kernel",
          dict({k: v for k, v in _GEMV_1.items() if k != "M"}, M_POW2=4, DOT=True, BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, LOOP_STAGES=None),
          dict(num_warps=4, num_stages=4), _GEMV_PTRS, unaligned=("M",)),
    *(_spec(f"int4 gemv n{bn} w{w} (4096 x 4096, g128, M={m})", "quant_gemv", "_int4_gemv_kernel",
            dict(GROUP=128, M_POW2=m, V=4, BLOCK_N=bn, BLOCK_T=32 * w), dict(num_warps=w, num_stages=3),
            {"q_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8"}, unaligned=("M",))
      for bn, w, m in ((4, 4, 1), (2, 8, 1), (4, 4, 4))),
    *(_spec(f"int4 dot n{bn} w{bw} (4096 x 4096, g128, BLOCK_M {bm})", "quant_gemv", "_int4_dot_kernel",
            dict(GROUP=128, BLOCK_M=bm, DOT_PREC="tf32", BLOCK_N=bn, BLOCK_W=bw), dict(num_warps=w, num_stages=st),
            {"q_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "part_ptr": "*fp32", "cnt_ptr": "*i32"}, unaligned=("M",))
      for bn, bw, bm, w, st in ((64, 64, 16, 4, 3), (128, 32, 64, 8, 2))),
    _spec("int8 dot n64 k256 (4096 x 4096, BLOCK_M 16)", "quant_gemv", "_int8_dot_kernel",
          dict(BLOCK_M=16, DOT_PREC="tf32", BLOCK_N=64, BLOCK_K=256), dict(num_warps=4, num_stages=3),
          {"q_ptr": "*i8", "s_ptr": "*fp32", "part_ptr": "*fp32", "cnt_ptr": "*i32"}, unaligned=("M",)),
    _spec("rmsnorm (d 2048, residual)", "rmsnorm", "_add_rms_norm_kernel",
          dict(HAS_RES=True, BLOCK=2048), dict(num_warps=8), floats=("eps",)),
    _spec("rotary + K/V write (32/8 heads of 64, page 16)", "rotary", "_rotary_kernel",
          dict(BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_D=32, WRITE_KV=True, PAGE=16), dict(num_warps=4),
          {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64"}, unaligned=("HKV",)),
    _spec("swiglu (I 8192)", "swiglu", "_silu_mul_kernel", dict(BLOCK=1024), dict(num_warps=4)),
    _spec("mamba2_norm add_rmsnorm", "mamba2_norm", "_add_rmsnorm_kernel",
          dict(BLOCK_D=2048, GATHER=False, HAS_RES=True, s_xd=1, s_rd=1, s_od=1, s_qd=1), dict(num_warps=8),
          {"tok_ptr": "*i64", "res_ptr": "*fp32", "r_ptr": "*fp32"}, floats=("eps",)),
    _spec("mamba2_norm gated_rmsnorm", "mamba2_norm", "_gated_rmsnorm_kernel",
          dict(BLOCK=4096, s_yd=1, s_zd=1, s_od=1), dict(num_warps=8), floats=("eps",)),
    _spec("rwkv7 add_norm_shift", "rwkv7_fused", "_add_norm_shift_kernel",
          dict(B=1, M=6, M_PAD=8, BC=2048, HAS_DELTA=True, HAS_BIAS=True, HAS_SHIFT=True), dict(num_warps=8), _RWKV_PTRS,
          floats=("eps",)),
    _spec("rwkv7 lora_hidden", "rwkv7_fused", "_lora_hidden_kernel",
          dict(B=1, NB=4, A0=0, A1=1, A2=0, A3=2, BD=512), dict(num_warps=2), _RWKV_PTRS),
    _spec("rwkv7 time_mix_inputs", "rwkv7_fused", "_time_mix_inputs_kernel", dict(B=1, HAS_VLORA=True, BD=64),
          dict(num_warps=2), dict(_RWKV_PTRS, w_out="*fp32")),
    _spec("rwkv7 gate_output", "rwkv7_fused", "_gate_output_kernel", dict(BD=64), dict(num_warps=2), _RWKV_PTRS,
          floats=("eps",)),
    _spec("rwkv7 sqrelu", "rwkv7_fused", "_sqrelu_kernel", dict(BLOCK=1024), dict(num_warps=4), _RWKV_PTRS),
    _spec("paged write_kv (8 heads of 64)", "paged_attention", "_write_kv_kernel",
          dict(H=8, D=64, H_PAD=8, D_PAD=64, PAGE=16), dict(num_warps=4), {"slot_ptr": "*i64"}),
    *(_spec(f"ssd decode step{label}", "ssd", "_decode_step_kernel",
            dict(H=64, P=64, G=1, N=128, W=4, BLOCK_P=64, BLOCK_N=128, BLOCK_W=4, HAS_BIAS=True, HAS_Z=False,
                 HAS_LIMIT=False, s_xc=1, s_dh=1, s_ck=1, s_wk=1, s_zp=1, s_yp=1, s_sn=1, s_pos=1, STATE_READY=ready),
            dict(num_warps=8), {"st_ptr": "*fp32", "A_ptr": "*fp32", "D_ptr": "*fp32", "dtb_ptr": "*fp32",
                                "pos_ptr": "*i64"}, floats=("lim_lo", "lim_hi"), unaligned=("s_cc", "s_wc"))
      for ready, label in ((False, " (1.3b)"), (True, " (state ready)"))),
    _spec("ssd decode step (state ready, gate + norm statistics)", "ssd", "_decode_step_kernel",
          dict(H=64, P=64, G=1, N=128, W=4, BLOCK_P=64, BLOCK_N=128, BLOCK_W=4, HAS_BIAS=True, HAS_Z=True,
               HAS_LIMIT=False, s_xc=1, s_dh=1, s_ck=1, s_wk=1, s_zp=1, s_yp=1, s_sn=1, s_pos=1, STATE_READY=True, HAS_NORM=True,
               s_qh=1),
          dict(num_warps=8), {"st_ptr": "*fp32", "A_ptr": "*fp32", "D_ptr": "*fp32", "dtb_ptr": "*fp32",
                              "pos_ptr": "*i64", "ss_ptr": "*fp32"}, floats=("lim_lo", "lim_hi"), unaligned=("s_cc", "s_wc")),
    *(_spec(f"wkv7 step (BV 32{label})", "wkv7", "_step_kernel", dict(BK=64, BV=32, STATE_READY=ready),
            dict(num_warps=4), dict(dict.fromkeys(("r", "w", "k", "v", "a", "b", "out"), "*bf16"), state="*fp32"),
            floats=("scale",))
      for ready, label in ((False, ""), (True, ", state ready"))),
]

POINTER_SUFFIX = "_ptr"


def _load(folder, before_dir):
    """The kernels module of `folder`: kernels.<folder>.triton, or DIR/<folder>.py (the old sources)."""
    if before_dir is None:
        return importlib.import_module(f"declab_kernels.{folder}.triton")
    spec = importlib.util.spec_from_file_location(f"_pdl_before_{folder}", Path(before_dir) / f"{folder}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _signature(fn, ptrs, floats, consts):
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = ptrs[n]
        elif n.endswith(POINTER_SUFFIX):
            sig[n] = "*bf16"
        elif n in floats:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    return sig


def compile_one(fn, ptrs, floats, consts, options, unaligned=(), ptx_version=None):
    """(ptx, sass, registers, spill stores/loads, shared memory bytes) of one sm_90 compile."""
    import triton
    from triton.backends.compiler import GPUTarget

    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    # Constexpr parameters left out take their defaults, as a launch does.
    consts.update({p.name: p.default for p in fn.params
                   if p.is_constexpr and p.has_default and p.name not in consts})
    sig = _signature(fn, ptrs, floats, consts)
    # 16-byte aligned pointers and integers that are multiples of 16, as the launches give them.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (sig[n] == "i32" and n not in unaligned)}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    ptx, sass, regs, spills, shared = assemble(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(options)), ptx_version)
    return ptx, sass, regs, "?" if spills is None else f"{spills[0]}/{spills[1]}", shared


def assemble(kernel, ptx_version=None):
    """(ptx, sass, registers, (spill store bytes, spill load bytes) or None, shared memory bytes) of a
    compiled Triton kernel, its PTX assembled for sm_90a by Triton's ptxas (with its `.version` set to
    `ptx_version` first, when given) and disassembled by the cuobjdump beside it."""
    from triton import knobs

    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.ptx"
        p.write_text(ptx if ptx_version is None else re.sub(r"^\.version \S+", f".version {ptx_version}", ptx, flags=re.M))
        res = subprocess.run([knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", str(p), "-o", str(Path(d) / "k.o")],
                             capture_output=True, text=True)
        if res.returncode:
            # e.g. a Triton whose PTX is newer than the ptxas it ships (Triton 3.9's CPU wheel: --ptx-version 8.8)
            raise RuntimeError(f"ptxas {knobs.nvidia.ptxas.path}: {(res.stderr.strip().splitlines() or ['exit ' + str(res.returncode)])[0]}")
        log = res.stderr
        cuobjdump = Path(knobs.nvidia.ptxas.path).with_name("cuobjdump")
        sass = subprocess.run([str(cuobjdump), "-sass", str(Path(d) / "k.o")], capture_output=True, text=True).stdout
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (ptx, sass, int(regs.group(1)) if regs else None,
            (int(spills.group(1)), int(spills.group(2))) if spills else None, kernel.metadata.shared)


def _body(ptx):
    """PTX without line info and debug sections, for comparing compiles of different source files."""
    ptx = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    return "\n".join(line for line in ptx.splitlines()
                     if not line.lstrip().startswith((".loc", ".file", "//")) and not re.fullmatch(r"\$L__tmp\d+:", line))


def loads_before_wait(ptx, sass):
    """(global loads before griddepcontrol.wait in the PTX, of which evict_first, in the SASS) or None."""
    lines = ptx.splitlines()
    at = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    if at is None:
        return None
    before = [line for line in lines[:at] if re.search(r"\bld\.global", line)]
    first = [line for line in before if "evict_first" in line]
    slines = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    # griddepcontrol.wait is ACQBULK in the sm_90 SASS.
    s_at = next((i for i, line in enumerate(slines) if "ACQBULK" in line), None)
    s_before = None if s_at is None else sum(1 for line in slines[:s_at] if re.search(r"\bLDG", line))
    return len(before), len(first), s_before


def memory_order(sass):
    """The global loads (LDG), stores (STG), atomics (ATOM), async copies (LDGSTS), barriers (BAR) and
    the PDL wait (WAIT: ACQBULK in sm_90 SASS) of `sass` in order, runs collapsed: "LDG x2 WAIT STG"."""
    ops = []
    for line in sass.splitlines():
        m = re.search(r"\b(LDGSTS|LDGDEPBAR|LDG|STG|ATOMG|RED|BAR|ACQBULK)\b", line)
        if m:
            ops.append({"ACQBULK": "WAIT", "ATOMG": "ATOM", "LDGDEPBAR": "DEPBAR"}.get(m.group(1), m.group(1)))
    runs = []
    for op in ops:
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return " ".join(op if n == 1 else f"{op} x{n}" for op, n in runs)


def sass_loops(sass):
    """[(start address, instruction texts)] of every loop in `sass`: from the target of a backward BRA
    to the branch itself, in the order of the branches."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line) for line in sass.splitlines()) if m]
    at = {addr: i for i, (addr, _) in enumerate(ins)}
    found = []
    for i, (addr, text) in enumerate(ins):
        m = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in at:
            found.append((int(m.group(1), 16), [t for _, t in ins[at[int(m.group(1), 16)]:i + 1]]))
    return found


def loop_mix(sass):
    """(instructions, Counter of opcodes) of the longest loop in `sass` (`sass_loops`); (0, empty)
    without a loop. Predicates and opcode modifiers dropped."""
    body = max((b for _, b in sass_loops(sass)), key=len, default=[])
    return len(body), collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)


def _ptx_version(text):
    if not re.fullmatch(r"\d+\.\d+", text):
        raise argparse.ArgumentTypeError(f"a PTX version is MAJOR.MINOR (e.g. 8.8), got {text!r}")
    return text


def main(argv=None):
    ap = Parser(prog="python -m declab_bench.pdl_check", description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="folder of the pre-PDL sources, <kernel folder>.py each (e.g. from git show)")
    ap.add_argument("--only", help="compile only the kernels whose label contains this")
    ap.add_argument("--order", action="store_true", help="also print each PDL compile's memory order (SASS)")
    ap.add_argument("--loop", action="store_true", help="also print each PDL compile's longest loop: SASS instructions by opcode")
    ap.add_argument("--ptx-version", type=_ptx_version, help="rewrite the PTX's .version to this before ptxas (e.g. 8.8)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the check compiles for sm_90")
    print(f"{'kernel':<34}{'regs':>5}{'-> PDL':>7}{'spills':>12}  {'dependents/wait':<16}"
          f"{'PTX ld before wait (evict_first)':<34}{'SASS LDG before wait':<22}{'PDL=False PTX as before'}")
    for sp in SPECS:
        label, folder, name = sp["label"], sp["folder"], sp["name"]
        if args.only and args.only not in label:
            continue
        common = dict(ptrs=sp["ptrs"], floats=sp["floats"], options=sp["options"], unaligned=sp["unaligned"],
                      ptx_version=args.ptx_version)
        fn = getattr(_load(folder, None), name)
        off = compile_one(fn, consts=dict(sp["consts"], PDL=False), **common)
        on = compile_one(fn, consts=dict(sp["consts"], PDL=True), **common)
        same = "-"
        before_regs = ""
        if args.before:
            old = compile_one(getattr(_load(folder, args.before), name), consts=sp["consts"], **common)
            same = "identical" if _body(old[0]) == _body(off[0]) else "DIFFERENT"
            before_regs = f" (before {old[2]})"
        flags = ("L" if "griddepcontrol.launch_dependents" in on[0] else "-") + \
                ("W" if "griddepcontrol.wait" in on[0] else "-")
        assert "griddepcontrol" not in off[0], label
        lb = loads_before_wait(on[0], on[1])
        lb_s = "no wait" if lb is None else f"{lb[0]} ({lb[1]})"
        sass_s = "?" if lb is None or lb[2] is None else str(lb[2])
        print(f"{label:<34}{off[2]:>5}{on[2]:>7}{off[3] + ' ' + on[3]:>12}  {flags:<16}{lb_s:<34}{sass_s:<22}{same}{before_regs}")
        if args.order:
            print(f"    {memory_order(on[1])}")
        if args.loop:
            n, ops = loop_mix(on[1])
            print(f"    loop: {n} instructions, " + " ".join(f"{op} {c}" for op, c in ops.most_common()))


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:
        sys.exit(f"error: {e}")
