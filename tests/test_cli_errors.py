"""Every command line refuses a user's mistake in one line on stderr with exit code 2, before it
spends time, and without writing into its output.

The cases of one command run in one subprocess (`DRIVER`: each case as `python -m <module>` would run
it, `runpy` with `__main__`, its stdout and stderr captured), so the file costs a few imports, not
one per case; `test_the_real_entry_points` runs a case of each command as a real `python -m`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

DRIVER = r"""
import contextlib, io, json, runpy, sys, traceback, warnings

warnings.simplefilter("ignore")
results = []
for module, argv in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [module] + argv
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_cases(cases: list[tuple[str, list[str]]]) -> list[dict]:
    result = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(cases), capture_output=True, text=True, env=env(),
                            cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def check(cases: list[tuple[str, list[str], str]]) -> None:
    """Each (module, argv, message): exit code 2, one stderr line, `error: ...` naming `message`,
    and nothing measured before it (no ceilings line, no table)."""
    results = run_cases([(module, argv) for module, argv, _ in cases])
    for (module, argv, message), r in zip(cases, results):
        lines = [line for line in r["stderr"].splitlines() if line.strip()]
        what = f"{module} {' '.join(argv)}:\n{r['stderr'][-2000:]}"
        assert r["code"] == 2, what
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], what
        assert "Traceback" not in r["stderr"] and "ceilings on" not in r["stderr"], what


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, Path]:
    """Paths a user gets wrong: checkpoints broken in each way, a file where a folder belongs, corpora."""
    import decoders

    root = tmp_path_factory.mktemp("bad")
    good = root / "good"
    decoders.load("llama-tiny", device="cpu", impl="ref").save(good)
    weights = (good / "model.safetensors").read_bytes()
    config = json.loads((good / "config.json").read_text())
    folders = {
        "truncated": (config, weights[: len(weights) // 2]),
        "garbage": (config, b"not a safetensors file at all" * 10),
        "wrong_type": ({**config, "hidden_size": "64"}, weights),
        "negative": ({**config, "num_hidden_layers": -2}, weights),
        "no_weights": (config, None),
    }
    paths = {"good": good, "root": root}
    for name, (values, data) in folders.items():
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(values))
        if data is not None:
            (folder / "model.safetensors").write_bytes(data)
        paths[name] = folder
    for name, text in (("bad_json", "{not json"), ("list_json", "[1, 2]")):
        (root / name).mkdir()
        (root / name / "config.json").write_text(text)
        paths[name] = root / name
    paths["file"] = root / "a_file.txt"
    paths["file"].write_text("a file, not a folder\n")
    corpus = root / "corpus"
    corpus.mkdir()
    for name in ("train-00.txt", "valid.txt"):
        (corpus / name).write_text("a short paragraph.\n\nanother one.\n")
    paths["corpus"] = corpus
    paths["no_shards"] = root / "empty_corpus"
    paths["no_shards"].mkdir()
    return paths


def test_compare_refuses_before_measuring(bad):
    base = ["--no-progress", "--ctx", "64", "--new-tokens", "4", "--device", "cpu"]
    cases = [
        (["--models", "llama-tiny", "--device", "banana"], "unknown device 'banana'"),
        (["--models", "llama-tiny", "--page-size", "0"], "page size must be a power of two from 16 to 256, got 0"),
        (["--models", "llama-tiny", "--page-size", "24"], "got 24"),
        (["--models", "llama-tiny", "--dtype", "int8"], "unknown dtype 'int8'"),
        (["--models", "llama-tiny", "--block", "0"], "--block must be >= 1"),
        (["--models", ","], "names no model"),
        (["--models", "llama-tiny", "--ctx", "16k"], "over llama-tiny's maximum of 8192"),
        (["--models", "llama-tiny", "--bogus"], "unrecognized arguments: --bogus"),
        (["--models", "llama-tiny", "--out", str(bad["root"])], "is a folder, not a file"),
        (["--models", "llama-tiny", "--out", str(bad["file"] / "c.jsonl")], "is a file, not a folder"),
        (["--models", "llama-tiny", "--out", str(bad["file"])], "not a JSON lines file"),
        (["--models", "llama-tiny", "--plot", str(bad["root"] / "plot.txt")], "a figure must end in .png"),
        (["--models", "llama-tiny", "--plot", str(bad["file"] / "c.png")], "is a file, not a folder"),
        (["--models", str(bad["truncated"])], "truncated"),
        (["--models", str(bad["garbage"])], "not a safetensors file"),
        (["--models", str(bad["wrong_type"])], "hidden_size = '64' is not of type int"),
        (["--models", str(bad["negative"])], "num_hidden_layers = -2 must be at least 1"),
        (["--models", str(bad["bad_json"])], "not valid JSON"),
        (["--models", str(bad["list_json"])], "holds a JSON list, not an object"),
        (["--models", str(bad["no_weights"])], "no weights found"),
        (["--models", f"llama-tiny,{bad['truncated']}"], "truncated"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--models", "llama-tiny", "--device", "cuda"], "no CUDA device is available"))
    out = bad["root"] / "compare_out" / "c.jsonl"
    check([("decoders.compare", base + ["--out", str(out)] + args if "--out" not in args else base + args, message)
           for args, message in cases])
    assert not out.exists()


def test_profile_and_plot_refuse_bad_input(bad):
    records = bad["root"] / "not_ok.jsonl"
    records.write_text(json.dumps({"model": "llama-tiny", "status": "error", "ctx": 64, "batch": 1}) + "\n")
    out = str(bad["root"] / "p.jsonl")
    check([
        ("decoders.profile", ["--model", "llama-tiny", "--out", str(bad["root"])], "is a folder, not a file"),
        ("decoders.profile", ["--model", str(bad["truncated"]), "--out", out], "truncated"),
        ("decoders.profile", ["--model", "llama-tiny", "--device", "banana", "--out", out], "unknown device"),
        ("decoders.profile", ["--model", "llama-tiny", "--steps", "0", "--out", out], "--batch and --steps must be at least 1"),
        ("decoders.profile", ["--model", "llama-tiny", "--ctx", "16k", "--out", out], "over llama-tiny's maximum"),
        ("decoders.plot", [str(bad["root"] / "missing.jsonl"), "--out", str(bad["root"] / "f.png")], "cannot read"),
        ("decoders.plot", [str(bad["file"]), "--out", str(bad["root"] / "f.png")], "not a JSON line"),
        ("decoders.plot", [str(records), "--out", str(bad["root"] / "f.jpg")], "a figure must end in"),
        ("decoders.plot", [str(records), "--out", str(bad["root"] / "f.png")], "no measured point"),
    ])


def test_lm_eval_refuses_bad_model_args(bad):
    head = ["--model", "declab", "--tasks", "declab_mqar", "--model_args"]
    check([
        ("eval.lm_eval", head + ["pretrained=no-such-preset"], "unknown preset 'no-such-preset'"),
        ("eval.lm_eval", head + ["pretrained=llama-tiny,colour=blue"], "unknown model argument 'colour'"),
        ("eval.lm_eval", head + ["pretrained=llama-tiny,max_length=long"], "max_length='long' must be a whole number"),
        ("eval.lm_eval", head + ["pretrained=llama-tiny,device=banana"], "unknown device 'banana'"),
        ("eval.lm_eval", head + [f"pretrained={bad['garbage']}"], "not a safetensors file"),
        ("eval.lm_eval", head + ["dtype=float32"], "need pretrained="),
        ("eval.lm_eval", ["--model", "declab", "--model_args", "pretrained=llama-tiny", "--tasks", "no_such_task"], "Tasks not found"),
    ])


def test_train_refuses_before_writing_into_out(bad):
    out = bad["root"] / "train_out"
    base = ["--preset", "llama-tiny", "--out", str(out), "--tokens", "256", "--seq-len", "16", "--batch", "2"]

    def args(**changes):
        argv = list(base) + ["--corpus", str(bad["corpus"])]
        for key, value in changes.items():
            flag = "--" + key.replace("_", "-")
            if flag in argv:
                argv[argv.index(flag) + 1] = value
            else:
                argv += [flag, value]
        return argv

    stale = bad["root"] / "stale"
    (stale / "tokenizer").mkdir(parents=True)
    (stale / "tokenizer" / "tokenizer.json").write_text("{}")
    (stale / "tokenizer" / "declab_tokenizer_spec.json").write_text(json.dumps({"spec": "bpe:300"}))
    other_run = bad["root"] / "other_run"
    other_run.mkdir()
    torch.save({"preset": "mamba2-tiny", "steps": 99}, other_run / "train_state.pt")
    check([
        ("eval.train", args(preset="no-such-preset"), "unknown preset"),
        ("eval.train", args(corpus=str(bad["root"] / "missing")), "no such file or folder"),
        ("eval.train", args(corpus=str(bad["no_shards"])), "no train*.txt"),
        ("eval.train", args(batch="0"), "--batch must be at least 1"),
        ("eval.train", args(seq_len="0"), "--seq-len must be at least 1"),
        ("eval.train", args(out=str(bad["file"])), "is a file, not a folder"),
        ("eval.train", args(tokenizer="bpe:8192"), "has 8192 tokens, more than llama-tiny's vocab_size 512"),
        ("eval.train", args(tokenizer="bpe:lots"), "a BPE size must be a whole number"),
        ("eval.train", args(device="banana"), "unknown device"),
        ("eval.train", args(out=str(stale), tokenizer="byte"), "made from --tokenizer bpe:300, not byte"),
        ("eval.train", args(out=str(other_run)), "is a run of mamba2-tiny for 99 steps, not llama-tiny for 8"),
    ])
    assert not out.exists()


def test_tasks_ablation_and_quality_refuse_bad_input(bad):
    out = bad["root"] / "eval_out"
    ablation = ["--corpus", str(bad["corpus"]), "--tokens", "256", "--out", str(out)]
    check([
        ("eval.tasks.make", ["--out", str(bad["file"])], "is a file, not a folder"),
        ("eval.tasks.make", ["--out", str(out), "--text", str(bad["root"] / "missing.txt")], "no such file or folder"),
        ("eval.tasks.make", ["--out", str(out), "--mqar-pairs", "0"], "expected whole numbers >= 1"),
        ("eval.tasks.make", ["--out", str(out), "--docs", "0"], "--docs must be at least 1"),
        ("eval.ablation", ablation + ["--presets", "llama-tiny,no-such-preset"], "unknown preset 'no-such-preset'"),
        ("eval.ablation", ablation + ["--eval-args", "colour=blue"], "unknown model argument 'colour'"),
        ("eval.ablation", ablation + ["--mp-iterations", "1,x"], "--mp-iterations expects comma-separated whole numbers"),
        ("eval.ablation", ablation + ["--presets", "llama-tiny,mamba2-tiny,rwkv7-tiny,maskpredict-tiny"], "not within 10%"),
        ("eval.ablation", ablation + ["--batch", "0"], "--batch must be at least 1"),
        ("eval.ablation", ["--corpus", str(bad["corpus"]), "--out", str(out)], "one of the arguments --tokens --time-budget is required"),
        ("eval.quality", ["--checkpoints", "no-such-preset", "--tasks", "declab_mqar", "--out", str(out)], "unknown preset"),
        ("eval.quality", ["--checkpoints", "llama-tiny", "--tasks", "declab_mqar", "--model-args", "fast", "--out", str(out)],
         "expected key=value"),
        ("eval.quality", ["--checkpoints", "llama-tiny", "--tasks", "declab_mqar", "--out", str(bad["file"])], "is a file, not a folder"),
    ])
    assert not out.exists()


def test_serving_report_and_speculative_commands_refuse_bad_input(bad):
    out = bad["root"] / "new_out"
    spec = ["--corpus", str(bad["corpus"]), "--out", str(out / "spec.jsonl"), "--work", str(out / "work")]
    check([
        ("decoders.engine", ["--model", "llama-tiny", "--ctx", "8", "--new-tokens", "8"], "1 <= --new-tokens < --ctx"),
        ("decoders.engine", ["--model", "no-such-preset"], "unknown preset 'no-such-preset'"),
        ("decoders.engine", ["--model", "llama-tiny", "--bogus"], "unrecognized arguments: --bogus"),
        ("decoders.serve_bench", ["--models", "llama-tiny", "--slo", "ttft=soon"], "expected a time such as 500ms"),
        ("decoders.serve_bench", ["--models", "llama-tiny", "--duration", "0"], "--duration must be > 0"),
        ("decoders.serve_bench", ["--models", "llama-tiny", "--bogus"], "unrecognized arguments: --bogus"),
        ("decoders.serve_bench", ["--models", "llama-tiny", "--out", str(bad["root"])], "is a folder, not a file"),
        ("decoders.serve_bench", ["--models", "llama-tiny", "--out", str(bad["file"])], "not a JSON lines file"),
        ("decoders.engine", ["--model", "llama-tiny", "--out", str(bad["file"])], "not a JSON lines file"),
        ("decoders.serve", ["--model", "no-such-preset"], "unknown preset 'no-such-preset'"),
        ("decoders.serve", ["--model", "llama-tiny", "--max-batch", "0"], "must be at least 1"),
        ("eval.report", [str(bad["root"] / "missing.jsonl"), "--out", str(out)], "no such result file"),
        ("eval.report", ["--out", str(out)], "the following arguments are required: files"),
        ("eval.spec_study", ["--corpus", str(bad["root"] / "missing_corpus"), "--out", str(out / "spec.jsonl")], "no such file or folder"),
        ("eval.spec_study", [*spec, "--k", "0"], "--k: every value must be >= 1"),
        ("eval.spec_study", [*spec[:2], "--out", str(bad["root"])], "is a folder, not a file"),
        ("eval.train_heads", ["--target", str(bad["root"] / "missing"), "--corpus", str(bad["corpus"]), "--out", str(out / "heads"),
                              "--seconds", "1"], "not a checkpoint folder"),
        ("eval.train_heads", ["--target", "llama-tiny", "--corpus", str(bad["corpus"]), "--out", str(out / "heads")],
         "one of the arguments --tokens --seconds is required"),
    ])
    assert not out.exists()
    assert bad["file"].read_text() == "a file, not a folder\n"


def test_the_real_entry_points(bad):
    """One mistake per command through `python -m` itself (the driver above runs the same code in-process)."""
    for module, argv, message in [
        ("decoders.compare", ["--models", "llama-tiny", "--ctx", "64", "--page-size", "24", "--out", str(bad["root"] / "c.jsonl")], "page size"),
        ("eval.train", ["--preset", "llama-tiny", "--corpus", str(bad["no_shards"]), "--out", str(bad["root"] / "t"), "--tokens", "8"], "no train*"),
    ]:
        result = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr


def test_the_lab_survives_shadowing_packages_and_records_a_pastable_command(tmp_path):
    """A top-level `kernels` (Hugging Face's) and `arch` (PyPI's) earlier on sys.path than the lab
    change nothing: `import decoders` and `python -m decoders.compare` work, and the record's command
    pastes back into a shell."""
    import shlex

    fake = tmp_path / "site"
    for name in ("kernels", "arch"):
        (fake / name).mkdir(parents=True)
        (fake / name / "__init__.py").write_text(f'"""A stand-in for another project\'s top-level {name} package."""\nFAKE = True\n')
    shadowed = {**env(), "PYTHONPATH": f"{fake}{os.pathsep}{ROOT}"}
    probe = "import kernels, arch, decoders, declab_kernels.ssd, declab_arch.llama, eval.train; assert kernels.FAKE and arch.FAKE; print('ok')"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=shadowed, cwd=tmp_path, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    out = tmp_path / "runs" / "c.jsonl"
    result = subprocess.run([sys.executable, "-m", "decoders.compare", "--models", "llama-tiny", "--ctx", "64", "--new-tokens", "4",
                             "--no-progress", "--device", "cpu", "--out", str(out)], capture_output=True, text=True, env=shadowed,
                            cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert shlex.split(record["command"])[:3] == ["python", "-m", "decoders.compare"] and str(out) in shlex.split(record["command"])
    last = result.stdout.strip().splitlines()[-1]
    assert len(last) < 2000 and json.loads(last)["out"] == str(out)
    assert "not performance measurements" in result.stdout
