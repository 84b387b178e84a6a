"""The speculative-decoding study: train a target and smaller drafts on one corpus, then measure
acceptance and wall speedup against plain decoding of the same target, in one process.

    python -m eval.spec_study --corpus CORPUS --out results/spec.jsonl --train-seconds 90 --draft-seconds 15

1. one tokenizer (--tokenizer, trained once on the corpus, or a folder) and one tokenised data cache
   in --work;
2. a short throughput probe of each preset sets its token budget from the seconds it may train
   (--train-seconds for the targets, --draft-seconds for the drafts; --tokens fixes one budget for
   all instead), then `eval.train` trains each into <work>/runs/<preset> (a rerun reuses them);
3. for each target (--target, a transformer, and --state-target, a state-space model) and draft
   (each of --drafts, and prompt lookup "ngram"), at each --batch and --k: greedy decoding of
   --prompts held-out prompts of --prompt-tokens tokens, --new-tokens each, plainly and
   speculatively (one untimed run of each first), recording the wall time of both, whether the
   outputs are identical, the mean tokens committed per verification and the acceptance at each
   draft position; for a state-space target both rollbacks (checkpoint and recompute, per-position
   states) are measured; the transformer target also with Medusa-style draft heads trained on its
   hidden states for --heads-seconds (`eval.train_heads`, into <work>/runs/<target>-heads).
   On a GPU every point is measured graph-captured first (a model draft's k+1 steps and the verify
   forward in CUDA graphs; a state-space target verifying as decode steps), then again eager; a
   graphed point that fails is recorded with its reason, not raised (--no-graphs: eager only).

Every record is a JSON line appended to --out as it finishes (with environment()); the table is
printed at the end and the last stdout line is one JSON document with every point.
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import decoders
from decoders import cli
from decoders.speculative import MAX_K, SpeculativeDecoder
from eval import train, train_heads
from decoders.records import append_jsonl, environment

TARGET = "llama-30m"
STATE_TARGET = "mamba2-30m"
DRAFTS = ["llama-2m", "mamba2-2m", "rwkv7-2m"]


def parse_list(text: str, name: str, cast=str) -> list:
    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise decoders.UsageError(f"--{name}: not a comma list of {cast.__name__}: {text!r}") from None
    if cast is int and any(v < 1 for v in values):
        raise decoders.UsageError(f"--{name}: every value must be >= 1, got {text!r}")
    return values


def budgets(a, presets: dict[str, float], tokenizer, device, work: Path) -> dict[str, int]:
    """Training tokens per preset (whole steps): --tokens, or its seconds times its measured training
    tokens/s. Probed budgets are kept in <work>/budgets.json, so that a rerun resumes the same runs."""
    step = a.batch_train * a.seq_len
    if a.tokens is not None:
        return {p: max(1, a.tokens // step) * step for p in presets}
    saved = work / "budgets.json"
    known = json.loads(saved.read_text()) if saved.exists() else {}
    missing = {p: seconds for p, seconds in presets.items() if p not in known}
    if missing:
        rates = {p: train.throughput(p, tokenizer, batch=a.batch_train, seq_len=a.seq_len, device=device, seed=a.seed) for p in missing}
        probed = {p: max(1, int(seconds * rates[p]) // step) * step for p, seconds in missing.items()}
        append_jsonl(a.out, {"kind": "throughput", "tokens_per_s": rates, "seconds": missing, "tokens": probed, **environment(device)})
        known.update(probed)
        saved.write_text(json.dumps(known, indent=2) + "\n")
    return {p: known[p] for p in presets}


def held_out_prompts(valid: np.ndarray, bos: int, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first n validation documents that long (each from its <bos>)."""
    starts = np.flatnonzero(valid == bos)
    prompts = []
    for s in starts:
        window = valid[s : s + length]
        if len(window) == length and bos not in window[1:]:
            prompts.append(window.astype(np.int64).tolist())
        if len(prompts) == n:
            return prompts
    raise decoders.UsageError(f"the validation split has {len(prompts)} documents of {length}+ tokens, fewer than --prompts {n}")


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_run(dec, batches: list[list[list[int]]], new_tokens: int) -> tuple[list[list[int]], float]:
    synchronize(dec.device)
    t0 = time.perf_counter()
    tokens = [seq for batch in batches for seq in dec.generate(batch, max_new_tokens=new_tokens).tokens]
    synchronize(dec.device)
    return tokens, time.perf_counter() - t0


def spec_run(spec: SpeculativeDecoder, batches: list[list[list[int]]], new_tokens: int) -> tuple[list[list[int]], float, dict]:
    """Greedy speculative decoding of every batch: tokens, wall seconds, acceptance over all batches."""
    tokens, stats = [], []
    synchronize(spec.device)
    t0 = time.perf_counter()
    for batch in batches:
        state = spec.prefill(batch, max_new_tokens=new_tokens)
        while not spec.finished(state):
            spec.step(state)
        tokens += spec.output(state, [])
        stats.append(state)
        spec.release(state)
    synchronize(spec.device)
    seconds = time.perf_counter() - t0
    verified = sum(s.verified for s in stats)
    offered = np.sum([s.offered_at for s in stats], axis=0)
    accepted = np.sum([s.accepted_at for s in stats], axis=0)
    return tokens, seconds, {
        "mean_accepted_length": sum(s.committed_total for s in stats) / max(1, verified),
        "acceptance_by_position": (accepted / np.maximum(offered, 1)).tolist(),
        "verifications": verified,
    }


def measure(a, targets: dict, drafts: dict, prompts: list[list[int]], device) -> list[dict]:
    """On a GPU every point graph-captured first (the figure a user would run, so that a run cut short
    still has it), then eager; a graphed point that raises is recorded with its reason, and the eager
    points still run."""
    records, plain = [], {}
    env = environment(device)
    for graphs in [True, False] if device.type == "cuda" and a.graphs else [False]:
        for target_name, target in targets.items():
            recurrent = target.state_kind == "recurrent"
            verifies = ["chunk", "steps"] if recurrent else ["chunk"]
            for batch in a.batches:
                batches = [prompts[i : i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
                if (target_name, batch) not in plain:
                    plain_run(target, batches[:1], a.new_tokens)
                    plain[target_name, batch] = plain_run(target, batches, a.new_tokens)
                plain_tokens, plain_s = plain[target_name, batch]
                n_tokens = len(plain_tokens) * a.new_tokens
                for draft_name, draft in drafts.items():
                    if draft == "heads" and target.state_kind != "kv":
                        continue
                    for k in a.ks:
                        # Graphs capture the recurrent verification only as decode steps.
                        for verify in verifies if not (graphs and recurrent) else ["steps"]:
                            record = {
                                "kind": "point", "target": target_name, "target_family": target.family,
                                "draft": draft_name, "draft_family": draft if isinstance(draft, str) else draft.family,
                                "k": k, "batch": batch, "recurrent_verify": verify if recurrent else None,
                                "cuda_graphs": graphs, "prompts": len(plain_tokens), "prompt_tokens": a.prompt_tokens,
                                "new_tokens": a.new_tokens, "plain_s": plain_s, "plain_tok_s": n_tokens / plain_s,
                            }
                            spec = decoders.speculative(target, f"heads:{a.heads_dir}" if draft == "heads" else draft, k=k,
                                                        recurrent_verify=verify, cuda_graphs=graphs)
                            try:
                                spec_run(spec, batches[:1], a.new_tokens)
                                tokens, spec_s, stats = spec_run(spec, batches, a.new_tokens)
                            except RuntimeError as e:
                                if not graphs:
                                    raise
                                record.update(status="error", reason=str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__,
                                              describe=spec.describe(), **env)
                                append_jsonl(a.out, record)
                                print(f"{target_name} {draft_name} k={k} batch={batch} graphs: error: {record['reason']}", flush=True)
                                continue
                            record.update(status="ok", spec_s=spec_s, spec_tok_s=n_tokens / spec_s, speedup=plain_s / spec_s,
                                          identical=sum(x == y for x, y in zip(tokens, plain_tokens)) / len(plain_tokens),
                                          **stats, describe=spec.describe(), **env)
                            append_jsonl(a.out, record)
                            records.append(record)
                            print(format_row(record), flush=True)
    return records


HEADER = f"{'target':>12} {'draft':>10} {'verify':>6} {'graphs':>6} {'k':>2} {'batch':>5} {'accepted':>8} {'by position':>24} {'identical':>9} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7}"


def format_row(r: dict) -> str:
    by_position = " ".join(f"{x:.2f}" for x in r["acceptance_by_position"])
    return (f"{r['target']:>12} {r['draft']:>10} {r['recurrent_verify'] or '-':>6} {'yes' if r['cuda_graphs'] else 'no':>6} {r['k']:>2} {r['batch']:>5} {r['mean_accepted_length']:>8.2f} "
            f"{by_position:>24} {r['identical']:>9.2f} {r['plain_tok_s']:>11.1f} {r['spec_tok_s']:>10.1f} {r['speedup']:>6.2f}x")


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="python -m eval.spec_study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="corpus folder (train-*.txt.gz + valid.txt.gz), file or datasets name")
    p.add_argument("--out", type=Path, default=Path("results/spec.jsonl"), help="JSON lines, appended point by point")
    p.add_argument("--work", type=Path, default=Path("runs/spec_study"), help="tokenizer, data and trained runs (reused by a rerun)")
    p.add_argument("--target", default=TARGET, help="transformer target preset")
    p.add_argument("--state-target", default=STATE_TARGET, help="state-space target preset (empty: none)")
    p.add_argument("--drafts", default=",".join(DRAFTS), help="comma list of draft presets (prompt lookup is always measured)")
    p.add_argument("--train-seconds", type=float, default=90.0, help="training seconds of each target")
    p.add_argument("--draft-seconds", type=float, default=15.0, help="training seconds of each draft")
    p.add_argument("--heads-seconds", type=float, default=15.0, help="training seconds of the transformer target's draft heads (0: none; with --tokens, that budget)")
    p.add_argument("--tokens", type=int, help="training tokens of every model instead of the seconds (no throughput probe)")
    p.add_argument("--tokenizer", default="bpe:8192", help='"byte", "bpe:<vocab>" or a folder with tokenizer files')
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-train", type=int, default=64, help="training batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--k", default="4", help="comma list of draft lengths")
    p.add_argument("--batch", default="1,8", help="comma list of decoding batch sizes")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts (run in batches of each --batch)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--no-graphs", dest="graphs", action="store_false", help="on a GPU, measure only the eager speculative step "
                   "(by default every point is measured eager, then with the draft steps and verify forward graph-captured)")
    p.add_argument("--dtype", default=None, help="decoding dtype (default: bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--impl", default="auto", choices=["auto", "triton", "ref"])
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p


def run(a) -> list[dict]:
    a.ks, a.batches = parse_list(a.k, "k", int), parse_list(a.batch, "batch", int)
    if any(k > MAX_K for k in a.ks):
        raise decoders.UsageError(f"--k: at most {MAX_K}")
    for name in ("prompts", "prompt_tokens", "new_tokens"):
        if getattr(a, name) < 1:
            raise decoders.UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if max(a.batches) > a.prompts:
        raise decoders.UsageError(f"--prompts {a.prompts} is fewer than --batch {max(a.batches)}")
    draft_names = parse_list(a.drafts, "drafts")
    target_names = [n for n in (a.target, a.state_target) if n]
    families = {n: decoders.family_of(n) for n in target_names + draft_names}
    kinds = {n: decoders.family_class(f).state_kind for n, f in families.items()}
    if a.target and kinds[a.target] != "kv":
        raise decoders.UsageError(f"--target {a.target} is {families[a.target]}, not a transformer")
    if a.state_target and kinds[a.state_target] != "recurrent":
        raise decoders.UsageError(f"--state-target {a.state_target} is {families[a.state_target]}, not mamba2 or rwkv7")
    if bad := [n for n in draft_names if kinds[n] not in ("kv", "recurrent")]:
        raise decoders.UsageError(f"--drafts {', '.join(bad)}: not autoregressive")
    train.check_corpus(str(a.corpus))
    cli.check_output_dir(a.work, "--work")
    cli.check_records_file(a.out, "--out")
    device = decoders.parse_device(a.device)
    work = a.work
    work.mkdir(parents=True, exist_ok=True)

    tokenizer = train.load_or_make_tokenizer(a.tokenizer, str(a.corpus), work)
    seconds = {**{n: a.train_seconds for n in target_names}, **{n: a.draft_seconds for n in draft_names}}
    tokens = budgets(a, seconds, tokenizer, device, work)
    runs = {}
    for preset in seconds:
        run_dir = work / "runs" / preset
        train.train(train.parser().parse_args([
            "--preset", preset, "--corpus", str(a.corpus), "--out", str(run_dir), "--tokens", str(tokens[preset]),
            "--tokenizer", a.tokenizer, "--tokenizer-dir", str(work), "--data", str(work / "data"),
            "--seq-len", str(a.seq_len), "--batch", str(a.batch_train), "--lr", str(a.lr), "--seed", str(a.seed),
            "--device", device.type,
        ]))
        last_val = [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines() if '"val"' in line][-1]
        append_jsonl(a.out, {"kind": "trained", "preset": preset, "tokens": tokens[preset], "checkpoint": str(run_dir),
                             "val_loss": last_val["val_loss"], "val_bpb": last_val["val_bpb"], **environment(device)})
        runs[preset] = run_dir

    a.heads_dir = None
    if a.target and a.heads_seconds > 0:
        a.heads_dir = work / "runs" / f"{a.target}-heads"
        budget = ["--tokens", str(tokens[a.target])] if a.tokens is not None else ["--seconds", str(a.heads_seconds)]
        train_heads.train_heads(train_heads.parser().parse_args([
            "--target", str(runs[a.target]), "--corpus", str(a.corpus), "--out", str(a.heads_dir), *budget, "--k", str(max(a.ks)),
            "--data", str(work / "data"), "--seq-len", str(a.seq_len), "--batch", str(a.batch_train), "--seed", str(a.seed),
            "--device", device.type,
        ]))
        end = json.loads((a.heads_dir / "heads_train.jsonl").read_text().splitlines()[-1])
        append_jsonl(a.out, {"kind": "trained", "preset": f"{a.target}-heads", "tokens": end["tokens"], "checkpoint": str(a.heads_dir),
                             "head_accuracy": end["head_accuracy"], **environment(device)})
    valid = np.fromfile(work / "data" / "valid.bin", dtype=np.int32)
    prompts = held_out_prompts(valid, tokenizer.bos_token_id, a.prompts, a.prompt_tokens)
    load = dict(device=device, dtype=a.dtype, impl=a.impl)
    targets = {n: decoders.load(runs[n], **load) for n in target_names}
    drafts = {n: decoders.load(runs[n], **load) for n in draft_names}
    drafts["ngram"] = "ngram"
    if a.heads_dir is not None:
        drafts["heads"] = "heads"
    print(HEADER, flush=True)
    return measure(a, targets, drafts, prompts, device)


def main(argv=None):
    with decoders.user_errors():
        args = parser().parse_args(argv)
        records = run(args)
    print(HEADER)
    for r in records:
        print(format_row(r))
    print(json.dumps({"points": records}))


if __name__ == "__main__":
    main()
