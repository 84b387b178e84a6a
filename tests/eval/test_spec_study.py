"""`python -m eval.spec_study` end to end on CPU: tiny presets trained on a made-up corpus, every
point recorded with outputs identical to plain decoding; bad options refused before any training."""

import json
import subprocess
import sys

from eval import spec_study


def test_tiny_study_records_every_point(tmp_path, write_corpus, capsys):
    corpus = write_corpus(tmp_path / "corpus", docs=40)
    out = tmp_path / "spec.jsonl"
    spec_study.main(["--corpus", str(corpus), "--out", str(out), "--work", str(tmp_path / "work"), "--target", "llama-tiny", "--state-target", "mamba2-tiny",
                     "--drafts", "rwkv7-tiny", "--tokens", "2048", "--tokenizer", "byte", "--seq-len", "32", "--batch-train", "4",
                     "--prompts", "2", "--prompt-tokens", "12", "--new-tokens", "10", "--batch", "1,2", "--k", "2", "--impl", "ref",
                     "--device", "cpu"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["preset"] for r in records if r["kind"] == "trained"] == ["llama-tiny", "mamba2-tiny", "rwkv7-tiny", "llama-tiny-heads"]
    points = [r for r in records if r["kind"] == "point"]
    # llama: 3 drafts (model, prompt lookup, heads) x 2 batches; mamba2: 2 drafts x 2 rollbacks x 2 batches.
    assert len(points) == 6 + 8
    assert {(p["target"], p["draft"], p["recurrent_verify"]) for p in points if p["batch"] == 2} == {
        ("llama-tiny", "rwkv7-tiny", None), ("llama-tiny", "ngram", None), ("llama-tiny", "heads", None),
        ("mamba2-tiny", "rwkv7-tiny", "chunk"), ("mamba2-tiny", "rwkv7-tiny", "steps"),
        ("mamba2-tiny", "ngram", "chunk"), ("mamba2-tiny", "ngram", "steps")}
    for p in points:
        assert p["identical"] == 1.0
        assert 1 <= p["mean_accepted_length"] <= 3 and len(p["acceptance_by_position"]) == 2
        assert p["speedup"] == p["plain_s"] / p["spec_s"]
    assert len(json.loads(capsys.readouterr().out.splitlines()[-1])["points"]) == len(points)


def test_bad_options_exit_2_before_training(tmp_path):
    for args, message in [(["--k", "0"], "--k: every value must be >= 1"), (["--drafts", "maskpredict-tiny"], "not autoregressive"),
                          (["--target", "mamba2-tiny"], "not a transformer"), (["--prompts", "4", "--batch", "1,8"], "fewer than --batch 8")]:
        done = subprocess.run([sys.executable, "-m", "eval.spec_study", "--corpus", str(tmp_path), "--out", str(tmp_path / "o.jsonl"), *args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not (tmp_path / "o.jsonl").exists()
