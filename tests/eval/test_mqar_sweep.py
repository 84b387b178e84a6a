"""eval.mqar_sweep: the synthetic MQAR sequences, the accuracy read at the right positions (an oracle
scores 1, a shifted oracle 0), a tiny grid end to end with resumption, and one-line refusals."""

import json
import re

import pytest
import torch

from eval import mqar_sweep


def test_answers_are_the_values_paired_with_their_query_keys():
    tokens, answers = mqar_sweep.mqar_batch(16, 5, 32, torch.Generator().manual_seed(0))
    assert tokens.shape == answers.shape == (16, 32) and answers.sum(1).tolist() == [5] * 16
    for row, mask in zip(tokens.tolist(), answers.tolist()):
        pairs = dict(zip(row[0:10:2], row[1:10:2]))
        assert len(pairs) == 5 and all(k in mqar_sweep.KEYS and v in mqar_sweep.VALUES for k, v in pairs.items())
        queries = [(row[i - 1], row[i]) for i, m in enumerate(mask) if m]
        assert sorted(k for k, _ in queries) == sorted(pairs) and all(pairs[k] == v for k, v in queries)
        assert set(row[10:22]) == {mqar_sweep.FILLER}


class Oracle(torch.nn.Module):
    """Logits that put all mass on the answer: the value paired with the key just read (or, for
    Mask-Predict, with the key before the masked position); `shift` offsets every answer."""

    def __init__(self, masked: bool, shift: int = 0):
        super().__init__()
        self.masked, self.shift = masked, shift

    def hidden(self, tokens):
        """The logits themselves, as the "hidden states" the identity head maps to logits."""
        B, T = tokens.shape
        out = torch.zeros(B, T, mqar_sweep.VOCAB)
        for b, row in enumerate(tokens.tolist()):
            pairs = {}
            for i in range(0, T - 1):
                if row[i] in mqar_sweep.KEYS and row[i + 1] in mqar_sweep.VALUES and row[i] not in pairs:
                    pairs[row[i]] = row[i + 1]
            for i in range(T):
                key = row[i - 1] if self.masked else row[i]
                if (row[i] == mqar_sweep.MASK or not self.masked) and key in pairs:
                    values = mqar_sweep.VALUES
                    out[b, i, (pairs[key] + self.shift - values.start) % len(values) + values.start] = 1.0
        return out

    def head(self, h):
        return h


@pytest.mark.parametrize("family", ["transformer", "maskpredict"])
def test_accuracy_reads_the_answer_positions(family):
    class Dec:
        device = torch.device("cpu")

    dec = Dec()
    dec.family = family
    dec.model = Oracle(masked=family == "maskpredict")
    assert mqar_sweep.accuracy(dec, 6, 40, sequences=10, batch=4, seed=0) == 1.0
    dec.model = Oracle(masked=family == "maskpredict", shift=1)
    assert mqar_sweep.accuracy(dec, 6, 40, sequences=10, batch=4, seed=0) == 0.0


def test_tiny_grid_records_every_run_and_resumes(tmp_path, capsys):
    args = ["--out", str(tmp_path), "--widths", "32", "--points", "2:16", "--steps", "2", "--lrs", "1e-3", "--eval-sequences", "4", "--batch", "2", "--device", "cpu"]
    mqar_sweep.main(args)
    records = [json.loads(line) for line in (tmp_path / "mqar.jsonl").read_text().splitlines()]
    assert sorted(r["family"] for r in records) == sorted(mqar_sweep.FAMILIES)
    assert all(r["state_bytes"] > 0 and r["params"] > 0 and r["steps"] == 2 for r in records)
    # Attention's state is the KV cache at seq_len (2 layers x K and V x 32 dims x 16 positions x fp32)
    # and the short convolution's window (2 inputs of 32 floats).
    assert next(r for r in records if r["family"] == "transformer")["state_bytes"] == 2 * 2 * 32 * 16 * 4 + 2 * 32 * 4
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["acc"]) == {f"{f}/w32/n2/t16" for f in mqar_sweep.FAMILIES}
    assert (tmp_path / "mqar_width.png").stat().st_size > 0 and (tmp_path / "mqar_state.png").stat().st_size > 0
    # The table ends with what knowing the context's values without recall scores: 1 / pairs.
    assert (tmp_path / "mqar.md").read_text().splitlines()[-1].endswith("| 0.500 |")
    # A rerun trains nothing new, and one more width trains only its runs.
    mqar_sweep.main(args)
    assert len((tmp_path / "mqar.jsonl").read_text().splitlines()) == 4
    mqar_sweep.main([*args[:3], "32,64", *args[4:], "--families", "mamba2"])
    lines = [json.loads(line) for line in (tmp_path / "mqar.jsonl").read_text().splitlines()]
    assert len(lines) == 5 and lines[-1]["family"] == "mamba2" and lines[-1]["width"] == 64


@pytest.mark.parametrize("bad, message", [
    (["--points", "8:16"], "4 \\* pairs <= seq_len"),
    (["--widths", "48"], "multiples of 32"),
    (["--families", "gpt"], "unknown gpt"),
    (["--lrs", "x"], "could not be read"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--processes", "0"], "--processes must be >= 1"),
    (["--short-conv", "-1"], "--short-conv must be >= 0"),
])
def test_bad_options_are_one_line_and_exit_2(bad, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        mqar_sweep.main(["--out", str(tmp_path), *bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert re.search(message, err)
    assert not (tmp_path / "mqar.jsonl").exists()



def test_processes_give_the_records_of_one_process(tmp_path, capsys):
    """--processes 2: the same runs and results as one process (each run seeded on its own), each
    record appended once; a rerun trains nothing."""
    args = ["--widths", "32,64", "--points", "2:16", "--steps", "2", "--lrs", "1e-3", "--eval-sequences", "4", "--batch", "2", "--device", "cpu",
            "--families", "transformer,rwkv7"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs
    try:
        mqar_sweep.main(["--out", str(tmp_path / "one"), *args])
    finally:
        torch.set_num_threads(threads)
    mqar_sweep.main(["--out", str(tmp_path / "two"), *args, "--processes", "2"])
    stable = ("family", "width", "pairs", "seq_len", "lr", "steps", "acc", "final_loss", "params", "state_bytes")
    one = {mqar_sweep.key(r): r for r in map(json.loads, (tmp_path / "one" / "mqar.jsonl").read_text().splitlines())}
    lines = (tmp_path / "two" / "mqar.jsonl").read_text().splitlines()
    two = {mqar_sweep.key(r): r for r in map(json.loads, lines)}
    assert len(lines) == len(two) == len(one) == 4
    assert {k: [r[f] for f in stable] for k, r in two.items()} == {k: [r[f] for f in stable] for k, r in one.items()}
    assert {r["processes"] for r in two.values()} == {2}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["acc"].keys() == {f"{f}/w{w}/n2/t16" for f in ("transformer", "rwkv7") for w in (32, 64)}
    mqar_sweep.main(["--out", str(tmp_path / "two"), *args, "--processes", "2"])
    assert len((tmp_path / "two" / "mqar.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize("family", mqar_sweep.FAMILIES)
def test_no_model_reads_an_answer(family):
    """After the pairs, a model reads only the query keys and filler (or masks): no value a model
    could use to narrow an answer to the values not yet asked for."""
    seen = []

    class Spy(torch.nn.Module):
        def hidden(self, tokens):
            seen.append(tokens)
            return torch.zeros(*tokens.shape, mqar_sweep.VOCAB)

        def head(self, h):
            return h

    class Dec:
        device = torch.device("cpu")

    dec = Dec()
    dec.family, dec.model = family, Spy()
    tokens, answers = mqar_sweep.mqar_batch(8, 6, 40, torch.Generator().manual_seed(1))
    _, target = mqar_sweep.answer_logits(dec, tokens, answers)
    after_pairs = seen[0][:, 12:]
    assert target.tolist() == tokens[answers].tolist()
    assert not any(v in mqar_sweep.VALUES for v in after_pairs.flatten().tolist())
    assert sorted(seen[0][:, :12].flatten().tolist()) == sorted(tokens[:, :12].flatten().tolist())


@pytest.mark.parametrize("family", mqar_sweep.FAMILIES)
def test_answer_logits_are_the_full_forwards_at_the_answers(family):
    """The head applied only at the answers gives the logits the whole forward gives there."""
    dec = mqar_sweep.build(family, 64, 1, device=torch.device("cpu"), seed=0)
    tokens, answers = mqar_sweep.mqar_batch(3, 4, 24, torch.Generator().manual_seed(2))
    logits, target = mqar_sweep.answer_logits(dec, tokens, answers)
    seen = mqar_sweep.model_input(family, tokens, answers)
    with torch.no_grad():
        if family == "maskpredict":
            full = dec.model(seen)[answers]
        else:
            kwargs = {"impl": "ref"} if family in ("mamba2", "rwkv7") else {}
            full = dec.model(seen[:, :-1], **kwargs)[answers[:, 1:]]
    assert logits.shape == (12, mqar_sweep.VOCAB) and target.tolist() == tokens[answers].tolist()
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)


def test_short_conv_is_causal_and_only_for_attention():
    """The attention families read their embeddings through a causal convolution of the width asked
    for: a token changes no earlier position's input, changes the next k - 1 positions' and no later
    one's; without `short_conv` the embedding is plain; the recurrences keep their own local path
    and get none."""
    dec = mqar_sweep.build("transformer", 64, 1, device=torch.device("cpu"), seed=0, short_conv=3)
    embed = dec.model.model.embed_tokens
    assert isinstance(embed, mqar_sweep.ShortConv) and embed.conv.kernel_size == (3,)
    tokens = torch.randint(1, 4096, (1, 12))
    changed = tokens.clone()
    changed[0, 6] = 5000
    with torch.no_grad():
        a, b = embed(tokens), embed(changed)
    assert torch.equal(a[0, :6], b[0, :6]) and not torch.allclose(a[0, 7:9], b[0, 7:9]) and torch.equal(a[0, 9:], b[0, 9:])
    assert torch.equal(embed.weight, embed.embed.weight)
    assert not isinstance(mqar_sweep.build("transformer", 64, 1, device=torch.device("cpu"), seed=0).model.model.embed_tokens,
                          mqar_sweep.ShortConv)
    for family in ("mamba2", "rwkv7"):
        assert mqar_sweep.short_conv_of(family, 3) == 0
        assert not any(isinstance(m, mqar_sweep.ShortConv) for m in mqar_sweep.build(family, 64, 1, device=torch.device("cpu"),
                                                                                     seed=0, short_conv=3).model.modules())
    assert mqar_sweep.short_conv_of("maskpredict", 3) == 3


def test_records_without_the_short_conv_are_runs_without_it():
    """The resume key holds the convolution's width, and a record from before it existed counts as width 0:
    a sweep with the convolution retrains the attention runs and keeps the recurrent ones."""
    run = {"family": "transformer", "width": 64, "layers": 2, "pairs": 8, "seq_len": 64, "lr": 1e-3, "steps": 10, "batch": 4, "seed": 0}
    assert mqar_sweep.key(run) == mqar_sweep.key({**run, "short_conv": 0}) != mqar_sweep.key({**run, "short_conv": 3})
    a = mqar_sweep.parse_args(["--families", "transformer,rwkv7", "--widths", "64", "--points", "2:16", "--lrs", "1e-3"])
    assert {(g["family"], g["short_conv"]) for g in mqar_sweep.grid(a)} == {("transformer", 3), ("rwkv7", 0)}
