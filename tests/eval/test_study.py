"""eval.study on the tiny presets and a made-up corpus: the LR sweep picks the rate with the lowest
held-out bits per byte, every run shares one tokenizer and data stream, the table's spread is the
seeds' standard deviation, a rerun trains nothing, and bad options are one line."""

import json
import statistics

import pytest

from eval import study


def test_tiny_study_end_to_end_and_resume(tmp_path, write_corpus, capsys):
    corpus = write_corpus(tmp_path / "corpus", docs=20)
    out = tmp_path / "study"
    args = ["--corpus", str(corpus), "--out", str(out), "--families", "transformer,mamba2", "--sizes", "tiny", "--tokenizer", "byte",
            "--tokens-small", "1536", "--sweep-tokens", "768", "--lrs", "1e-4,3e-3", "--seeds", "0,1", "--seq-len", "32", "--batch", "8",
            "--val-every", "3", "--val-tokens", "256", "--match-tolerance", "1.0", "--device", "cpu"]
    study.main(args)
    records = [json.loads(line) for line in (out / "study.jsonl").read_text().splitlines()]
    sweeps = [r for r in records if r["kind"] == "sweep"]
    runs = [r for r in records if r["kind"] == "run"]
    assert len(sweeps) == 4 and len(runs) == 4 and len([r for r in records if r["kind"] == "speed"]) == 2
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for family in ("transformer", "mamba2"):
        mine = [r for r in sweeps if r["family"] == family]
        assert result["lr"][family] == min(mine, key=lambda r: r["val_bpb"])["lr"]
        seeds = [r for r in runs if r["family"] == family]
        assert {r["lr"] for r in seeds} == {result["lr"][family]} and sorted(r["seed"] for r in seeds) == [0, 1]
        row = next(r for r in result["rows"] if r["family"] == family)
        assert row["val_bpb_std"] == pytest.approx(statistics.stdev(r["val_bpb"] for r in seeds))
        # The curve ends at the budget: 1536 tokens = 6 steps of 8 x 32.
        assert seeds[0]["curve"][-1][0] == 1536 and seeds[0]["val_bpb"] == seeds[0]["curve"][-1][1]
    # One tokenizer and one data stream for every run.
    assert (out / "tokenizer" / "tokenizer.json").exists() and not list((out / "runs").glob("*/tokenizer/tokenizer.json"))
    assert (out / "curves.png").stat().st_size > 0 and "| transformer | tiny |" in (out / "study.md").read_text()
    study.main(args)
    assert len((out / "study.jsonl").read_text().splitlines()) == len(records)


def test_tail_drop_measures_the_last_fifth():
    assert study.tail_drop([(0, 4.0), (80, 2.0), (100, 1.9)]) == pytest.approx(0.05)
    assert study.tail_drop([(0, 4.0), (50, 2.0), (79, 2.0), (100, 2.0)]) == 0.0


@pytest.mark.parametrize("bad, message", [(["--families", "gpt"], "unknown gpt"), (["--sizes", "a,b,c"], "one or two sizes"),
                                          (["--lrs", "-1"], "positive rates"), (["--batch", "0"], "--batch must be >= 1")])
def test_bad_options_are_one_line_and_exit_2(bad, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        study.main(["--corpus", str(tmp_path), "--out", str(tmp_path / "out"), *bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "out").exists()
