"""The `declab` lm-eval model against lm-eval's own `hf` model on one tiny HF Llama checkpoint and its
tokenizer: the same loglikelihood (empty contexts, trailing spaces, a context already starting with
BOS), rolling loglikelihood (several windows, the beginning of sequence scored as `hf` scores it) and
greedy generate_until, for a tokenizer that adds BOS (Llama-style) and one that does not (GPT-2-style)."""

import math

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from eval.lm_model import DecLabLM  # noqa: E402

TEXT = "the quick brown fox jumps over the lazy dog. a cat sat on the mat, then ran home far away. " * 4
MAX_LENGTH = 40


def save_checkpoint(folder, adds_bos: bool):
    """A 2-layer Llama with a byte-level BPE learnt from TEXT, written by transformers' save_pretrained."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>"] if adds_bos else ["<|endoftext|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer=trainer)
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    else:
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    # A wide initialisation keeps the random model's logits far apart, so greedy choices are not near-ties.
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.25,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=[True, False], ids=["bos-adding", "no-bos"])
def pair(request, tmp_path_factory):
    folder = save_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)
    hf = HFLM(pretrained=str(folder), dtype="float32", device="cpu", max_length=MAX_LENGTH, batch_size=2)
    ours = DecLabLM(pretrained=str(folder), dtype="float32", device="cpu", impl="ref", max_length=MAX_LENGTH, batch_size=2)
    return request.param, hf, ours


def test_ref_tokenisation_follows_the_tokenizer(pair):
    adds_bos, hf, ours = pair
    for text in ("the cat", "", ours.tokenizer.bos_token + "the cat"):
        assert ours.tok_encode(text) == hf.tok_encode(text)
    assert (ours.tok_encode("the cat")[0] == ours.tokenizer.bos_token_id) == adds_bos
    assert ours.prefix_token_id == hf.prefix_token_id


def test_ref_loglikelihood_matches_hf(pair):
    _, hf, ours = pair
    bos = ours.tokenizer.bos_token
    args = [("the quick", " brown fox"), ("", "the cat"), ("a cat sat on  ", "the mat"), (bos + "then ran", " home"), (TEXT, " far away")]
    reqs = [Instance("loglikelihood", {}, a, i) for i, a in enumerate(args)]
    want = hf.loglikelihood(reqs, disable_tqdm=True)
    got = ours.loglikelihood(reqs, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(got, want):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) and ga == gb


def test_ref_loglikelihood_rolling_matches_hf(pair):
    adds_bos, hf, ours = pair
    texts = ["a cat sat on the mat.", TEXT]
    assert len(ours.tok_encode(TEXT)) > 3 * MAX_LENGTH
    reqs = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    want = hf.loglikelihood_rolling(reqs, disable_tqdm=True)
    got = ours.loglikelihood_rolling(reqs, disable_tqdm=True)
    for a, b in zip(got, want):
        assert math.isclose(a, b, rel_tol=1e-4)
    if adds_bos:
        # The beginning of sequence counts: the same text without the tokenizer's BOS scores differently.
        ours.add_bos_token = False
        try:
            without = ours.loglikelihood_rolling(reqs[:1], disable_tqdm=True)[0]
        finally:
            ours.add_bos_token = None
        assert abs(without - want[0]) > 0.1

def test_ref_greedy_generate_until_matches_hf(pair):
    _, hf, ours = pair
    gen = {"until": ["."], "max_gen_toks": 12, "do_sample": False}
    free = {"until": [], "max_gen_toks": 9, "do_sample": False}
    args = [("the quick brown", gen), ("a cat", gen), ("then ran home far", free), ("the", free)]
    reqs = [Instance("generate_until", {}, a, i) for i, a in enumerate(args)]
    want = hf.generate_until(reqs, disable_tqdm=True)
    got = ours.generate_until(reqs, disable_tqdm=True)
    assert got == want
    assert any(len(t) >= 6 for t in want)
