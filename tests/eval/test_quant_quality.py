"""`python -m eval.ablation --quant`: the tiny presets of every family trained, quantised (int8,
int4-rtn, int4 by GPTQ), evaluated and timed beside their bf16 originals and tabled; the calibration
text (train split) shares nothing with the evaluation text (test split); a rerun reuses the finished
folders and evaluations; bad input is one line and exit 2 before any training."""

import gzip
import json

import pytest
import torch

from eval import ablation
from eval.corpus import documents

pytest.importorskip("lm_eval")

PRESETS = "llama-tiny,mamba2-tiny,rwkv7-tiny,maskpredict-tiny"
QUANTS = ["none", "int8", "int4-rtn-g16", "int4-g16"]


def argv(corpus, out, *extra):
    return ["--corpus", str(corpus), "--tokens", "256", "--out", str(out), "--presets", PRESETS, "--match-tolerance", "0.5",
            "--tokenizer", "byte", "--seq-len", "32", "--batch", "4", "--tasks", "declab_copy,declab_ppl", "--task-docs", "4",
            "--limit", "2", "--mp-iterations", "2", "--genppl-prompts", "0", "--eval-args", "dtype=float32,max_length=256,batch_size=2",
            "--quant", ",".join(QUANTS), "--calib-sequences", "4", "--calib-length", "32", "--speed-ctx", "16", "--speed-tokens", "4", *extra]


def records(out, kind):
    return [r for r in map(json.loads, (out / "quant.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, write_corpus):
    """train-00 and valid as the other eval tests write them, plus a test split of other text."""
    folder = write_corpus(tmp_path_factory.mktemp("corpus"), docs=20)
    other = write_corpus(tmp_path_factory.mktemp("other"), docs=20, seed=1)
    (folder / "test-00.txt.gz").write_bytes((other / "valid.txt.gz").read_bytes())
    return folder


@pytest.fixture(scope="module")
def study(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("ablation")
    ablation.main(argv(corpus, out))
    return out


def test_variants_are_made_evaluated_timed_and_tabled(study, capsys):
    rows = records(study, "row")
    families = ["transformer", "mamba2", "rwkv7", "maskpredict"]
    assert [(r["family"], r["quant"]) for r in rows] == [(f, q) for f in families for q in QUANTS]
    for preset in PRESETS.split(","):
        for quant in QUANTS[1:]:
            config = json.loads((study / "quant" / f"{preset}-{quant}" / "config.json").read_text())
            assert config["quantization"]["quant"] == quant
    for r in rows:
        base = next(b for b in rows if b["preset"] == r["preset"] and b["quant"] == "none")
        ppl = r["metrics"]["declab_ppl"]
        assert ppl["metric"] == "bits_per_byte" and ppl["delta"] == pytest.approx(ppl["value"] - base["metrics"]["declab_ppl"]["value"])
        assert r["speed_status"] == "ok" and r["decode_tok_s_per_seq"] > 0
        assert r["speed_ratio"] == pytest.approx(r["decode_tok_s_per_seq"] / base["decode_tok_s_per_seq"])
        # Packed weights: int8 and int4 layers take fewer bytes than the float32 originals, int4 fewest.
        if r["quant"] != "none":
            assert r["weight_bytes"] < base["weight_bytes"]
        if r["quant"] == "int4-g16":
            assert r["weight_bytes"] < next(b for b in rows if b["preset"] == r["preset"] and b["quant"] == "int8")["weight_bytes"]
    # Mask-Predict's variants at its default iterations, its bf16 original too (the sweep ran T=2 only).
    evals = records(study, "eval")
    assert {(e["preset"], e["quant"]) for e in evals if e["family"] == "maskpredict"} == {("maskpredict-tiny", q) for q in QUANTS}
    assert all(e["iterations"] is None for e in evals)
    table = (study / "quant.md").read_text()
    assert table.splitlines()[0].startswith("| preset | family | quant | weight MiB | declab_ppl (bits_per_byte) | delta | declab_copy (acc)")
    assert len(table.splitlines()) == 2 + len(rows) and "| rwkv7-tiny | rwkv7 | int4-g16 |" in table


def test_calibration_text_is_disjoint_from_the_evaluation_text(study, corpus):
    rows = records(study, "row")
    calibrated = [r for r in rows if r["quant"] == "int4-g16"]
    assert calibrated and all(r["calibration"]["split"] == "train" and r["calibration"]["eval_split"] == "test" for r in calibrated)
    assert all(r["calibration"] is None for r in rows if r["quant"] in ("int8", "int4-rtn-g16"))
    assert [r["calib_split"] for r in map(json.loads, (study / "ablation.jsonl").read_text().splitlines()) if r["kind"] == "tasks"] == ["train"]
    # The perplexity task's documents are the test split's, none of them calibration (train) text.
    evaluated = {json.loads(line)["text"] for line in (study / "tasks" / "declab_ppl.jsonl").read_text().splitlines()}
    train = set(documents(corpus, "train"))
    assert evaluated and evaluated <= set(documents(corpus, "test")) and not evaluated & train


def test_rerun_reuses_finished_folders_and_evaluations(study, corpus, capsys):
    made = {p: p.stat().st_mtime_ns for p in (study / "quant").glob("*/model.safetensors")}
    counts = {kind: len(records(study, kind)) for kind in ("quantized", "eval", "speed", "row")}
    ablation.main(argv(corpus, study))
    assert {p: p.stat().st_mtime_ns for p in (study / "quant").glob("*/model.safetensors")} == made and len(made) == 12
    assert len(records(study, "quantized")) == counts["quantized"] and len(records(study, "eval")) == counts["eval"]
    # Speeds are measured again (one process times every variant); the table is written again.
    assert len(records(study, "speed")) == 2 * counts["speed"] and len(records(study, "row")) == 2 * counts["row"]
    assert capsys.readouterr().out.count("evaluation reused") == counts["eval"]
    # A finished GPTQ folder is not reused for other calibration settings: refused before training.
    with pytest.raises(SystemExit) as e:
        ablation.main(argv(corpus, study, "--calib-sequences", "8"))
    assert e.value.code == 2 and "llama-tiny-int4-g16 was calibrated with" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--quant", "none,int3"], "unknown quant 'int3'"),
    (["--quant", "int8,int8"], "names a quantisation twice"),
    (["--calib-sequences", "0"], "--calib-sequences and --calib-length must be at least 1"),
    (["--quant", "int4"], "group size 128 does not divide the layer's 176 inputs"),
    (["--calib-split", "test"], "--calib-split test is the split the tasks are evaluated on"),
    (["--calib-split", "t"], "test-00.txt.gz is also evaluation text (test)"),
    (["--eval-args", "dtype=float32,quant=int8"], "may not set quant"),
    (["--speed-ctx", "4"], "--speed-tokens must be at least 1 and below --speed-ctx"),
])
def test_bad_input_exits_2_before_training(tmp_path, corpus, capsys, extra, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        ablation.main(argv(corpus, out, *extra))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and message in err
    assert not out.exists()


def test_one_file_corpus_is_refused_for_calibration(tmp_path, corpus, capsys):
    text = tmp_path / "all.txt"
    with gzip.open(corpus / "train-00.txt.gz", "rt") as f:
        text.write_text(f.read())
    with pytest.raises(SystemExit) as e:
        ablation.main(argv(text, tmp_path / "out"))
    assert e.value.code == 2 and "is one file, so its calibration and evaluation text would be the same" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bf16_variants_are_gated_and_timed_graphed(tmp_path, corpus):
    out = tmp_path / "gpu"
    ablation.main(argv(corpus, out, "--eval-args", "dtype=bfloat16,max_length=256,batch_size=2", "--speed-ctx", "64", "--speed-tokens", "16"))
    speeds = records(out, "speed")
    assert len(speeds) == 16
    for s in speeds:
        assert s["status"] == "ok" and s["correctness"]["ok"], (s["preset"], s["quant"], s.get("reason"))
        assert s["impl"] == "triton" and s["dtype"] == "bfloat16" and s["cuda_graphs"]
    assert all(r["speed_ratio"] > 0 for r in records(out, "row"))
