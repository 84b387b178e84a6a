"""eval.samples: prompts from held-out text and the generative perplexity of a decoder's samples."""

import math

import pytest
import torch
import torch.nn.functional as F

import decoders
from decoders.base import UsageError
from eval import quality
from eval.samples import generative_perplexity, prompts_from_text
from eval.tokenizer import tokenizer_for


def load(preset, **options):
    return decoders.load(preset, device="cpu", dtype="float32", impl="ref", seed=1, **options)


def test_prompts_are_windows_of_the_split(tmp_path, write_corpus):
    corpus = write_corpus(tmp_path / "corpus", docs=4)
    tok = tokenizer_for(load("llama-tiny"))
    docs = [tok.encode(d, add_special_tokens=False) for d in quality_documents(corpus)]
    prompts = prompts_from_text(tok, str(corpus), split="valid", n=6, length=20, seed=3)
    assert len(prompts) == 6 and all(len(p) == 20 for p in prompts)
    for i, p in enumerate(prompts):
        doc = docs[i % len(docs)]
        assert any(doc[s : s + 20] == p for s in range(len(doc) - 19))
    assert prompts == prompts_from_text(tok, str(corpus), split="valid", n=6, length=20, seed=3)
    with pytest.raises(UsageError, match="no document"):
        prompts_from_text(tok, str(corpus), split="valid", n=2, length=10**6)


def quality_documents(corpus):
    from eval.corpus import documents

    return list(documents(str(corpus), "valid"))


@pytest.mark.parametrize("iterations", [1, 4])
def test_generative_perplexity_is_the_scorers_likelihood_of_the_samples(iterations):
    generator, scorer = load("maskpredict-tiny", iterations=iterations), load("llama-tiny")
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    got = generative_perplexity(generator, scorer, prompts, new_tokens=6, batch_size=2)
    samples = generator.generate(prompts, max_new_tokens=6).tokens
    nll = 0.0
    for p, s in zip(prompts, samples):
        logp = F.log_softmax(scorer.logits(torch.tensor([p + s]))[0].float(), dim=-1)
        nll -= sum(logp[len(p) - 1 + i, t].item() for i, t in enumerate(s))
    assert got["scorer_nll"] == pytest.approx(nll / 18, rel=1e-5)
    assert got["gen_ppl"] == pytest.approx(math.exp(nll / 18), rel=1e-5)
    assert got["distinct"] == len({t for s in samples for t in s}) / 18 and got["samples"] == 3


def test_scorer_must_be_autoregressive_with_the_same_vocabulary():
    with pytest.raises(UsageError, match="autoregressive"):
        generative_perplexity(load("llama-tiny"), load("maskpredict-tiny"), [[5, 6]], new_tokens=2)
    with pytest.raises(UsageError, match="vocabularies differ"):
        generative_perplexity(load("maskpredict-tiny"), load("llama-30m"), [[5, 6]], new_tokens=2)


def test_quality_records_genppl_for_maskpredict_runs_only(tmp_path, monkeypatch, write_corpus):
    """The CLI end to end on tiny presets: declab_genppl for each T of the Mask-Predict run, none for
    the autoregressive one, in quality.jsonl and in the table."""
    pytest.importorskip("lm_eval")
    from eval.tasks import make

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    corpus = write_corpus(tmp_path / "corpus", docs=6)
    tasks = tmp_path / "tasks"
    make.make(tasks, seed=0, text=str(corpus), n_docs=2, mqar_pairs=(4,), copy_lengths=(64,), ppl_docs_n=2)
    quality.main(["--checkpoints", "llama-tiny", "maskpredict-tiny", "--tasks", "declab_mqar_4", "--include-path", str(tasks),
                  "--model-args", "dtype=float32,device=cpu,impl=ref,max_length=128,batch_size=4", "--limit", "2",
                  "--mp-iterations", "1,2", "--genppl-scorer", "llama-tiny", "--genppl-text", str(corpus),
                  "--genppl-prompts", "3", "--genppl-tokens", "8", "--out", str(tmp_path / "out")])
    runs = quality.runs_from_jsonl(tmp_path / "out" / "quality.jsonl")
    assert [(r["checkpoint"], r["iterations"], quality.GENPPL_TASK in r["results"]) for r in runs] == [
        ("llama-tiny", None, False), ("maskpredict-tiny", 1, True), ("maskpredict-tiny", 2, True)]
    metrics = runs[1]["results"][quality.GENPPL_TASK]
    assert metrics["samples,none"] == 3 and metrics["new_tokens,none"] == 8
    assert metrics["gen_ppl,none"] == pytest.approx(math.exp(metrics["scorer_nll,none"]), rel=1e-9)
    # distinct is a count of distinct tokens over the 3 x 8 generated ones.
    assert metrics["distinct,none"] * 24 == pytest.approx(round(metrics["distinct,none"] * 24), abs=1e-9)
    assert "declab_genppl (gen_ppl)" in (tmp_path / "out" / "quality.md").read_text()
