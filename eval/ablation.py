"""The matched-model quality ablation: train one small model per family on one corpus, then compare.

    python -m eval.ablation --corpus corpus/ --tokens 300000000 --out results/quality/
    python -m eval.ablation --corpus corpus/ --time-budget 3600 --out results/quality/   # one GPU-hour of training

1. checks that the size presets (default configs/{llama,mamba2,rwkv7,maskpredict}-30m.json) have
   parameter counts within 10% of each other, and records them;
2. (with --time-budget) measures each preset's training tokens/s for a few steps and sets the one
   token budget that trains all of them within that many seconds;
3. makes the offline tasks (`eval.tasks.make`) with the corpus's test split (its validation split
   when the folder has no test*) as the text of declab_ppl and declab_cloze, into <out>/tasks;
4. trains each preset with `eval.train` on the same tokenizer (a BPE of --tokenizer trained once on
   the corpus, saved in <out>/tokenizer), the same tokenised data (<out>/data) and the same token
   budget, schedule and seed, into <out>/runs/<preset> (an interrupted run resumes when rerun);
5. runs `eval.quality` on the four checkpoints (Mask-Predict at each of --mp-iterations, each T
   also scored by the generative perplexity of its samples under the transformer run, the llama
   preset's, on --genppl-prompts held-out prompts), writing quality.jsonl, quality.md, mqar.png and
   maskpredict_iterations.png into <out>;
6. with --quant (e.g. none,int8,int4-rtn,int4), quantises each trained preset into
   <out>/quant/<preset>-<quant> (int4 by GPTQ on --calib-sequences x --calib-length tokens of the
   corpus's --calib-split, train by default, which must share no text with the tasks' split),
   evaluates every variant with the same tasks and model args (Mask-Predict at its default
   iterations only), times decoding at batch 1 beside the bf16 original and writes quant.jsonl and
   quant.md (`eval.quant_quality`). A rerun reuses the finished folders and evaluations.

Every record is a JSON line with environment(): <out>/ablation.jsonl (presets, parameter counts,
runs), <out>/runs/*/train.jsonl (training), <out>/quality.jsonl (evaluation).

Several GPUs: `torchrun --nproc-per-node N -m eval.ablation ...` shares the presets' training runs
out to the ranks (each on its own GPU, cuda:LOCAL_RANK) once rank 0 has made the tasks, the tokenizer
and the tokenised data; rank 0 merges their records into ablation.jsonl and runs the evaluation. A
run that raises on a rank is an error record naming it, and its preset is left out of the evaluation.

Every option (the presets, corpus, output folder, tokenizer, training counts, evaluation model args,
Mask-Predict iterations, quant names against every preset's layers, calibration split and counts) is
checked before the first step, so a mistake is one line and exit code 2, not an error after hours of
training. `--match-tolerance 0.5` lets the tiny presets
(`llama-tiny,mamba2-tiny,rwkv7-tiny,maskpredict-tiny`, not matched in size) try the pipeline in minutes.
"""

import argparse
import sys
from pathlib import Path

import decoders
from eval import quality, quant_quality, samples, train
from eval.tasks import make
from decoders import distributed
from decoders.records import append_jsonl, environment
from decoders.cli import Parser, check_output_dir

PRESETS = ["llama-30m", "mamba2-30m", "rwkv7-30m", "maskpredict-30m"]
TASKS = ["declab_mqar", "declab_copy", "declab_ppl", "declab_cloze"]


def budget_tokens(a, presets: list[str], device: str) -> int:
    """The token budget (whole steps) that trains every preset within a.time_budget seconds in all,
    from each preset's measured training throughput; the probe is recorded in ablation.jsonl."""
    tokenizer = train.load_or_make_tokenizer(a.tokenizer, str(a.corpus), a.out)
    rates = {p: train.throughput(p, tokenizer, batch=a.batch, seq_len=a.seq_len, device=device, seed=a.seed) for p in presets}
    step = a.batch * a.seq_len
    tokens = max(1, int(a.time_budget / sum(1 / r for r in rates.values())) // step) * step
    append_jsonl(a.out / "ablation.jsonl", {"kind": "throughput", "tokens_per_s": rates, "time_budget_s": a.time_budget,
                                            "tokens": tokens, **environment(device)})
    print("training tokens/s: " + ", ".join(f"{p} {r:,.0f}" for p, r in rates.items()) + f"; budget {tokens:,} tokens per model")
    return tokens


def check_args(a, presets: list[str]) -> tuple[dict, list[int]]:
    """Everything the ablation can refuse, before it trains: returns (evaluation model args, T values)."""
    check_output_dir(a.out, "--out")
    if not presets:
        raise decoders.UsageError(f"--presets {a.presets!r} names no preset")
    if len(set(presets)) != len(presets):
        raise decoders.UsageError(f"--presets {a.presets!r} names a preset twice")
    for preset in presets:
        if Path(preset).is_dir():
            raise decoders.UsageError(f"--presets {preset}: a size preset (configs/<name>.json), not a folder")
        decoders.family_of(preset)
    if (a.tokens is not None and a.tokens < 1) or (a.time_budget is not None and not a.time_budget > 0):
        raise decoders.UsageError("--tokens must be at least 1 and --time-budget > 0")
    if not 0 < a.match_tolerance:
        raise decoders.UsageError(f"--match-tolerance must be > 0, got {a.match_tolerance}")
    if a.task_docs < 1:
        raise decoders.UsageError(f"--task-docs must be at least 1, got {a.task_docs}")
    if a.tokenizer is None:
        a.tokenizer = train.default_tokenizer(presets)
    # Each preset's training run as eval.train will check it (counts, corpus, tokenizer, folders).
    for preset in presets:
        train.check_args(train.parser().parse_args(train_argv(a, preset)))
    model_args = quality.parse_model_args(a.eval_args)
    iterations = quality.parse_iterations(a.mp_iterations)
    quality.check_runs(presets, model_args, limit=a.limit, genppl_prompts=a.genppl_prompts, genppl_tokens=a.genppl_tokens)
    a.counts = train.check_matched(presets, a.match_tolerance)
    a.quants = None
    if a.quant is not None:
        a.quants = quant_quality.check(a, presets, model_args, samples.held_out_split(str(a.corpus)))
    return model_args, iterations


def train_argv(a, preset: str, device=None) -> list[str]:
    """eval.train's arguments for one preset of the ablation (on `device`, when given)."""
    return ["--preset", preset, "--corpus", str(a.corpus), "--out", str(a.out / "runs" / preset), "--tokens", str(a.tokens or 1),
            "--tokenizer", a.tokenizer, "--tokenizer-dir", str(a.out), "--data", str(a.out / "data"),
            "--seq-len", str(a.seq_len), "--batch", str(a.batch), "--lr", str(a.lr), "--seed", str(a.seed),
            *(["--device", str(device)] if device is not None else [])]


def parser() -> Parser:
    p = Parser(prog="python -m eval.ablation", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="corpus folder (train-*.txt.gz + valid.txt.gz), file or datasets name")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--tokens", type=int, help="training tokens per model")
    budget.add_argument("--time-budget", type=float, help="seconds of training for all the models together: a short throughput "
                        "probe of each preset sets the one token budget they all train for")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated size presets, one per family")
    p.add_argument("--tokenizer", default=None, help="as eval.train's (default: a BPE of the smallest vocab_size of the presets, at most 8192)")
    p.add_argument("--match-tolerance", type=float, default=0.10, help="how far (a fraction of their mean) the presets' parameter "
                   "counts may differ (default 0.10)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--mp-iterations", default="1,2,4,8,16")
    p.add_argument("--task-docs", type=int, default=200, help="examples per MQAR, copy and cloze task, and documents of declab_ppl")
    p.add_argument("--eval-args", default="dtype=bfloat16,max_length=2048,batch_size=16", help="declab model_args for the evaluation")
    p.add_argument("--genppl-prompts", type=int, default=60, help="held-out prompts whose Mask-Predict continuations the "
                   "transformer run scores (generative perplexity); 0: none")
    p.add_argument("--genppl-tokens", type=int, default=64, help="tokens of each such prompt and continuation")
    p.add_argument("--limit", type=float, help="examples per task (testing only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quant", help="comma-separated quantisations of every trained preset, evaluated and timed beside the bf16 "
                   "original: none, int8, int4 (GPTQ), int4-rtn, int4-gN, int4-rtn-gN (default: no quantised half)")
    p.add_argument("--calib-sequences", type=int, default=128, help="GPTQ calibration sequences (default 128)")
    p.add_argument("--calib-length", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--calib-split", default="train", help="the corpus split GPTQ calibrates on (default train; never the tasks' split)")
    p.add_argument("--speed-ctx", type=int, default=512, help="context of the batch-1 decode timing of each variant (default 512)")
    p.add_argument("--speed-tokens", type=int, default=32, help="tokens decoded in that timing (default 32)")
    return p


def ablation(a, here: distributed.World) -> None:
    """Check, prepare, train (this rank's share of the presets when launched) and, on rank 0, evaluate."""
    out = a.out
    presets = [x.strip() for x in a.presets.split(",") if x.strip()]
    model_args, iterations = check_args(a, presets)
    device = distributed.device_of(decoders.parse_device(None), here)
    if here.launched:
        distributed.setup(device, here, distributed.JOBS_WAIT)
    counts = a.counts
    log = out / "ablation.jsonl"

    def prepare() -> int:
        out.mkdir(parents=True, exist_ok=True)
        distributed.fold_parts(log)
        tokens = budget_tokens(a, presets, device) if a.time_budget is not None else a.tokens
        append_jsonl(log, {"kind": "presets", "params": counts, "tokens": tokens, **environment(device)})
        # Made before training (cheap, and a corpus without the tasks' text fails now, not after it).
        # Test bits per byte and cloze on the held-out test split when the corpus folder has one.
        split = samples.held_out_split(str(a.corpus))
        make.make(out / "tasks", seed=a.seed, text=str(a.corpus), text_split=split, n_docs=a.task_docs, ppl_docs_n=a.task_docs)
        calib_split = a.calib_split if a.quants and quant_quality.calibrates(a.quants) else None
        append_jsonl(log, {"kind": "tasks", "text_split": split, "calib_split": calib_split, **environment(device)})
        # One tokenizer and tokenised stream for every preset, made here before the runs that read them.
        steps = max(1, tokens // (a.batch * a.seq_len))
        tokenizer = train.load_or_make_tokenizer(a.tokenizer, str(a.corpus), out)
        if calib_split is not None:
            quant_quality.check_calibration_text(a, tokenizer)
        train.prepare_data(str(a.corpus), tokenizer, steps * a.batch * a.seq_len + a.batch, out / "data")
        return tokens

    # Rank 0 prepares what every run reads while the other ranks wait; then the runs are shared out.
    a.tokens = distributed.lead_first(prepare, here)

    def trained(preset: str) -> dict:
        train.train(train.parser().parse_args(train_argv(a, preset, device)))
        return {"kind": "trained", "preset": preset, "checkpoint": str(out / "runs" / preset), **environment(device)}

    def failed(preset: str, reason: str) -> dict:
        return {"kind": "trained", "preset": preset, "checkpoint": str(out / "runs" / preset), "status": "error", "reason": reason,
                **environment(device)}

    errors = distributed.run_jobs(presets, trained, log, here, failed)
    if here.rank != 0:
        return
    for r in errors:
        print(f"error: training {r['preset']}: {r['reason']} (recorded in {log}; it is left out of the evaluation, a rerun retries it)",
              file=sys.stderr)
    lost = {r["preset"] for r in errors}
    checkpoints = [str(out / "runs" / preset) for preset in presets if preset not in lost]
    limit = int(a.limit) if a.limit and a.limit >= 1 else a.limit
    scorer = next((run for run in checkpoints if Path(run).name.startswith("llama")), None)
    genppl = None
    if a.genppl_prompts > 0 and scorer is not None and any(quality.is_maskpredict(c) for c in checkpoints):
        genppl = quality.genppl_setup(scorer, str(a.corpus), model_args=model_args, prompts=a.genppl_prompts, tokens=a.genppl_tokens)
    runs = quality.quality(checkpoints, a.tasks.split(","), out, include_path=str(out / "tasks"), model_args=model_args,
                           limit=limit, mp_iterations=iterations, genppl=genppl)
    if a.quants is not None:
        finished = {preset: out / "runs" / preset for preset in presets if preset not in lost}
        quant_quality.study(a, finished, a.quants, runs, a.tasks.split(","), model_args, limit, samples.held_out_split(str(a.corpus)), device)


def main(argv=None):
    here = distributed.world()
    try:
        with decoders.user_errors(), distributed.quiet_unless_lead(here):
            ablation(parser().parse_args(argv), here)
    finally:
        distributed.teardown()


if __name__ == "__main__":
    main()
