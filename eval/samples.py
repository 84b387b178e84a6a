"""Quality of a decoder's own samples: generative perplexity under a scorer model.

    from eval.samples import prompts_from_text, generative_perplexity
    prompts = prompts_from_text(tokenizer, "corpus/", split="test", n=60, length=64, seed=0)
    generative_perplexity(generator, scorer, prompts, new_tokens=64)
    -> {"gen_ppl": ..., "scorer_nll": ..., "distinct": ..., "samples": 60, "new_tokens": 64}

lm-eval's tasks score given text; they cannot tell whether a decoder writes good text, and for
Mask-Predict that is exactly what its number of refinement passes T changes (with T = 1 every
canvas token is predicted at once, independently of the others). The usual measure for
masked-diffusion decoders (MDLM, LLaDA) is the generative perplexity: continue held-out prompts with
the decoder's own greedy decoding, then score the continuations with an autoregressive model of the
same tokenizer. `gen_ppl` = exp(mean negative log-likelihood per generated token under the scorer);
`distinct` = distinct tokens / generated tokens over all samples, since a decoder that repeats one
token gets a low perplexity from most scorers.
"""

import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from decoders.base import AutoregressiveDecoder, UsageError
from eval.corpus import documents


def held_out_split(text: str) -> str:
    """"test" for a corpus folder with test* files, else "valid" (the split held out from training)."""
    return "test" if Path(text).is_dir() and any(Path(text).glob("test*")) else "valid"


def prompts_from_text(tokenizer, text: str, *, split: str = "test", n: int = 60, length: int = 64, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` tokens: a random window of each of the first documents of `text` (a
    corpus folder, file or datasets name) long enough to hold one, at most one prompt per document
    until every document has given one."""
    docs = []
    for doc in documents(text, split):
        ids = tokenizer.encode(doc, add_special_tokens=False)
        if len(ids) >= length:
            docs.append(ids)
    if not docs:
        raise UsageError(f"{text} ({split}): no document of {length} tokens or more to take prompts from")
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        ids = docs[len(prompts) % len(docs)]
        start = rng.randrange(len(ids) - length + 1)
        prompts.append(ids[start : start + length])
    return prompts


@torch.inference_mode()
def generative_perplexity(generator, scorer: AutoregressiveDecoder, prompts: list[list[int]], *, new_tokens: int,
                          batch_size: int = 16) -> dict:
    """Greedy continuations of `prompts` by `generator`, scored by `scorer` (same vocabulary)."""
    if not isinstance(scorer, AutoregressiveDecoder):
        raise UsageError("the scorer of generative perplexity must be an autoregressive model")
    if generator.vocab_size != scorer.vocab_size:
        raise UsageError(f"generator and scorer vocabularies differ ({generator.vocab_size} and {scorer.vocab_size} tokens)")
    nll, count, generated = 0.0, 0, []
    for i in range(0, len(prompts), batch_size):
        part = prompts[i : i + batch_size]
        samples = [seq[:new_tokens] for seq in generator.generate(part, max_new_tokens=new_tokens).tokens]
        generated.extend(samples)
        width = max(len(p) + len(s) for p, s in zip(part, samples))
        # Right padding: the scorer is causal, so the pad never changes the logits before it.
        tokens = torch.tensor([p + s + [0] * (width - len(p) - len(s)) for p, s in zip(part, samples)], device=scorer.device)
        logp = F.log_softmax(scorer.logits(tokens).float(), dim=-1)
        for row, (p, s) in enumerate(zip(part, samples)):
            # position t predicts token t + 1: the sample's tokens are predicted from len(p) - 1 on
            target = torch.tensor(s, device=scorer.device)
            nll -= logp[row, len(p) - 1 : len(p) - 1 + len(s)].gather(-1, target[:, None]).sum().item()
            count += len(s)
    flat = [t for s in generated for t in s]
    return {"gen_ppl": math.exp(nll / count), "scorer_nll": nll / count, "distinct": len(set(flat)) / len(flat),
            "samples": len(prompts), "new_tokens": new_tokens}
