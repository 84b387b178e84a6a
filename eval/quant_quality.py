"""The quantised half of `python -m eval.ablation --quant none,int8,int4-rtn,int4`: each trained preset
quantised, evaluated on the tasks and settings of its bf16 original, timed at batch 1 beside it, and
tabled.

1. `check` (before any training): the quant names against every preset's layers (an int4 group must
   divide each), the calibration counts, and that the calibration text (the corpus's --calib-split,
   train by default) shares no file with the evaluation text (the held-out split the tasks are made
   from: test, else valid); a finished quantised folder made with other settings is refused too.
2. `make_folders`: each trained checkpoint quantised with `eval.quantize` into
   <out>/quant/<preset>-<quant> (int4 by GPTQ on --calib-sequences x --calib-length tokens of the
   calibration split; int8 and int4-rtn need none), written beside and renamed when complete, so a
   folder that exists is finished and a rerun reuses it.
3. `evaluate`: every variant through lm-eval (`eval.quality.run_one`) with the tasks, limit and model
   args of the bf16 evaluation; Mask-Predict at its default iterations only (T = the block width, one
   token a pass), not the --mp-iterations sweep. A finished evaluation (same checkpoint, tasks, limit,
   model args, task data) is read back from <out>/quant.jsonl instead of rerun.
4. `speeds`: decode tokens/s at batch 1 of every variant and of the bf16 original, in this process,
   through the lab's harness (`decoders.harness`, the correctness gate first; CUDA graphs on a GPU).
   On the 30M presets a step is launch-bound, not bandwidth-bound, so these figures do not show the
   bandwidth gain of packed weights: that is `python -m decoders.compare --quant` on 1B / 8B shapes.
5. `table`: one row per (preset, quant): weight bytes, each task's metric and its delta against the
   bf16 original, tok/s and its ratio; written as <out>/quant.md (also printed) and as "row" records.

<out>/quant.jsonl holds one JSON object per step as it finishes, each with environment(): "quantized"
(the folder, bytes, weight error, calibration corpus and split, evaluation split), "eval" (lm-eval
metrics of a variant), "speed" (the harness record) and "row" (the table's row).
"""

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

import decoders
from decoders.quant import check_quant
from decoders.records import append_jsonl, environment
from eval import quality
from eval.corpus import shard_files
from eval.quantize import calibration_tokens, quantize_folder

NONE = "none"
LOG = "quant.jsonl"


def parse_quants(text: str) -> list[str]:
    """'none,int8,int4' -> the names, checked against the lab's quant names ("none": the bf16 original)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise decoders.UsageError(f"--quant {text!r} names no quantisation")
    if len(set(names)) != len(names):
        raise decoders.UsageError(f"--quant {text!r} names a quantisation twice")
    return [n if n == NONE else check_quant(n).name for n in names]


def check_disjoint(corpus: str, calib_split: str, eval_split: str) -> None:
    """UsageError unless the calibration text (`calib_split` of `corpus`) and the evaluation text
    (`eval_split`) are different text: two splits of a datasets name, or files of a corpus folder
    that no split shares; one file is every split at once."""
    if calib_split == eval_split:
        raise decoders.UsageError(f"--calib-split {calib_split} is the split the tasks are evaluated on: calibrate on another")
    path = Path(corpus)
    if not path.exists():
        return
    if path.is_file():
        raise decoders.UsageError(f"--corpus {corpus} is one file, so its calibration and evaluation text would be the same: "
                                  "give a folder with train* and test* (or valid*) files")
    try:
        calib, held_out = set(shard_files(path, calib_split)), set(shard_files(path, eval_split))
    except FileNotFoundError as e:
        raise decoders.UsageError(f"--calib-split {calib_split}: {e}") from None
    if calib & held_out:
        raise decoders.UsageError(f"--calib-split {calib_split}: {sorted(calib & held_out)[0].name} is also evaluation text ({eval_split})")


def folder(out: Path, preset: str, name: str) -> Path:
    return out / "quant" / f"{preset}-{name}"


def calibrates(quants: list[str]) -> bool:
    """Whether any of `quants` is calibrated (GPTQ), so needs calibration text."""
    return any(n != NONE and check_quant(n).method == "gptq" for n in quants)


def calibration(a, name: str, eval_split: str) -> dict | None:
    """What a variant's calibration was (None: not calibrated), as its records and its reuse check read it."""
    if not calibrates([name]):
        return None
    return {"corpus": str(a.corpus), "split": a.calib_split, "sequences": a.calib_sequences, "length": a.calib_length,
            "eval_split": eval_split}


def records(out: Path, kind: str) -> list[dict]:
    path = out / LOG
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == kind]


def check(a, presets: list[str], model_args: dict, eval_split: str) -> list[str]:
    """Everything the quant half can refuse, before the ablation trains; returns the quant names."""
    quants = parse_quants(a.quant)
    if a.calib_sequences < 1 or a.calib_length < 1:
        raise decoders.UsageError(f"--calib-sequences and --calib-length must be at least 1, got {a.calib_sequences} and {a.calib_length}")
    if a.speed_tokens < 1 or a.speed_ctx <= a.speed_tokens:
        raise decoders.UsageError(f"--speed-tokens must be at least 1 and below --speed-ctx, got {a.speed_tokens} and {a.speed_ctx}")
    if model_args.get("quant") not in (None, NONE):
        raise decoders.UsageError("--eval-args may not set quant with --quant (the study loads each variant)")
    for name in quants:
        if name != NONE:
            for preset in presets:
                check_quant(name, model=preset)
    if calibrates(quants):
        check_disjoint(str(a.corpus), a.calib_split, eval_split)
    made = {r["out"]: r["calibration"] for r in records(a.out, "quantized")}
    for name in quants:
        for preset in presets:
            where, asked = folder(a.out, preset, name), calibration(a, name, eval_split)
            if name != NONE and where.exists() and made.get(str(where), asked) != asked:
                raise decoders.UsageError(f"{where} was calibrated with {made[str(where)]}, not {asked}: remove it or give the same settings")
    return quants


def check_calibration_text(a, tokenizer) -> None:
    """UsageError now (before training) when the calibration split holds too few tokens for GPTQ."""
    calibration_tokens(a.corpus, tokenizer, sequences=a.calib_sequences, length=a.calib_length, split=a.calib_split)


def make_folders(a, checkpoints: dict, quants: list[str], eval_split: str, device) -> dict:
    """{(preset, quant): folder} of every variant ("none": the trained checkpoint), each quantised
    folder made now unless a finished one is there."""
    env = environment(device)
    made = {}
    for preset, checkpoint in checkpoints.items():
        for name in quants:
            if name == NONE:
                made[preset, name] = Path(checkpoint)
                continue
            where = folder(a.out, preset, name)
            if not where.exists():
                partial = where.with_name(where.name + ".partial")
                shutil.rmtree(partial, ignore_errors=True)
                calib = calibration(a, name, eval_split)
                spec = check_quant(name)
                summary = quantize_folder(checkpoint, spec, partial, device=str(device),
                                          calib=None if calib is None else {k: v for k, v in calib.items() if k != "eval_split"})
                partial.rename(where)
                summary.update(out=str(where), calibration=calib)
                append_jsonl(a.out / LOG, {"kind": "quantized", "preset": preset, **summary, "eval_split": eval_split, **env})
                print(f"{preset} -> {where}: {name}, {summary['dense_bytes'] / 2**20:.1f} MiB -> {summary['quantized_bytes'] / 2**20:.1f} MiB, "
                      f"weight error {summary['mean_rel_weight_error']:.4f}, {summary['seconds']:.1f} s")
            made[preset, name] = where
    return made


# What a finished evaluation must match to be reused.
EVAL_KEY = ("checkpoint", "tasks", "limit", "model_args", "task_docs", "seed")


def eval_key(checkpoint, tasks, limit, model_args, task_docs, seed) -> dict:
    """The EVAL_KEY fields of an evaluation."""
    return {"checkpoint": str(checkpoint), "tasks": list(tasks), "limit": limit, "model_args": dict(model_args), "task_docs": task_docs,
            "seed": seed}


def evaluate(a, variants: dict, bf16_runs: list[dict], tasks, model_args: dict, limit, device) -> dict:
    """{(preset, quant): lm-eval results} of every variant at the decoder's default iterations: the
    bf16 original's from this run's evaluation where it ran at them, the others evaluated now or read
    back from a finished "eval" record."""
    env = environment(device)
    base = {Path(r["checkpoint"]): r["results"] for r in bf16_runs if r["iterations"] is None}
    done = {json.dumps({k: r[k] for k in EVAL_KEY}, sort_keys=True): r for r in records(a.out, "eval")}
    results = {}
    for (preset, name), checkpoint in variants.items():
        if name == NONE and Path(checkpoint) in base:
            results[preset, name] = base[Path(checkpoint)]
            continue
        key = eval_key(checkpoint, tasks, limit, model_args, a.task_docs, a.seed)
        found = done.get(json.dumps(key, sort_keys=True))
        if found is not None:
            print(f"{preset} {name}: evaluation reused from {a.out / LOG}")
            results[preset, name] = found["results"]
            continue
        began = time.perf_counter()
        got, described = quality.run_one(str(checkpoint), list(tasks), include_path=str(a.out / "tasks"), model_args=model_args, limit=limit)
        append_jsonl(a.out / LOG, {"kind": "eval", "preset": preset, "quant": name, **key, "family": described["family"], "iterations": None,
                                   "results": got, "decoder": described, "seconds": round(time.perf_counter() - began, 1), **env})
        results[preset, name] = got
    return results


def speeds(a, variants: dict, model_args: dict, device) -> dict:
    """{(preset, quant): harness record} of decoding at batch 1, every variant loaded as the
    evaluation loads it (its dtype, device and impl) and gated against the reference first."""
    from decoders import harness
    from decoders.compare import first_line, measure_lab_point

    threads = harness.pin_cpu_threads() if device.type == "cpu" else None
    env = {**environment(device), **({"cpu_threads": threads} if threads else {})}
    ceiling = harness.ceilings(device)
    settings = argparse.Namespace(new_tokens=a.speed_tokens, seed=a.seed)
    out = {}
    for (preset, name), checkpoint in variants.items():
        dec = decoders.load(str(checkpoint), device=model_args.get("device", device), dtype=model_args.get("dtype"),
                            impl=model_args.get("impl", "auto"), seed=a.seed)
        try:
            gate = harness.check_against_reference(dec, new_tokens=a.speed_tokens, seed=a.seed)
        except RuntimeError as e:
            # Recorded as compare records it: a variant whose gate cannot run is not timed, the others are.
            gate = {"ok": False, "rel_rms": None, "tolerance": None, "error": first_line(e)}
        record = measure_lab_point(settings, dec, gate, str(checkpoint), None, 1, a.speed_ctx, ceiling, env)
        record["weight_bytes"] = dec.memory(1, a.speed_ctx, new_tokens=a.speed_tokens).weight_bytes
        # The decoder's own quant record (method, bits, group) is kept as weights; quant is the variant's name.
        append_jsonl(a.out / LOG, {"kind": "speed", **record, "weights": record["quant"], "preset": preset, "quant": name})
        out[preset, name] = record
        del dec
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def table_tasks(tasks, results: dict) -> list[str]:
    """The requested tasks (groups included) that report a primary metric, declab_ppl first: the table's columns."""
    shown = [t for t in tasks if any(quality.primary_metric(r.get(t, {})) for r in results.values())]
    return sorted(shown, key=lambda t: t != "declab_ppl")


def rows(variants: dict, results: dict, speed: dict, calib: dict) -> list[dict]:
    """One row per variant: every task's primary metric with its delta against the bf16 original, and
    tok/s with its ratio to the original's (None where either side has no figure)."""
    out = []
    for (preset, name), checkpoint in variants.items():
        base_results, base_speed = results[preset, NONE], speed[preset, NONE]
        metrics = {}
        for task, values in results[preset, name].items():
            got, ref = quality.primary_metric(values), quality.primary_metric(base_results.get(task, {}))
            if got is not None:
                metrics[task] = {"metric": got[0], "value": got[1], "delta": None if ref is None else got[1] - ref[1]}
        tok_s, ref_tok_s = speed[preset, name].get("decode_tok_s_per_seq"), base_speed.get("decode_tok_s_per_seq")
        out.append({"kind": "row", "preset": preset, "family": speed[preset, name]["family"], "quant": name, "checkpoint": str(checkpoint),
                    "iterations": None, "weight_bytes": speed[preset, name]["weight_bytes"], "metrics": metrics,
                    "decode_tok_s_per_seq": tok_s, "speed_status": speed[preset, name]["status"],
                    "speed_ratio": tok_s / ref_tok_s if tok_s and ref_tok_s else None, "calibration": calib.get(name)})
    return out


def markdown(table: list[dict], tasks: list[str]) -> str:
    def number(value, fmt):
        return "" if value is None else format(value, fmt)

    metric = {t: next(r["metrics"][t]["metric"] for r in table if t in r["metrics"]) for t in tasks}
    header = ["preset", "family", "quant", "weight MiB", *[c for t in tasks for c in (f"{t} ({metric[t]})", "delta")], "tok/s", "x bf16"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in table:
        cells = [r["preset"], r["family"], r["quant"], f"{r['weight_bytes'] / 2**20:.2f}"]
        for t in tasks:
            m = r["metrics"].get(t, {})
            cells += [number(m.get("value"), ".4f"), number(m.get("delta"), "+.4f")]
        cells += [number(r["decode_tok_s_per_seq"], ".1f") or r["speed_status"], number(r["speed_ratio"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def study(a, checkpoints: dict, quants: list[str], bf16_runs: list[dict], tasks, model_args: dict, limit, eval_split: str, device) -> list[dict]:
    """The quant half for the trained `checkpoints` {preset: folder}: folders, evaluations, speeds,
    then the table (<out>/quant.md, printed) and its "row" records. Returns the rows."""
    device = torch.device(device)
    names = [NONE] + [n for n in quants if n != NONE]
    variants = make_folders(a, checkpoints, names, eval_split, device)
    results = evaluate(a, variants, bf16_runs, tasks, model_args, limit, device)
    speed = speeds(a, variants, model_args, device)
    calib = {n: calibration(a, n, eval_split) for n in names if n != NONE}
    table = rows(variants, results, speed, calib)
    env = environment(device)
    for row in table:
        append_jsonl(a.out / LOG, {**row, "eval_split": eval_split, "limit": limit, "model_args": model_args, **env})
    text = markdown(table, table_tasks(tasks, results))
    (a.out / "quant.md").write_text(text)
    print(text)
    return table
