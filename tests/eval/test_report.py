"""eval.report and eval.report_join on small made-up result files: the join keeps matched records and
refuses mismatched ones, the page holds every figure and table, unjoined records are listed."""

import json
import re

import pytest

from eval import report
from eval.report_join import join, read_records

ENV = {"git_sha": "abc1234", "device": "NVIDIA H200", "command": "made-up"}
CONFIGS = {"transformer": {"hidden_size": 64, "num_hidden_layers": 2}, "mamba2": {"d_model": 64, "n_layer": 2},
           "maskpredict": {"hidden_size": 64, "num_hidden_layers": 2, "mask_token_id": 3}}
PRESETS = {"transformer": "llama-30m", "mamba2": "mamba2-30m", "maskpredict": "maskpredict-30m"}


def decoder(family, iterations=None, dtype="bfloat16", model=None):
    d = {"family": family, "model": model or PRESETS[family], "impl": "triton", "dtype": dtype, "cuda_graphs": True, "config": CONFIGS[family]}
    if family == "maskpredict":
        d["decoding"] = {"rule": "mask-predict", "iterations": iterations, "block_length": None, "threshold": None, "length_beam": None, "prefix_cache": True}
    return d


def speed(family, *, ctx=4096, batch=1, tok_s=1000.0, iterations=None, new_tokens=64, status="ok", **extra):
    r = {"model": PRESETS[family], "iterations": iterations, **decoder(family, iterations), **ENV, "status": status, "ctx": ctx, "batch": batch,
         "new_tokens": new_tokens}
    if status == "ok":
        r.update(decode_tok_s=tok_s * batch, decode_tok_s_per_seq=tok_s, peak_memory_bytes=ctx * 1e5,
                 tokens_per_pass=(new_tokens / iterations) if iterations else 1.0)
    else:
        r["reason"] = "out of memory"
    r.update(extra)
    return r


def quality(family, *, iterations=None, bpb=1.5, acc=0.2, **decoder_changes):
    ckpt = f"runs/{PRESETS[family]}"
    dec = {**decoder(family, iterations, model=ckpt), **decoder_changes}
    base = {"checkpoint": ckpt, "family": family, "iterations": iterations, "decoder": dec, "limit": None, **ENV}
    out = [{**base, "task": "declab_ppl", "metrics": {"bits_per_byte,none": bpb}},
           {**base, "task": "declab_cloze", "metrics": {"acc,none": acc}}]
    out += [{**base, "task": f"declab_copy_{n}", "metrics": {"acc,none": acc / (i + 1)}} for i, n in enumerate((128, 512))]
    out += [{**base, "task": f"declab_mqar_{n}", "metrics": {"acc,none": acc / (i + 1)}} for i, n in enumerate((4, 16))]
    if family == "maskpredict":
        out.append({**base, "task": "declab_genppl", "metrics": {"gen_ppl,none": 100.0 * iterations ** -0.5, "new_tokens,none": 64}})
    return out


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def files(tmp_path):
    speeds = [speed("transformer", tok_s=900), speed("transformer", batch=64, tok_s=300), speed("transformer", ctx=32768, tok_s=700),
              speed("mamba2", tok_s=800), speed("mamba2", batch=64, tok_s=400),
              speed("maskpredict", iterations=4, tok_s=3000), speed("maskpredict", iterations=16, tok_s=900),
              speed("transformer", ctx=131072, status="skipped")]
    serving = [{"model": "mamba2-30m", **decoder("mamba2"), **ENV, "status": "unfinished", "arrivals": "poisson", "rate": 64, "output_tok_s": 1.0},
               {"model": "mamba2-30m", **decoder("mamba2"), **ENV, "status": "ok", "arrivals": "poisson", "rate": 8, "users": None, "output_tok_s": 20000.0,
                "cost_per_1k_output_tokens": 0.002, "energy_j_per_output_token": 0.05}]
    qualities = quality("transformer", bpb=1.4, acc=0.3) + quality("mamba2", bpb=1.6, acc=0.2) + \
        [r for t in (1, 4, 16) for r in quality("maskpredict", iterations=t, bpb=2.0 + 0.1 * t, acc=0.05)]
    trained = [{"kind": "trained", "preset": p, "checkpoint": f"runs/{p}", **ENV} for p in PRESETS.values()]
    return [write(tmp_path / "compare_30m.jsonl", speeds), write(tmp_path / "serve.jsonl", serving),
            write(tmp_path / "quality.jsonl", qualities), write(tmp_path / "ablation.jsonl", trained)]


def test_join_keeps_matched_records(files):
    j = join(read_records(files))
    pairs = {(q.label, s.data.get("ctx"), s.data.get("batch")): key for q, s, key in j.pairs}
    assert pairs[("llama-30m", 4096, 1)] == "preset"
    assert ("llama-30m", 32768, 1) in pairs and ("llama-30m", 4096, 64) in pairs
    assert ("mamba2-30m", None, None) in pairs
    assert ("maskpredict-30m T=4", 4096, 1) in pairs and ("maskpredict-30m T=16", 4096, 1) in pairs
    # T=4 quality is never paired with the T=16 speed record.
    assert all(q.iterations == s.data["iterations"] for q, s, _ in j.pairs if q.family == "maskpredict")
    assert sorted(r.data["status"] for r in j.not_measured) == ["skipped", "unfinished"]


def test_join_by_checkpoint(tmp_path):
    rec = speed("transformer", model="runs/llama-30m")
    j = join(read_records([write(tmp_path / "a.jsonl", [rec] + quality("transformer"))]))
    assert [key for _, _, key in j.pairs] == ["checkpoint"]


@pytest.mark.parametrize("change, field", [
    ({"dtype": "float16"}, "dtype"),
    ({"impl": "ref"}, "impl"),
    ({"config": {"hidden_size": 128, "num_hidden_layers": 2}}, "config.hidden_size"),
    ({"device": "NVIDIA A100"}, "device"),
    ({"quantization": {"weights": "int4"}}, "quantization"),
    ({"speculative": {"draft": "llama-tiny", "k": 4}}, "speculative"),
])
def test_join_refuses_a_speed_record_that_differs(tmp_path, change, field):
    j = join(read_records([write(tmp_path / "a.jsonl", [speed("transformer", **change)] + quality("transformer"))]))
    assert j.pairs == []
    [(run, _, why)] = j.refused
    assert run.label == "llama-30m" and any(w.startswith(field) for w in why), why


def test_join_refuses_maskpredict_decoding_and_canvas(tmp_path):
    recs = [speed("maskpredict", iterations=4, new_tokens=32), speed("maskpredict", iterations=8)] + quality("maskpredict", iterations=4)
    j = join(read_records([write(tmp_path / "a.jsonl", recs)]))
    assert j.pairs == []
    reasons = sorted(w for _, _, why in j.refused for w in why)
    assert any(w.startswith("canvas") for w in reasons) and any(w.startswith("decoding.iterations") for w in reasons), reasons


def test_join_refuses_a_quality_setting_the_speed_record_lacks(tmp_path):
    recs = [speed("transformer")] + quality("transformer", quantization={"weights": "int8"})
    j = join(read_records([write(tmp_path / "a.jsonl", recs)]))
    assert j.pairs == [] and "quantization" in j.refused[0][2][0]


def test_newest_speed_record_of_a_point_wins(tmp_path):
    recs = [speed("transformer", tok_s=100), speed("transformer", tok_s=200)] + quality("transformer")
    j = join(read_records([write(tmp_path / "a.jsonl", recs)]))
    assert [s.data["decode_tok_s_per_seq"] for _, s, _ in j.pairs] == [200]


def test_page_has_every_figure_and_table(files, tmp_path, capsys):
    out = tmp_path / "report"
    assert report.main(files + ["--out", str(out)]) == 0
    for name in ("report.html", "summary.md", "frontier.png", "context.png", "maskpredict.png", "cost.png"):
        assert (out / name).stat().st_size > 0, name
    page = (out / "report.html").read_text()
    assert len(re.findall(r'<img src="data:image/png;base64,', page)) == 4
    assert "http://" not in page and "https://" not in page
    for section in ('id="frontier"', 'id="context"', 'id="maskpredict"', 'id="cost"', "Quality without speed", "Speed without quality",
                    "Refused joins", "Speed points not measured", "How speed and quality are joined"):
        assert section in page, section
    # Every point links to a record the page holds.
    anchors = set(re.findall(r'<details id="([^"]+)"', page))
    links = set(re.findall(r'href="#(rec-[^"]+)"', page))
    assert links and links <= anchors
    summary = (out / "summary.md").read_text()
    assert "| llama-30m | transformer | preset | 900 | 19200 | 1.4 | 0.3 |" in summary
    assert "| mamba2-30m | mamba2 | preset | 800 | 20000 | 1.6 | 0.2 |" in summary
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["pairs"] == len(join(read_records(files)).pairs)


def test_unjoined_records_are_listed(tmp_path):
    recs = quality("mamba2") + [speed("transformer")]
    out = tmp_path / "r"
    assert report.main([write(tmp_path / "a.jsonl", recs), "--out", str(out)]) == 0
    summary = (out / "summary.md").read_text()
    quality_only = summary.split("## Quality without speed")[1].split("##")[0]
    speed_only = summary.split("## Speed without quality")[1].split("##")[0]
    assert "mamba2-30m" in quality_only and "llama-30m: 1 records" in speed_only
    assert "- joined quality-speed pairs" in summary.split("## Missing")[1].split("##")[0]
    page = (out / "report.html").read_text()
    assert "No quality run has a speed record" in page


@pytest.mark.parametrize("args, message", [
    (["missing.jsonl"], "no such result file"),
    (["BAD", "--ctx", "4q"], "not a context size"),
    (["BAD", "--load-batch", "1"], "--load-batch"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    bad = write(tmp_path / "bad.jsonl", [speed("transformer")])
    argv = [bad if a == "BAD" else str(tmp_path / a) if a.endswith(".jsonl") else a for a in args]
    with pytest.raises(SystemExit) as e:
        report.main(argv + ["--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_line_that_is_not_json_is_named(tmp_path, capsys):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"model": "x"}\nnot json\n')
    with pytest.raises(SystemExit):
        report.main([str(path), "--out", str(tmp_path / "o")])
    assert "broken.jsonl:2" in capsys.readouterr().err


@pytest.mark.parametrize("preset, options", [("llama-tiny", {}), ("maskpredict-tiny", {"iterations": 4})])
def test_join_reads_the_descriptions_the_lab_writes(tmp_path, preset, options):
    """A speed record as decoders.compare writes it (random weights of a preset) joins a quality record
    as eval.quality writes it (the checkpoint trained from that preset), and only with the same T."""
    import decoders

    described = decoders.load(preset, device="cpu", impl="ref", **options).describe()
    ckpt = f"runs/{preset}"
    speed_rec = {"model": preset, "iterations": options.get("iterations"), **described, **ENV, "status": "ok", "ctx": 256, "batch": 1,
                 "new_tokens": 64, "decode_tok_s": 10.0, "decode_tok_s_per_seq": 10.0}
    base = {"checkpoint": ckpt, "family": described["family"], **ENV, "decoder": {**described, "model": ckpt}}
    recs = [speed_rec, {**base, "iterations": options.get("iterations"), "task": "declab_ppl", "metrics": {"bits_per_byte,none": 2.0}},
            {"kind": "trained", "preset": preset, "checkpoint": ckpt, **ENV}]
    if options:
        other = {**described, "model": ckpt, "decoding": {**described["decoding"], "iterations": 8}}
        recs.append({**base, "decoder": other, "iterations": 8, "task": "declab_ppl", "metrics": {"bits_per_byte,none": 1.9}})
    j = join(read_records([write(tmp_path / "a.jsonl", recs)]))
    assert [(q.label, key) for q, _, key in j.pairs] == [(preset + (" T=4" if options else ""), "preset")]
    assert [q.label for q, _, _ in j.refused] == ([preset + " T=8"] if options else [])


def test_pareto_front():
    points = [(100.0, 1.5), (200.0, 1.6), (150.0, 1.7), (50.0, 1.4), (300.0, 2.0)]
    assert report.pareto(points, higher_is_better=False) == [(50.0, 1.4), (100.0, 1.5), (200.0, 1.6), (300.0, 2.0)]
    assert report.pareto(points, higher_is_better=True) == [(300.0, 2.0)]
    accuracy = [(100.0, 0.3), (200.0, 0.2), (150.0, 0.1), (50.0, 0.4)]
    assert report.pareto(accuracy, higher_is_better=True) == [(50.0, 0.4), (100.0, 0.3), (200.0, 0.2)]


def test_a_model_measured_two_ways_draws_two_series(tmp_path):
    recs = [speed("transformer"), speed("transformer", ctx=8192), speed("transformer", impl="ref")]
    series = report.latest_batch1(join(read_records([write(tmp_path / "a.jsonl", recs)])))
    assert sorted((label, len(points)) for label, points in series.items()) == [
        ("llama-30m (ref, bfloat16, NVIDIA H200)", 1), ("llama-30m (triton, bfloat16, NVIDIA H200)", 2)]


def test_files_of_one_name_keep_their_records_apart(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    recs = read_records([write(tmp_path / "a" / "r.jsonl", [speed("transformer")]), write(tmp_path / "b" / "r.jsonl", [speed("mamba2")])])
    assert len({r.anchor for r in recs}) == 2 and all(r.ref.endswith("r.jsonl:1") for r in recs)


def test_files_without_speed_or_quality_are_refused(tmp_path, capsys):
    path = write(tmp_path / "kernels.jsonl", [{"op": "gemv", "us": 3.0}])
    with pytest.raises(SystemExit) as e:
        report.main([path, "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "no speed record and no quality record" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
