"""GPU benchmark of the SSD ops at the mamba2-1.3b shape, beside mamba-ssm's kernels when importable.

    python -m declab_bench.ssd --out results/ssd.jsonl

Measures the copy-bandwidth ceiling; the decode step per layer at batch 1/16/64/128 (a CUDA graph of
20 layer-steps over 20 separate state buffers, so L2 does not hold the state), with the default rows
per program and a sweep of the others; prefill tokens/s of ssd_chunk_scan (with its per-kernel
times) and of causal_conv1d at 4k/32k/128k, batch 1. Every kernel is checked against the
reference before it is timed and is not timed on a mismatch. One JSON line per point goes to --out;
a table is printed at the end, then one JSON document.
"""

import argparse
import json

import torch
import torch.nn.functional as F

from declab_kernels import ssd
from declab_kernels.ssd import ref as ssd_ref
from declab_kernels.ssd import triton as ssd_triton
from declab_kernels.timing import copy_bandwidth, time_ms
from decoders.peers import import_mamba_ssm
from decoders.records import append_jsonl, environment

SHAPE = dict(H=64, P=64, G=1, N=128, W=4)
CONV_DIM = SHAPE["H"] * SHAPE["P"] + 2 * SHAPE["G"] * SHAPE["N"]
LAYERS = 20
CHUNK = 256
BLOCK_P_SWEEP = (8, 16, 32, 64)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def peer(name):
    """Import a mamba-ssm / causal-conv1d entry point, or return (None, reason)."""
    try:
        if name in ("selective_state_update", "mamba_chunk_scan_combined"):
            import_mamba_ssm()
        if name == "selective_state_update":
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update as fn
        elif name == "mamba_chunk_scan_combined":
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as fn
        elif name == "causal_conv1d_update":
            from causal_conv1d import causal_conv1d_update as fn
        else:
            from causal_conv1d import causal_conv1d_fn as fn
        return fn, None
    except Exception as e:  # noqa: BLE001 - any import failure makes the peer unavailable, with its reason
        return None, f"{type(e).__name__}: {e}"


class Bench:
    def __init__(self, out, device):
        self.out, self.device = out, device
        self.env = environment(device)
        self.rows = []

    def record(self, rec):
        rec = {**rec, **self.env}
        append_jsonl(self.out, rec)
        self.rows.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k not in self.env}), flush=True)


def decode_layer(batch, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    H, P, G, N, W = (SHAPE[k] for k in "HPGNW")
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    return dict(
        conv_state=rnd(batch, CONV_DIM, W, dtype=bf),
        # Each row at its own slot of the ring; the timed replays feed every step the same positions.
        positions=torch.arange(batch, device=dev) + 4097,
        conv_weight=rnd(CONV_DIM, W, scale=0.5, dtype=bf),
        conv_bias=rnd(CONV_DIM, scale=0.1, dtype=bf),
        ssm_state=rnd(batch, H, P, N, scale=0.1),
        A=-torch.exp(rnd(H, scale=0.5)),
        D=rnd(H),
        dt_bias=rnd(H, scale=0.5) - 2.0,
    )


def decode_bytes(batch):
    H, P, G, N, W = (SHAPE[k] for k in "HPGNW")
    state = batch * H * P * N * 4 * 2
    conv_state = batch * CONV_DIM * (W + 1) * 2  # the ring read, one slot written
    inputs = batch * CONV_DIM * 2 + batch * H * 2 + batch * H * P * 2
    weights = CONV_DIM * W * 2 + CONV_DIM * 2 + 3 * H * 4
    return state + conv_state + inputs + weights


def bench_decode(b, batch, copy_bps):
    dev = b.device
    H, P, G, N, W = (SHAPE[k] for k in "HPGNW")
    layers = [decode_layer(batch, dev, i) for i in range(LAYERS)]
    xBC = torch.randn(batch, CONV_DIM, device=dev).to(torch.bfloat16)
    dt = torch.randn(batch, H, device=dev).to(torch.bfloat16)
    outs = [torch.empty(batch, H, P, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    point = dict(op="decode_step", batch=batch, **SHAPE, layers_in_graph=LAYERS, bytes=decode_bytes(batch))

    # Layer 0 as created: the timed runs below update the layers' states in place.
    pristine = {k: v.clone() for k, v in layers[0].items()}
    want = {k: v.clone() for k, v in pristine.items()}
    y_ref = ssd.mamba2_decode_step(xBC, dt, **want, ngroups=G, headdim=P, impl="ref")
    default_bp = ssd_triton.decode_block_p(P)
    for bp in (default_bp,) + tuple(v for v in BLOCK_P_SWEEP if v != default_bp):
        impl = "triton" if bp == default_bp else f"triton[block_p={bp}]"
        got = {k: v.clone() for k, v in pristine.items()}
        y = ssd_triton.mamba2_decode_step(xBC, dt, **got, ngroups=G, headdim=P, block_p=bp)
        err = dict(y=rel(y, y_ref), ssm_state=rel(got["ssm_state"], want["ssm_state"]),
                   conv_state=rel(got["conv_state"], want["conv_state"]))
        if not (err["y"] < 1e-2 and err["ssm_state"] < 1e-3 and err["conv_state"] == 0.0):
            b.record(dict(point, impl=impl, block_p=bp, status="mismatch", errors=err))
            continue

        def step(bp=bp):
            for layer, out in zip(layers, outs):
                ssd_triton.mamba2_decode_step(xBC, dt, **layer, ngroups=G, headdim=P, out=out, block_p=bp)

        us = time_ms(step, graph=True, warmup=5, iters=30) * 1e3 / LAYERS
        gbps = point["bytes"] / (us * 1e-6) / 1e9
        b.record(dict(point, impl=impl, block_p=bp, status="ok", errors=err, us_per_layer=us, gb_per_s=gbps,
                      frac_copy=gbps * 1e9 / copy_bps))

    # mamba-ssm: causal_conv1d_update + selective_state_update (its Mamba2.step without projections).
    ssu, why = peer("selective_state_update")
    conv_update, conv_why = peer("causal_conv1d_update")
    name = ("mamba_ssm:causal_conv1d_update+selective_state_update" if conv_update
            else "mamba_ssm:torch_conv_update+selective_state_update")
    if ssu is None:
        b.record(dict(point, impl="mamba_ssm:selective_state_update", status="unavailable", reason=why))
        return
    if conv_update is None:
        b.record(dict(point, impl="causal_conv1d:causal_conv1d_update", status="unavailable", reason=conv_why))

    def peer_layer(layer):
        # mamba-ssm keeps a W-long conv window [B, C, W], oldest first and shifted each step (the lab's
        # ring in position order, after an unused oldest column), and expands dt/A/D/dt_bias over P (and N).
        ring = layer["conv_state"]
        window = torch.cat([torch.zeros_like(ring[..., :1]), ssd_ref.conv_window(ring, layer["positions"])], -1)
        peer = {k: v for k, v in layer.items() if k != "positions"}
        return dict(peer, conv_state=window,
                    A_full=layer["A"][:, None, None].expand(H, P, N), D_full=layer["D"][:, None].expand(H, P),
                    dtb_full=layer["dt_bias"][:, None].expand(H, P))

    def peer_step(layer, out):
        if conv_update is not None:
            xbc = conv_update(xBC, layer["conv_state"], layer["conv_weight"], layer["conv_bias"], "silu")
        else:
            # Mamba2.step's own fallback when causal-conv1d is missing.
            layer["conv_state"].copy_(torch.roll(layer["conv_state"], shifts=-1, dims=-1))
            layer["conv_state"][:, :, -1] = xBC
            xbc = F.silu((layer["conv_state"] * layer["conv_weight"]).sum(-1) + layer["conv_bias"]).to(xBC.dtype)
        x = xbc[:, : H * P].reshape(batch, H, P)
        Bm = xbc[:, H * P: H * P + G * N].reshape(batch, G, N)
        Cm = xbc[:, H * P + G * N:].reshape(batch, G, N)
        y = ssu(layer["ssm_state"], x, dt[:, :, None].expand(batch, H, P), layer["A_full"], Bm, Cm, D=layer["D_full"],
                dt_bias=layer["dtb_full"], dt_softplus=True)
        out.copy_(y)

    peers = [peer_layer(layer) for layer in layers]
    # From layer 0 as created, expanded after the copy so the stride-0 views (mamba-ssm's TIE_HDIM
    # path, the one timed) survive.
    check = peer_layer({k: v.clone() for k, v in pristine.items()})
    peer_out = torch.empty_like(outs[0])
    peer_step(check, peer_out)
    err = dict(y=rel(peer_out, y_ref), ssm_state=rel(check["ssm_state"], want["ssm_state"]))
    if not (err["y"] < 2e-2 and err["ssm_state"] < 1e-2):
        b.record(dict(point, impl=name, status="mismatch", errors=err))
        return

    def step_peer():
        for layer, out in zip(peers, outs):
            peer_step(layer, out)

    us = time_ms(step_peer, graph=True, warmup=5, iters=30) * 1e3 / LAYERS
    gbps = point["bytes"] / (us * 1e-6) / 1e9
    b.record(dict(point, impl=name, status="ok", errors=err, us_per_layer=us, gb_per_s=gbps,
                  frac_copy=gbps * 1e9 / copy_bps))


def kernel_times_us(fn):
    """Device microseconds per kernel name of one `fn()` call, from the PyTorch profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total for e in prof.key_averages() if e.device_time_total > 0}


def bench_prefill(b, T):
    dev = b.device
    H, P, G, N, W = (SHAPE[k] for k in "HPGNW")
    g = torch.Generator(device=dev).manual_seed(T)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=dev) * scale

    bf = torch.bfloat16
    x = rnd(1, T, H, P).to(bf)
    dt = rnd(1, T, H).to(bf)
    A = -torch.exp(rnd(H, scale=0.5))
    Bm, Cm = rnd(1, T, G, N, scale=N**-0.5).to(bf), rnd(1, T, G, N, scale=N**-0.5).to(bf)
    D, dt_bias = rnd(H), rnd(H, scale=0.5) - 2.0
    # z stays None, as in mamba-ssm's Mamba2 where the gate is applied by the gated RMSNorm.
    kw = dict(chunk_size=CHUNK, D=D, z=None, dt_bias=dt_bias, dt_softplus=True)
    point = dict(op="ssd_chunk_scan", batch=1, T=T, chunk_size=CHUNK, **SHAPE)

    y_ref, s_ref = ssd.ssd_chunk_scan(x, dt, A, Bm, Cm, impl="ref", **kw)
    y, s = ssd.ssd_chunk_scan(x, dt, A, Bm, Cm, impl="triton", **kw)
    err = dict(y=rel(y, y_ref), final_state=rel(s, s_ref))
    if err["y"] < 2e-2 and err["final_state"] < 1e-2:
        def run():
            return ssd.ssd_chunk_scan(x, dt, A, Bm, Cm, impl="triton", **kw)

        ms = time_ms(run, warmup=3, iters=10)
        b.record(dict(point, impl="triton", status="ok", errors=err, ms=ms, tokens_per_s=T / (ms * 1e-3),
                      kernel_us=kernel_times_us(run)))
    else:
        b.record(dict(point, impl="triton", status="mismatch", errors=err))

    combined, why = peer("mamba_chunk_scan_combined")
    if combined is None:
        b.record(dict(point, impl="mamba_ssm:mamba_chunk_scan_combined", status="unavailable", reason=why))
    else:
        def run_peer():
            return combined(x, dt, A, Bm, Cm, CHUNK, D=D, z=None, dt_bias=dt_bias, dt_softplus=True,
                            return_final_states=True)

        yp, sp = run_peer()
        err = dict(y=rel(yp, y_ref), final_state=rel(sp, s_ref))
        if err["y"] < 2e-2 and err["final_state"] < 1e-2:
            ms = time_ms(run_peer, warmup=3, iters=10)
            b.record(dict(point, impl="mamba_ssm:mamba_chunk_scan_combined", status="ok", errors=err, ms=ms,
                          tokens_per_s=T / (ms * 1e-3)))
        else:
            b.record(dict(point, impl="mamba_ssm:mamba_chunk_scan_combined", status="mismatch", errors=err))
    del y_ref, s_ref, y, s

    # causal_conv1d over the full conv_dim, channels last [1, T, C].
    xc = rnd(1, T, CONV_DIM).to(bf)
    w, bias = rnd(CONV_DIM, W, scale=0.5).to(bf), rnd(CONV_DIM, scale=0.1).to(bf)
    cpoint = dict(op="causal_conv1d", batch=1, T=T, C=CONV_DIM, W=W, bytes=2 * T * CONV_DIM * 2)
    yc_ref, _ = ssd.causal_conv1d(xc, w, bias, impl="ref")
    candidates = {
        "triton": lambda: ssd.causal_conv1d(xc, w, bias, impl="triton")[0],
        # The PyTorch alternative for the triton path: cuDNN depthwise conv over a transposed, padded copy.
        "torch:F.conv1d": lambda: F.silu(F.conv1d(F.pad(xc.transpose(1, 2), (W - 1, 0)), w[:, None, :], bias,
                                                  groups=CONV_DIM)).transpose(1, 2),
    }
    conv_fn, why = peer("causal_conv1d_fn")
    if conv_fn is None:
        b.record(dict(cpoint, impl="causal_conv1d:causal_conv1d_fn", status="unavailable", reason=why))
    else:
        candidates["causal_conv1d:causal_conv1d_fn"] = lambda: conv_fn(xc.transpose(1, 2), w, bias,
                                                                         activation="silu").transpose(1, 2)
    for name, fn in candidates.items():
        e = rel(fn(), yc_ref)
        if e < 1e-2:
            ms = time_ms(fn, warmup=3, iters=10)
            b.record(dict(cpoint, impl=name, status="ok", errors=dict(y=e), ms=ms, tokens_per_s=T / (ms * 1e-3),
                          gb_per_s=cpoint["bytes"] / (ms * 1e-3) / 1e9))
        else:
            b.record(dict(cpoint, impl=name, status="mismatch", errors=dict(y=e)))


def table(rows):
    lines = [f"{'op':<16}{'impl':<56}{'batch':>6}{'T':>8}  {'result':<40}"]
    for r in rows:
        if r["status"] != "ok":
            res = f"{r['status']}: {r.get('reason') or r.get('errors')}"
        elif r["op"] == "decode_step":
            res = f"{r['us_per_layer']:.2f} us/layer  {r['gb_per_s']:.0f} GB/s  {100 * r['frac_copy']:.0f}% copy"
        elif r["op"] == "copy":
            res = f"{r['gb_per_s']:.0f} GB/s"
        else:
            res = f"{r['ms']:.3f} ms  {r['tokens_per_s'] / 1e6:.1f} M tok/s"
        lines.append(f"{r['op']:<16}{r['impl']:<56}{r.get('batch', ''):>6}{r.get('T', ''):>8}  {res}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON-lines file to append results to")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    torch.cuda.init()
    b = Bench(args.out, device)
    copy_bps = copy_bandwidth(device)
    b.record(dict(op="copy", impl="torch:copy_", status="ok", gb_per_s=copy_bps / 1e9))
    for batch in (1, 16, 64, 128):
        bench_decode(b, batch, copy_bps)
        torch.cuda.empty_cache()
    for T in (4096, 32768, 131072):
        bench_prefill(b, T)
        torch.cuda.empty_cache()
    print(table(b.rows))
    print(json.dumps({"bench": "ssd", "results": [{k: v for k, v in r.items() if k not in b.env} for r in b.rows],
                      "environment": b.env}))


if __name__ == "__main__":
    main()
