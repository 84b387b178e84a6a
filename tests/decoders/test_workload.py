"""decoders.workload: arrival processes, length distributions, determinism under the seed, save / load."""

import math
import random

import pytest

from decoders import workload as wl
from decoders.base import UsageError


def spec(**kw):
    base = dict(arrivals="poisson", requests=50, prompt_len=wl.parse_lengths("8..32"), output_len=wl.parse_lengths("4"), rate=4.0, seed=0)
    base.update(kw)
    return wl.WorkloadSpec(**base)


@pytest.mark.parametrize("kw", [dict(), dict(arrivals="bursty", amplitude=0.4, period_s=5.0), dict(arrivals="closed", rate=None, users=3), dict(rate=math.inf)])
def test_the_same_seed_gives_the_same_workload_and_another_seed_another(kw):
    a, b = wl.generate(spec(**kw), vocab_size=100), wl.generate(spec(**kw), vocab_size=100)
    assert a == b
    other = wl.generate(spec(seed=1, **kw), vocab_size=100)
    assert [i.prompt for i in other.items] != [i.prompt for i in a.items]
    if kw.get("arrivals", "poisson") != "closed" and not math.isinf(kw.get("rate", 4.0)):
        assert [i.arrival_s for i in other.items] != [i.arrival_s for i in a.items]


def test_changing_the_lengths_leaves_the_arrivals():
    a = wl.generate(spec(), vocab_size=100)
    b = wl.generate(spec(prompt_len=wl.parse_lengths("100"), output_len=wl.parse_lengths("1..3")), vocab_size=100)
    assert [i.arrival_s for i in a.items] == [i.arrival_s for i in b.items]


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    times = wl.poisson_arrivals(5.0, 4000, random.Random(0))
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert times == sorted(times)
    assert abs(sum(gaps) / len(gaps) - 0.2) < 0.01
    # An exponential gap exceeds its mean with probability 1/e.
    assert abs(sum(g > 0.2 for g in gaps) / len(gaps) - math.exp(-1)) < 0.03


def test_an_infinite_rate_sends_everything_at_once():
    assert {i.arrival_s for i in wl.generate(spec(rate=math.inf), vocab_size=10).items} == {0.0}


def test_bursty_arrivals_keep_the_mean_rate_and_swing_by_the_amplitude():
    rate, amplitude, period = 10.0, 0.4, 2.0
    times = wl.bursty_arrivals(rate, amplitude, period, 20000, random.Random(0))
    assert abs(len(times) / times[-1] - rate) / rate < 0.03
    high = sum(1 for t in times if (t % period) < period / 2)
    # The mean of 1 + A sin over a half period is 1 + 2A/pi (rising half) or 1 - 2A/pi (falling half).
    expected = (1 + 2 * amplitude / math.pi) / (1 - 2 * amplitude / math.pi)
    assert abs(high / (len(times) - high) - expected) / expected < 0.05
    flat = wl.bursty_arrivals(rate, 0.0, period, 20000, random.Random(0))
    assert abs(sum(1 for t in flat if (t % period) < period / 2) / len(flat) - 0.5) < 0.02


def test_closed_loop_items_carry_no_arrival():
    w = wl.generate(spec(arrivals="closed", rate=None, users=2), vocab_size=10)
    assert w.closed and w.users == 2 and all(i.arrival_s is None for i in w.items)


def test_lengths_fixed_uniform_and_from_a_corpus(tmp_path):
    rng = random.Random(0)
    assert {wl.parse_lengths("7").draw(rng) for _ in range(20)} == {7}
    drawn = {wl.parse_lengths("3..6").draw(rng) for _ in range(200)}
    assert drawn == {3, 4, 5, 6}
    text = tmp_path / "docs.txt"
    text.write_text("one two three\nfour\n\nfive six\n\n\nseven\n")
    corpus = wl.parse_lengths(f"corpus:{text}")
    assert sorted(corpus.values) == [1, 2, 4] and corpus.kind == "corpus"
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "a b c d e"}\n{"text": "f"}\n')
    assert sorted(wl.parse_lengths(f"corpus:{jsonl}").values) == [1, 5]
    assert sorted(wl.corpus_lengths(jsonl, count_tokens=len)) == [1, 9]


@pytest.mark.parametrize("bad", ["0", "5..2", "abc", "1.5", "-3", "0..4", "corpus:/no/such/file"])
def test_bad_lengths_are_refused(bad):
    with pytest.raises(UsageError):
        wl.parse_lengths(bad)


def test_lengths_within_the_vocabulary_and_the_context():
    w = wl.generate(spec(requests=200), vocab_size=7)
    assert all(0 <= t < 7 for i in w.items for t in i.prompt)
    assert {len(i.prompt) for i in w.items} <= set(range(8, 33)) and all(i.max_new_tokens == 4 for i in w.items)
    with pytest.raises(UsageError, match="exceed the context"):
        wl.generate(spec(), vocab_size=7, max_context=30)
    with pytest.raises(UsageError, match="leave no prompt"):
        wl.check_lengths(wl.parse_lengths("8"), wl.parse_lengths("30"), 30)


def test_corpus_prompts_are_cut_to_the_context(tmp_path):
    text = tmp_path / "docs.txt"
    text.write_text(" ".join(["w"] * 100) + "\n\nshort doc\n")
    w = wl.generate(spec(requests=30, prompt_len=wl.parse_lengths(f"corpus:{text}")), vocab_size=10, max_context=40)
    assert {len(i.prompt) for i in w.items} == {2, 36}


@pytest.mark.parametrize("kw", [dict(rate=0.0), dict(rate=-1.0), dict(arrivals="closed", rate=None, users=0), dict(arrivals="bursty", amplitude=1.0),
                                dict(arrivals="bursty", rate=math.inf, amplitude=0.4), dict(requests=0), dict(arrivals="uniform")])
def test_bad_specs_are_refused(kw):
    with pytest.raises(UsageError):
        spec(**kw)


def test_a_saved_workload_loads_back_equal(tmp_path):
    for kw in (dict(), dict(rate=math.inf), dict(arrivals="closed", rate=None, users=4)):
        w = wl.generate(spec(**kw), vocab_size=50)
        wl.save(w, tmp_path / "w.jsonl")
        assert wl.load(tmp_path / "w.jsonl") == w
    assert wl.load(tmp_path / "w.jsonl").users == 4


def test_a_file_that_is_not_a_workload_is_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"model": "llama-tiny"}\n')
    with pytest.raises(UsageError, match="not a workload file"):
        wl.load(bad)
    w = wl.generate(spec(), vocab_size=50)
    wl.save(w, bad)
    bad.write_text("\n".join(bad.read_text().splitlines()[:-1]) + "\n")
    with pytest.raises(UsageError, match="header says 50"):
        wl.load(bad)
    with pytest.raises(UsageError, match="is not a file"):
        wl.load(tmp_path / "missing.jsonl")
