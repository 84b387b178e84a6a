"""The offline tasks: deterministic generation, and loading through lm-eval with HF_DATASETS_OFFLINE=1."""

import json

import pytest

pytest.importorskip("lm_eval")

from eval.tasks import make  # noqa: E402


def test_make_is_deterministic_in_the_seed(tmp_path, write_corpus):
    corpus = write_corpus(tmp_path / "corpus")
    a = make.make(tmp_path / "a", seed=3, text=str(corpus), n_docs=10, mqar_pairs=(4, 16))
    make.make(tmp_path / "b", seed=3, text=str(corpus), n_docs=10, mqar_pairs=(4, 16))
    make.make(tmp_path / "c", seed=4, text=str(corpus), n_docs=10, mqar_pairs=(4, 16))
    for name in ("declab_mqar_16", "declab_copy_512", "declab_cloze", "declab_ppl"):
        assert (tmp_path / "a" / f"{name}.jsonl").read_text() == (tmp_path / "b" / f"{name}.jsonl").read_text()
    assert (tmp_path / "a" / "declab_mqar_16.jsonl").read_text() != (tmp_path / "c" / "declab_mqar_16.jsonl").read_text()
    assert "declab_mqar" in a and "declab_ppl" in a


def test_mqar_answer_is_in_the_pairs(tmp_path):
    for doc in make.mqar_docs(8, 20, 256, seed=0):
        pairs = dict(p.split(":") for p in doc["context"].split(" |")[0].split(" "))
        key = doc["context"].rsplit(" ", 1)[-1].rstrip(":")
        assert len(pairs) == 8 and pairs[key] == doc["target"]
        # the open key was not asked before in the query section
        assert doc["context"].split(" | ")[-1].count(f"{key}:") == 1


def test_local_tasks_load_offline(tmp_path, monkeypatch, write_corpus):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "tasks"
    make.make(out, seed=0, text=str(corpus), n_docs=6, mqar_pairs=(4, 8), copy_lengths=(64,))
    from lm_eval.tasks import TaskManager

    loaded = TaskManager(include_path=str(out)).load(["declab_mqar", "declab_copy_64", "declab_ppl", "declab_cloze"])
    leaves = loaded["tasks"]
    assert set(loaded["groups"]) == {"declab_mqar"}
    assert set(leaves) == {"declab_mqar_4", "declab_mqar_8", "declab_copy_64", "declab_ppl", "declab_cloze"}
    docs = list(leaves["declab_mqar_4"].test_docs())
    assert len(docs) == 6 and docs[0]["context"].endswith(":")
    assert leaves["declab_ppl"].OUTPUT_TYPE == "loglikelihood_rolling"


def test_simple_evaluate_declab_offline(tmp_path, monkeypatch, write_corpus):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    corpus = write_corpus(tmp_path / "corpus", docs=6)
    out = tmp_path / "tasks"
    make.make(out, seed=0, text=str(corpus), n_docs=2, mqar_pairs=(4,), copy_lengths=(64,), ppl_docs_n=2)
    import lm_eval
    from lm_eval.tasks import TaskManager

    import eval.lm_model  # noqa: F401  (registers declab)

    res = lm_eval.simple_evaluate(
        model="declab", model_args="pretrained=llama-tiny,dtype=float32,device=cpu,impl=ref,max_length=128,batch_size=4",
        tasks=["declab_mqar_4", "declab_ppl"], task_manager=TaskManager(include_path=str(out)), limit=2,
    )
    # acc is whether the decoder's own greedy decoding (prefill/step, not the scored logits) writes the
    # target after the context as the model sees it (the last max_length + 1 tokens of context + target).
    lm = eval.lm_model.DecLabLM(pretrained="llama-tiny", dtype="float32", device="cpu", impl="ref", max_length=128)
    docs = list(TaskManager(include_path=str(out)).load(["declab_mqar_4"])["tasks"]["declab_mqar_4"].test_docs())[:2]
    hits = []
    for doc in docs:
        ctx, cont = lm._encode_pair(doc["context"], doc["target"])
        seen = ctx[-(lm.max_length + 1 - len(cont)) :]
        hits.append(lm.decoder.generate([seen], max_new_tokens=len(cont)).tokens[0] == cont)
    assert res["results"]["declab_mqar_4"]["acc,none"] == sum(hits) / len(hits)
    # A random model over 512 tokens: about log2(512) = 9 bits per byte-level token.
    assert 7 < res["results"]["declab_ppl"]["bits_per_byte,none"] < 11
    json.dumps(res["results"])
