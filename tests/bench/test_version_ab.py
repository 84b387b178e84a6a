"""declab_bench.version_ab: its refusals (one line, exit code 2, before any work), the summary and table
it makes of the round records, and its reading of either GEMV choice API (the timing runs on a GPU)."""

import json
import types
from pathlib import Path

import pytest
import torch

from declab_bench import version_ab


def tree(tmp_path, name, presets=("llama-1b",)):
    folder = tmp_path / name
    (folder / "decoders").mkdir(parents=True)
    (folder / "decoders" / "__init__.py").write_text("")
    (folder / "configs").mkdir()
    for p in presets:
        (folder / "configs" / f"{p}.json").write_text("{}")
    return folder


def refusal(capsys, argv) -> str:
    assert version_ab.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_refusals_name_the_bad_input(tmp_path, capsys):
    a, b = tree(tmp_path, "a"), tree(tmp_path, "b")
    out = str(tmp_path / "ab.jsonl")
    base = [out, "--tree", f"before={a}", "--tree", f"after={b}", "--models", "llama-1b"]
    assert "exactly two" in refusal(capsys, [out, "--tree", f"before={a}"])
    assert "NAME=PATH" in refusal(capsys, [out, "--tree", str(a), "--tree", f"after={b}"])
    assert "not a source tree" in refusal(capsys, [out, "--tree", f"before={tmp_path}", "--tree", f"after={b}"])
    assert "different names" in refusal(capsys, [out, "--tree", f"x={a}", "--tree", f"x={b}"])
    assert "no preset 'rwkv7-1.5b'" in refusal(capsys, base[:-1] + ["llama-1b,rwkv7-1.5b"])
    assert "--batch" in refusal(capsys, base + ["--batch", "1,0"])
    assert "one context" in refusal(capsys, base + ["--ctx", "4k,8k"])
    assert "--rounds" in refusal(capsys, base + ["--rounds", "0"])
    assert "leaves no prompt" in refusal(capsys, base + ["--ctx", "40", "--rounds", "2", "--steps", "20"])
    assert not Path(out).exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu(tmp_path, capsys):
    a, b = tree(tmp_path, "a"), tree(tmp_path, "b")
    err = refusal(capsys, [str(tmp_path / "ab.jsonl"), "--tree", f"before={a}", "--tree", f"after={b}",
                           "--models", "llama-1b"])
    assert "needs a GPU" in err


def record(tree_name, batch, rnd, us, sha, picks=(("1", "torch"),)):
    return {"kind": "version_ab", "model": "llama-1b", "ctx": 4096, "tree": tree_name, "round": rnd, "batch": batch,
            "step_us": us, "tokens_sha": sha, "gemv_picks": [list(p) for p in picks]}


def test_summary_medians_spreads_and_agreement():
    recs = [record("before", 1, r, us, "aa") for r, us in enumerate([850.0, 845.0, 860.0])]
    recs += [record("after", 1, r, us, "aa") for r, us in enumerate([848.0, 852.0, 846.0])]
    recs += [record("before", 16, r, us, "b1") for r, us in enumerate([1600.0, 1605.0])]
    # the second tree's tokens differ at batch 16 (its last hash counts), and so does a pick
    recs += [record("after", 16, r, us, sha, picks=(("1", "triton"),)) for r, (us, sha) in enumerate([(1700.0, "b1"), (1702.0, "b2")])]
    rows = {s["batch"]: s for s in version_ab.summarize(recs, ["before", "after"])}
    one = rows[1]
    assert one["trees"]["before"] | {"gemv_picks": None} == {"median_us": 850.0, "min_us": 845.0, "max_us": 860.0, "rounds": 3,
                                                             "tokens_sha": "aa", "gemv_picks": None}
    assert one["trees"]["after"]["median_us"] == 848.0
    assert one["change_pct"] == pytest.approx(100 * (848 - 850) / 850)
    assert one["spreads_overlap"] and one["tokens_identical"] and one["picks_identical"] and one["ctx"] == 4096
    sixteen = rows[16]
    assert sixteen["trees"]["after"]["tokens_sha"] == "b2"
    assert not sixteen["spreads_overlap"] and not sixteen["tokens_identical"] and not sixteen["picks_identical"]
    json.dumps(list(rows.values()))
    text = version_ab.table(list(rows.values()), ["before", "after"]).splitlines()
    assert len(text) == 3 and "before" in text[0] and "after" in text[0]
    assert "850.0 (845.0..860.0)" in text[1] and "-0.2%" in text[1] and "identical" in text[1]
    assert "DIFFER" in text[2] and " no " in text[2]


def test_summary_of_a_tree_without_rounds():
    rows = version_ab.summarize([record("before", 1, 0, 900.0, "aa")], ["before", "after"])
    assert list(rows[0]["trees"]) == ["before"] and "change_pct" not in rows[0]
    assert "-" in version_ab.table(rows, ["before", "after"]).splitlines()[1]


def test_picks_from_either_choice_api():
    rec = {"impl": "triton", "triton_config": "fma n4 k1024"}
    listed = types.SimpleNamespace(choices=lambda: [{"M": 1, "N": 64, "K": 32, **rec},
                                                    {"M": 1, "N": 8, "K": 32, "impl": "torch", "triton_config": "dot"}])
    per_op = types.SimpleNamespace(choices=lambda: {(1, 64, 32, "bfloat16", False): rec},
                                   norm_choices=lambda: {(1, 8, 32, "bfloat16", False): {"impl": "torch", "triton_config": "dot"}})
    want = [[1, 8, 32, "torch", None], [1, 64, 32, "triton", "fma n4 k1024"]]
    assert version_ab.normalise_picks(listed) == want
    assert version_ab.normalise_picks(per_op) == want


def fake_worker(code):
    """A `Worker` around a stand-in process (the real one needs a GPU)."""
    import subprocess
    import sys

    w = object.__new__(version_ab.Worker)
    w.name, w.folder = "before", Path(".")
    w.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return w


def test_worker_messages_skip_other_output_and_time_out(capsys):
    w = fake_worker("print('a library log line'); print('version_ab: ' + '{\"ready\": true}', flush=True)")
    assert w.read(timeout=30) == {"ready": True}
    assert "[before] a library log line" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="exit code 0"):
        w.read()
    w = fake_worker("import time; time.sleep(30)")
    with pytest.raises(RuntimeError, match="not ready within 0 s"):
        w.read(timeout=0.2)
    assert w.proc.wait(timeout=10) != 0
