"""The lab as an lm-eval model, registered as `declab`: any family, from a preset or a checkpoint folder.

    lm_eval.simple_evaluate(model="declab", model_args="pretrained=llama-tiny,dtype=float32", tasks=[...])
    python -m eval.lm_eval --model declab --model_args pretrained=runs/llama-30m,max_length=2048 --tasks ...

Importing this module registers the model. Requests are answered as lm-eval's own HF model does:

- `loglikelihood`: lm-eval's `TemplateLM` splits context and continuation (trailing whitespace of
  the context moves into the continuation; an empty context becomes the prefix token). The
  autoregressive families score (context + continuation)[-(max_length+1):-1] in one parallel forward
  (`Decoder.logits`) and sum the log-softmax over the continuation; `is_greedy` is whether every
  continuation token is the argmax (which is greedy decoding). Mask-Predict answers with its
  Monte-Carlo bound (`Decoder.loglikelihood(..., samples=)`), and `is_greedy` is whether its own
  greedy decoding (iterations, rule, ... from model_args) writes exactly the continuation (decoded
  in one batch per continuation length; not decoded for rolling windows, which never read it).
- `loglikelihood_rolling`: lm-eval's `get_rolling_token_windows` + `make_disjoint_window` with
  context 1, so every token is scored exactly once, in windows of `max_length`.
- `generate_until`: the decoder's own prefill/step (Mask-Predict decodes its way), cut at the first
  stop string, after `max_gen_toks` tokens or at end-of-sequence; the autoregressive families stop
  stepping once every sequence in the batch has hit one.

Beginning of sequence, as lm-eval's `hf` model: text is encoded with the tokenizer's own special
tokens (a Llama tokenizer prepends BOS, a GPT-2 one does not) unless `add_bos_token` says otherwise,
and a string that already starts with the BOS text gets no second one. Rolling windows encode the
document that way too, so with a BOS-adding tokenizer the first scored token is that BOS, predicted
from the prefix token, exactly as `hf` scores it. The prefix token is `prefix_token_id`, else the
tokenizer's BOS, else its EOS.

Requests are batched longest first (`Collator`). Model arguments: pretrained (preset or folder),
dtype, device, impl, max_length, batch_size, family, seed, samples (Mask-Predict Monte-Carlo
samples), add_bos_token, prefix_token_id, quant (weight quantisation, `decoders.load`'s: int8 or
int4-rtn on the fly; a quantised folder loads as quantised without it); any other argument goes to
the family (`decoders.load(..., **options)`, e.g. page_size).
"""

import inspect
import logging

# lm-eval fills its model registry from lm_eval.models only while the registry is empty: import it
# before registering `declab`, or the built-in models (hf, ...) would disappear from this process.
import lm_eval.models  # noqa: F401
import torch
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator
from tqdm import tqdm

import decoders
from decoders.base import AutoregressiveDecoder, StepOut
from decoders.sampling import Sampling
from eval.tokenizer import tokenizer_for

log = logging.getLogger(__name__)
DEFAULT_MAX_LENGTH = 2048
# Autoregressive generation checks the stop strings every this many steps (one host sync each).
STOP_CHECK_EVERY = 8


@register_model("declab")
class DecLabLM(TemplateLM):
    """One lab decoder (any family) answering lm-eval's three request types."""

    def __init__(
        self,
        pretrained: str,
        dtype: str | None = None,
        device: str | None = None,
        impl: str = "auto",
        max_length: int | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        family: str | None = None,
        seed: int = 0,
        samples: int = 16,
        add_bos_token: bool | str | None = None,
        prefix_token_id: int | None = None,
        quant: str | None = None,
        **options,
    ):
        super().__init__()
        self.add_bos_token = parse_optional_bool(add_bos_token)
        self.custom_prefix_token_id = None if prefix_token_id is None else int(prefix_token_id)
        dtype = None if dtype in (None, "auto") else dtype
        quant = None if quant in (None, "none") else str(quant)
        self.decoder = decoders.load(str(pretrained), family=family, device=device, dtype=dtype, impl=impl, seed=int(seed), quant=quant,
                                     **options)
        self.tokenizer = tokenizer_for(self.decoder)
        self.decoder.tokenizer = self.tokenizer
        self._device = self.decoder.device
        self.pretrained = str(pretrained)
        self._max_length = int(max_length) if max_length else min(self.decoder.max_context or DEFAULT_MAX_LENGTH, DEFAULT_MAX_LENGTH)
        self.batch_size = parse_batch_size(batch_size, max_batch_size)
        self.samples = int(samples)
        self.autoregressive = isinstance(self.decoder, AutoregressiveDecoder)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """As lm-eval's, except that model_args win over the CLI's --batch_size/--device defaults."""
        return cls.create_from_arg_obj(utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        # lm-eval's CLI passes device="cuda:0" even when --device is not given: on a machine without
        # CUDA that default is dropped (a device in model_args is always obeyed).
        if str(extra.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
            log.warning("no CUDA device: ignoring lm-eval's device=%s (put device=... in model_args to choose)", extra.pop("device"))
        check_model_args(arg_dict)
        return cls(**arg_dict, **extra)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        return self.decoder.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path or self.pretrained

    def get_model_info(self) -> dict:
        return {"declab": self.decoder.describe(), "max_length": self.max_length}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids as `hf` encodes them: an explicit add_special_tokens wins, then add_bos_token, then the
        tokenizer's own default; with neither given, a string starting with the prefix token's text gets
        no special tokens added."""
        special = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            special = False
        if special is None:
            return self.tokenizer.encode(string)
        return self.tokenizer.encode(string, add_special_tokens=special)

    def encode_context(self, string: str) -> list[int]:
        """A generation prompt as `hf`'s batch encoding writes it (its BOS check reads the BOS text, not
        the prefix token's)."""
        special = self.add_bos_token
        bos = self.tokenizer.bos_token
        if bos is not None and string.startswith(bos):
            special = False
        if special is None:
            return self.tokenizer.encode(string)
        return self.tokenizer.encode(string, add_special_tokens=special)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    @torch.inference_mode()
    def score(self, batch: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of each continuation given its context, one padded forward."""
        inputs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for ctx, cont in batch]
        width = max(map(len, inputs))
        # Right padding: every family is causal, so the pad never changes the logits before it.
        tokens = torch.tensor([x + [0] * (width - len(x)) for x in inputs], device=self.device)
        logits = self.decoder.logits(tokens)  # [B, T, V] in the model dtype
        out = []
        for row, (x, (_, cont)) in enumerate(zip(inputs, batch)):
            n = len(cont)
            # [n, V] float32 log-probabilities of the positions that predict the continuation.
            lp = F.log_softmax(logits[row, len(x) - n : len(x)].float(), dim=-1)
            target = torch.tensor(cont, device=self.device)
            ll = lp.gather(-1, target[:, None]).sum().item()
            out.append((ll, bool((lp.argmax(-1) == target).all())))
        return out

    def score_montecarlo(self, batch: list[tuple[list[int], list[int], bool]]) -> list[tuple[float, bool]]:
        """Mask-Predict, for each (context, continuation, wants_greedy): the family's Monte-Carlo bound
        on log p(continuation | context), and whether the family's own greedy decoding (a canvas of
        len(continuation)) writes exactly the continuation. The decoding runs once per continuation
        length for all the requests of that length; a request that does not want it (a rolling
        window: its is_greedy is never read) gets False without decoding."""
        ctxs = [ctx[-max(1, self.max_length - len(cont)) :] for ctx, cont, _ in batch]
        lls = [float(self.decoder.loglikelihood(ctx, cont, samples=self.samples)) for ctx, (_, cont, _) in zip(ctxs, batch)]
        greedy = [False] * len(batch)
        by_length: dict[int, list[int]] = {}
        for i, (_, cont, wanted) in enumerate(batch):
            if wanted:
                by_length.setdefault(len(cont), []).append(i)
        for n, rows in by_length.items():
            decoded = self.decoder.generate([ctxs[i] for i in rows], max_new_tokens=n).tokens
            for i, tokens in zip(rows, decoded):
                greedy[i] = tokens[:n] == batch[i][1]
        return list(zip(lls, greedy))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        for _, ctx, cont in requests:
            if not ctx or not cont:
                raise ValueError("loglikelihood requests need a non-empty context and continuation after tokenisation")
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens is longer than max_length {self.max_length}")
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        out = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="declab loglikelihood")
        for chunk in order.get_batched(n=self.batch_size):
            if self.autoregressive:
                answers = self.score([(ctx, cont) for _, ctx, cont in chunk])
            else:
                # A request of None is a rolling window (loglikelihood_rolling), which needs no is_greedy.
                answers = self.score_montecarlo([(ctx, cont, request is not None) for request, ctx, cont in chunk])
            for (request, _, _), answer in zip(chunk, answers):
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
                out.append(answer)
            bar.update(len(chunk))
        bar.close()
        return order.get_original(out)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            for ctx, cont in map(utils.make_disjoint_window, rolling_windows(tokens, self.prefix_token_id, self.max_length)):
                windows.append((None, ctx, cont))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (ll, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[owner] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        args = [req.args for req in requests]
        encoded = {}
        for ctx, _ in args:
            encoded.setdefault(ctx, self.encode_context(ctx) or [self.prefix_token_id])
        order = Collator(args, sort_fn=lambda a: (-len(encoded[a[0]]), a[0]), group_by="gen_kwargs", group_fn=lambda a: a[1])
        out = []
        bar = tqdm(total=len(args), disable=disable_tqdm, desc="declab generate_until")
        for chunk in order.get_batched(n=self.batch_size):
            kwargs = dict(chunk[0][1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kwargs.pop("max_gen_toks", 256))
            sampling = gen_sampling(kwargs)
            room = max(1, self.max_length - max_gen)
            prompts = [encoded[ctx][-room:] for ctx, _ in chunk]
            for (ctx, gen_kwargs), text in zip(chunk, self.generate(prompts, max_gen, sampling, until)):
                self.cache_hook.add_partial("generate_until", (ctx, gen_kwargs), text)
                out.append(text)
            bar.update(len(chunk))
        bar.close()
        return order.get_original(out)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling, until: list[str]) -> list[str]:
        """New text per prompt, cut at end-of-sequence and at the first stop string."""
        dec = self.decoder
        state = dec.prefill(prompts, max_new_tokens=max_new_tokens, sampling=sampling)
        steps = []
        while not dec.finished(state):
            out = dec.step(state)
            steps.append(StepOut(out.tokens.clone(), out.committed.clone()))
            if self.autoregressive and len(steps) % STOP_CHECK_EVERY == 0:
                if all(self.stopped(t, until) for t in dec.output(state, steps)):
                    break
        tokens = dec.output(state, steps)
        dec.release(state)
        return [self.cut(t, until) for t in tokens]

    def stopped(self, tokens: list[int], until: list[str]) -> bool:
        return self.eot_token_id in tokens or any(s in self.tok_decode(tokens) for s in until)

    def cut(self, tokens: list[int], until: list[str]) -> str:
        if self.eot_token_id in tokens:
            tokens = tokens[: tokens.index(self.eot_token_id)]
        text = self.tok_decode(tokens)
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return text


def rolling_windows(tokens: list[int], prefix: int, max_length: int):
    """lm-eval's rolling windows with context 1: (input, predicted) pairs covering each token once."""
    return utils.get_rolling_token_windows(token_list=tokens, prefix_token=prefix, max_seq_len=max_length, context_len=1)


def parse_optional_bool(value) -> bool | None:
    """None, or a bool from a bool or lm-eval's model_args text ("True", "false", ...)."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise decoders.UsageError(f"add_bos_token={value!r}: expected True or False")
    return text == "true"


# model_args DecLabLM reads as whole numbers (each at least 1, seed at least 0).
INT_ARGS = ("max_length", "max_batch_size", "seed", "samples")


def check_model_args(args: dict) -> None:
    """Raise UsageError for model_args the `declab` model cannot take, before anything is built: no
    pretrained, a preset or checkpoint that does not exist or is incomplete, an argument neither the
    model nor the family takes, a count that is not a whole number, a batch size that is neither a
    number nor "auto"."""
    if not args.get("pretrained"):
        raise decoders.UsageError("model_args need pretrained=<preset or checkpoint folder>")
    family = args.get("family") or decoders.check_model(str(args["pretrained"]))
    if args.get("family"):
        decoders.family_class(family)
    own = [p for p in inspect.signature(DecLabLM.__init__).parameters if p not in ("self", "options")]
    options = decoders.family_options(family)
    unknown = [k for k in args if k not in own and k not in options]
    if unknown:
        raise decoders.UsageError(f"unknown model argument {unknown[0]!r} for declab (known: {', '.join(own + options)})")
    for key in INT_ARGS:
        value = args.get(key)
        least = 0 if key == "seed" else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise decoders.UsageError(f"model argument {key}={value!r} must be a whole number >= {least}")
    batch = args.get("batch_size")
    if batch is not None and not str(batch).startswith("auto") and (not str(batch).isdigit() or int(batch) < 1):
        raise decoders.UsageError(f"model argument batch_size={batch!r} must be a whole number >= 1 or auto")
    if "page_size" in args:
        decoders.check_page_size(args["page_size"])
    if args.get("device") is not None:
        decoders.parse_device(str(args["device"]))
    if args.get("dtype") not in (None, "auto"):
        decoders.parse_dtype(str(args["dtype"]))
    if args.get("quant") not in (None, "none"):
        from decoders.quant import check_load_quant

        check_load_quant(str(args["pretrained"]), str(args["quant"]))


def parse_batch_size(batch_size, max_batch_size) -> int:
    """An int; lm-eval's "auto" (no auto-tuning here) means max_batch_size, or 32."""
    text = str(batch_size)
    if text.startswith("auto"):
        return int(max_batch_size or 32)
    return int(text)


def gen_sampling(kwargs: dict) -> Sampling:
    """lm-eval's generation kwargs (do_sample, temperature, top_k, top_p, seed) as the lab's Sampling."""
    # As HF generate: without do_sample=True decoding is greedy whatever the temperature.
    temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
    return Sampling(temperature=temperature, top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0), seed=int(kwargs.get("seed") or 0))
