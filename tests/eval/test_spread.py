"""eval.study, eval.mqar_sweep and eval.ablation spread over the ranks of one torchrun (two processes,
gloo on the CPU): the merged records are those of one process (but for timing and rank), a run that
raises on one rank is an error record naming it while the other runs finish (the ablation evaluates
the others), a rerun trains only what no rank finished (part files an interrupted launch left
included), and bad input is refused by every rank with exit 2, rank 0 alone saying why."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from decoders import distributed
from eval import mqar_sweep, study

ROOT = Path(__file__).resolve().parents[2]
STUDY = ["--families", "transformer,mamba2", "--sizes", "tiny", "--tokenizer", "byte", "--tokens-small", "1536", "--sweep-tokens", "256",
         "--lrs", "3e-3", "--seeds", "0", "--seq-len", "32", "--batch", "8", "--val-every", "3", "--val-tokens", "256",
         "--match-tolerance", "1.0", "--device", "cpu"]
MQAR = ["--widths", "32,64", "--points", "2:16", "--steps", "2", "--lrs", "1e-3", "--eval-sequences", "4", "--batch", "2", "--device", "cpu",
        "--families", "transformer,rwkv7"]
# What a record says that does not depend on timing, the process or which rank ran it.
STUDY_STABLE = ("kind", "family", "size", "preset", "seed", "lr", "tokens", "params", "val_bpb", "tail_drop", "curve", "status")
MQAR_STABLE = ("family", "width", "layers", "pairs", "seq_len", "lr", "steps", "acc", "final_loss", "params", "state_bytes", "config")


def launch(module: str, *args: str, nproc: int | None = None, timeout: int = 240):
    command = [sys.executable, "-m", module, *args]
    if nproc:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", module, *args]
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    environ.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout)


def one_process(main, argv: list[str]) -> None:
    """`main(argv)` in this process on one thread, as each rank of a launch runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        main(argv)
    finally:
        torch.set_num_threads(threads)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def stable(rows: list[dict], fields) -> list[dict]:
    return [{k: r.get(k) for k in fields} for r in rows]


def test_study_spread_matches_one_process_and_a_failed_run_is_retried(tmp_path, write_corpus):
    corpus = str(write_corpus(tmp_path / "corpus", docs=20))
    one_process(study.main, ["--corpus", corpus, "--out", str(tmp_path / "one"), *STUDY])
    # A folder where the run's train.jsonl belongs: that run (the second main run, rank 1's) raises.
    blocked = tmp_path / "spread" / "runs" / "mamba2-tiny-s0" / "train.jsonl"
    blocked.mkdir(parents=True)
    spread = launch("eval.study", "--corpus", corpus, "--out", str(tmp_path / "spread"), *STUDY, nproc=2)
    assert spread.returncode == 0, spread.stderr[-2000:]
    expected = records(tmp_path / "one" / "study.jsonl")
    got = records(tmp_path / "spread" / "study.jsonl")
    assert [r["kind"] for r in got] == [r["kind"] for r in expected] == ["sweep"] * 2 + ["run"] * 2 + ["speed"] * 2
    failed = got[3]
    assert (failed["preset"], failed["status"], failed["rank"]) == ("mamba2-tiny", "error", 1)
    assert failed["reason"].startswith("rank 1: IsADirectoryError") and "train.jsonl" in failed["reason"]
    assert stable(got[:3], STUDY_STABLE) == stable(expected[:3], STUDY_STABLE)
    assert [r["rank"] for r in got] == [0, 1, 0, 1, 0, 1] and {r["world_size"] for r in got} == {2}
    # Rank 0 alone printed the table and the summary, which names the failure; the parts are merged and gone.
    assert spread.stdout.count("| transformer | tiny |") == 1 and spread.stdout.count('"jsonl":') == 1
    assert json.loads(spread.stdout.strip().splitlines()[-1])["errors"] == [f"run mamba2-tiny: {failed['reason']}"]
    assert not list((tmp_path / "spread").glob("study.jsonl.rank*"))

    # A rerun (here in one process) trains only the failed run, and now the runs are one process's.
    blocked.rmdir()
    one_process(study.main, ["--corpus", corpus, "--out", str(tmp_path / "spread"), *STUDY])
    rerun = records(tmp_path / "spread" / "study.jsonl")
    assert len(rerun) == len(got) + 1 and (rerun[-1]["preset"], rerun[-1]["world_size"]) == ("mamba2-tiny", 1)
    assert stable(rerun[2:3] + rerun[-1:], STUDY_STABLE) == stable(expected[2:4], STUDY_STABLE)


def test_mqar_spread_matches_one_process(tmp_path):
    one_process(mqar_sweep.main, ["--out", str(tmp_path / "one"), *MQAR])
    spread = launch("eval.mqar_sweep", "--out", str(tmp_path / "spread"), *MQAR, nproc=2)
    assert spread.returncode == 0, spread.stderr[-2000:]
    expected, got = records(tmp_path / "one" / "mqar.jsonl"), records(tmp_path / "spread" / "mqar.jsonl")
    assert len(got) == 4 and stable(got, MQAR_STABLE) == stable(expected, MQAR_STABLE)
    assert [r["rank"] for r in got] == [0, 1, 0, 1] and {r["world_size"] for r in got} == {2}
    assert spread.stdout.count('"jsonl":') == 1 and (tmp_path / "spread" / "mqar_width.png").stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "spread").iterdir()) == ["mqar.jsonl", "mqar.md", "mqar_state.png", "mqar_width.png"]


def test_parts_an_interrupted_launch_left_are_folded_in(tmp_path):
    args = ["--widths", "32", "--points", "2:16", "--steps", "1", "--lrs", "1e-3", "--eval-sequences", "2", "--batch", "2", "--device", "cpu",
            "--families", "transformer,rwkv7"]
    mqar_sweep.main(["--out", str(tmp_path / "a"), *args])
    transformer = next(r for r in records(tmp_path / "a" / "mqar.jsonl") if r["family"] == "transformer")
    # Rank 1 of a launch had finished the transformer run and was writing another record when it stopped.
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "mqar.jsonl.rank1").write_text(json.dumps({**transformer, "rank": 1, "world_size": 2}) + "\n" + '{"kind": "mq')
    mqar_sweep.main(["--out", str(tmp_path / "b"), *args])
    got = records(tmp_path / "b" / "mqar.jsonl")
    assert [(r["family"], r["rank"]) for r in got] == [("transformer", 1), ("rwkv7", 0)]
    assert not (tmp_path / "b" / "mqar.jsonl.rank1").exists()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_refusals_exit_2_on_every_rank_before_any_work(rank, tmp_path, write_corpus, monkeypatch, capsys):
    corpus = str(write_corpus(tmp_path / "corpus", docs=2))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", rank)
    cases = [
        (study.main, ["--corpus", corpus, "--out", str(tmp_path / "out"), *STUDY, "--batch", "0"], "--batch must be >= 1"),
        # Found by eval.train's checks of every run, on every rank before the process group forms.
        (study.main, ["--corpus", corpus, "--out", str(tmp_path / "out"), *STUDY, "--tokenizer", "bpe:4096"], "more than llama-tiny's vocab_size"),
        (mqar_sweep.main, ["--out", str(tmp_path / "out"), *MQAR, "--widths", "48"], "multiples of 32"),
    ]
    for main, argv, message in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2
        assert (len(err) == 1 and message in err[0]) if rank == "0" else err == [], err
        assert not dist.is_initialized() and not (tmp_path / "out").exists()


def test_a_refusal_in_the_shared_phase_reaches_every_rank(tmp_path, write_corpus):
    corpus = write_corpus(tmp_path / "corpus", docs=2)
    # No training documents: only rank 0, tokenising the corpus for everyone, finds out.
    (corpus / "train-00.txt.gz").write_bytes(__import__("gzip").compress(b""))
    spread = launch("eval.study", "--corpus", str(corpus), "--out", str(tmp_path / "out"), *STUDY, nproc=2)
    assert spread.returncode != 0
    said = [line for line in spread.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and "no training documents" in said[0], spread.stderr[-2000:]
    # torchrun's report of the rank that exited first (the other it stops, or it exits with 2 as well).
    assert "(exitcode: 2)" in spread.stderr, spread.stderr[-3000:]
    assert not (tmp_path / "out" / "study.jsonl").exists()


def test_fold_parts_appends_whole_new_lines_in_rank_order(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 0}\n{"a": 1}\n')
    # Rank 2's {"a": 1} was merged before the launch stopped; its last line was cut short.
    (tmp_path / "r.jsonl.rank10").write_text('{"a": 10}\n')
    (tmp_path / "r.jsonl.rank2").write_text('{"a": 1}\n{"a": 2}\n{"a": 3}\n{"a"')
    (tmp_path / "r.jsonl.rankx").write_text("not a part")
    assert distributed.fold_parts(path) == 3
    assert [r["a"] for r in records(path)] == [0, 1, 2, 3, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "r.jsonl.rankx"]


def test_ablation_spread_leaves_a_failed_run_out_of_the_evaluation(tmp_path, write_corpus):
    corpus = str(write_corpus(tmp_path / "corpus", docs=20))
    out = tmp_path / "ablation"
    # mamba2-tiny's run (rank 1's) cannot write its train.jsonl.
    (out / "runs" / "mamba2-tiny" / "train.jsonl").mkdir(parents=True)
    spread = launch("eval.ablation", "--corpus", corpus, "--tokens", "256", "--out", str(out), "--presets", "llama-tiny,mamba2-tiny",
                    "--match-tolerance", "1.0", "--tokenizer", "byte", "--seq-len", "32", "--batch", "4", "--tasks", "declab_copy",
                    "--task-docs", "4", "--limit", "2", "--genppl-prompts", "0", "--eval-args", "dtype=float32,max_length=256,batch_size=2",
                    nproc=2)
    assert spread.returncode == 0, spread.stderr[-2000:]
    log = records(out / "ablation.jsonl")
    assert [r["kind"] for r in log] == ["presets", "tasks", "trained", "trained"]
    assert [(r["preset"], r["rank"], r.get("status")) for r in log[2:]] == [("llama-tiny", 0, None), ("mamba2-tiny", 1, "error")]
    assert log[3]["reason"].startswith("rank 1: IsADirectoryError")
    assert {r["checkpoint"] for r in records(out / "quality.jsonl")} == {str(out / "runs" / "llama-tiny")}
    assert spread.stdout.count("| llama-tiny | transformer |") == 1 and "mamba2-tiny" in spread.stderr
    assert not list(out.glob("ablation.jsonl.rank*"))


@pytest.mark.gpu
def test_study_and_mqar_spread_over_two_gpus(tmp_path, write_corpus):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    corpus = str(write_corpus(tmp_path / "corpus", docs=20))
    gpu = [arg for arg in STUDY if arg != "--device" and arg != "cpu"]
    spread = launch("eval.study", "--corpus", corpus, "--out", str(tmp_path / "study"), *gpu, nproc=2)
    assert spread.returncode == 0, spread.stderr[-2000:]
    got = records(tmp_path / "study" / "study.jsonl")
    assert [r["rank"] for r in got] == [0, 1, 0, 1, 0, 1] and not [r for r in got if r.get("status") == "error"]
    assert all(r["mfu"] > 0 for r in got if r["kind"] == "speed")
    mqar = [arg for arg in MQAR if arg != "--device" and arg != "cpu"]
    spread = launch("eval.mqar_sweep", "--out", str(tmp_path / "mqar"), *mqar, nproc=2)
    assert spread.returncode == 0, spread.stderr[-2000:]
    got = records(tmp_path / "mqar" / "mqar.jsonl")
    assert [r["rank"] for r in got] == [0, 1, 0, 1] and all("acc" in r for r in got)
