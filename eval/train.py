"""Train a small model of any family on a text corpus, on one GPU, into a checkpoint folder the lab reads.

    python -m eval.train --preset llama-30m --corpus corpus/ --tokens 300_000_000 --out runs/llama-30m
    python -m eval.train --preset mamba2-30m --corpus corpus/ --tokens 300_000_000 --out runs/mamba2-30m \
        --tokenizer runs/tokenizer --data runs/data          # share tokenizer and tokenised data

Matched models: the same tokenizer (--tokenizer, a folder saved by an earlier run or by
`eval.ablation`), the same tokenised data (--data) and token budget, and size presets whose parameter
counts agree within 10% (`configs/<family>-30m.json`, checked by `check_matched`).

- Data: the corpus is the lab's shard format (one paragraph per line, documents separated by an
  empty line, `train-*.txt[.gz]` and `valid*.txt[.gz]`), JSON lines, or a datasets name
  (`eval.corpus`). Each document becomes <bos> text <eos>; the stream of the first --tokens tokens
  (repeated if the corpus is smaller) is cached as int32 in `<data>/train.bin`, the validation
  documents in `<data>/valid.bin`. Row r of step s reads the window starting at
  r * (stream / batch) + s * seq_len, so a batch mixes distant parts of the corpus and the data
  position is the step alone.
- Objective: next-token cross-entropy through the model's parallel forward `Decoder.model(tokens)`
  (impl="ref": the families' differentiable PyTorch paths) for the autoregressive families; for
  Mask-Predict the block loss (`declab_arch.maskpredict.block_loss`): per window a clean prompt and
  one masked block that ends the visible sequence, the prompt blind to the block as the prefix cache
  computes it (in a quarter of the windows it sees the block, as prefix_cache=False decodes), so
  training sees what decoding and scoring see.
- Optimisation: AdamW (weight decay on matrices only), linear warmup then cosine decay to 10% of the
  peak, gradient clipping, bf16 autocast on a GPU, fp32 weights.
- Validation every --val-every steps on the first --val-tokens of valid.bin: loss (nats per token;
  Mask-Predict: its ELBO bound with a fixed mask draw) and bits per byte (loss * tokens / bytes / ln 2).
- Checkpoints every --save-every steps and at the end: the model in the lab's own format plus the
  tokenizer in --out (so `decoders.load(out)` and `--model_args pretrained=out` read it), and
  `train_state.pt` (model, optimizer, step, RNG) from which a rerun of the same command resumes.
  Every record (start, validation, end) is a JSON line in `<out>/train.jsonl` with environment().
- Before anything is written: the preset, the corpus (its train and valid files), every count, the
  output folders and the tokenizer (its size within the preset's vocabulary; by default a BPE of the
  preset's vocabulary size, at most 8192) are checked, and a tokenizer an earlier run saved in the
  tokenizer folder is reused only when it was made from the same --tokenizer. Bad input is one line
  on stderr and exit code 2.
"""

import argparse
import hashlib
import inspect
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import decoders
from declab_arch.checkpoint import CONFIG_DIR, read_json
from decoders import distributed
from decoders.cli import Parser, check_output_dir
from eval.corpus import documents, shard_files
from eval.tokenizer import BYTE_VOCAB, make_tokenizer, save_tokenizer
from decoders.records import append_jsonl, environment

BPE_SAMPLE_DOCS = 20000
# Share of Mask-Predict's training windows whose prompt sees the block (the bidirectional bound's attention).
MASKPREDICT_BIDIRECTIONAL = 0.25
# Largest default BPE (a preset's vocabulary size above it still gets this many tokens).
DEFAULT_BPE = 8192
# Beside a saved tokenizer: the --tokenizer it was made from.
SPEC_FILE = "declab_tokenizer_spec.json"


def preset_values(name: str) -> tuple[str, dict]:
    """(family, config values) of a size preset, configs/<name>.json."""
    family = decoders.family_of(name)
    return family, read_json(CONFIG_DIR / f"{name}.json")


def build_decoder(name: str, tokenizer, *, device, seed: int):
    """A freshly initialised decoder of preset `name`, its special token ids set to the tokenizer's."""
    family, values = preset_values(name)
    if len(tokenizer) > values["vocab_size"]:
        raise decoders.UsageError(f"tokenizer has {len(tokenizer)} tokens, more than {name}'s vocab_size {values['vocab_size']}")
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "mask_token_id": tokenizer.mask_token_id}
    values = {**values, **{k: v for k, v in ids.items() if k in values}}
    dec = decoders.family_class(family).from_preset(values, name, seed=seed, device=device, dtype=torch.float32, impl="ref")
    dec.tokenizer = tokenizer
    return dec


def parameter_count(dec) -> int:
    return sum(p.numel() for p in dec.model.parameters())


def check_matched(names: list[str], tolerance: float = 0.10) -> dict[str, int]:
    """Parameter counts of size presets; raises unless every count is within `tolerance` of their mean."""
    counts = {}
    for name in names:
        family, values = preset_values(name)
        dec = decoders.family_class(family).from_preset(values, name, device="cpu", dtype=torch.float32, impl="ref")
        counts[name] = parameter_count(dec)
    mean = sum(counts.values()) / len(counts)
    far = {n: c for n, c in counts.items() if abs(c - mean) > tolerance * mean}
    if far:
        raise decoders.UsageError(f"parameter counts not within {tolerance:.0%} of their mean {mean:,.0f}: {far}")
    return counts


def tokenize_stream(texts, tokenizer, limit: int | None) -> np.ndarray:
    """<bos> text <eos> per document, concatenated; stops after `limit` tokens when given."""
    parts, total = [], 0
    batch = []

    def flush():
        nonlocal total
        for ids in tokenizer(batch, add_special_tokens=True)["input_ids"]:
            parts.append(np.asarray(ids + [tokenizer.eos_token_id], dtype=np.int32))
            total += len(parts[-1])
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == 256:
            flush()
            if limit is not None and total >= limit:
                break
    if batch:
        flush()
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return stream[:limit] if limit is not None else stream


def fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's definition: tokenised data is reused only with the same tokenizer."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]


def prepare_data(corpus: str, tokenizer, tokens: int, folder: Path, *, val_docs: int = 2000) -> dict:
    """Tokenise the corpus once into folder/train.bin (>= `tokens`, repeated when shorter) and valid.bin; returns meta."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta["train_tokens"] >= tokens and meta["tokenizer"] == fingerprint(tokenizer):
            return meta
    folder.mkdir(parents=True, exist_ok=True)
    train = tokenize_stream(documents(corpus, "train"), tokenizer, tokens)
    if len(train) == 0:
        raise decoders.UsageError(f"{corpus}: no training documents")
    if len(train) < tokens:
        train = np.resize(train, tokens)
    valid_texts = []
    for text in documents(corpus, "valid"):
        valid_texts.append(text)
        if len(valid_texts) >= val_docs:
            break
    valid = tokenize_stream(valid_texts, tokenizer, None)
    train.tofile(folder / "train.bin")
    valid.tofile(folder / "valid.bin")
    meta = {
        "corpus": str(corpus),
        "train_tokens": int(len(train)),
        "valid_tokens": int(len(valid)),
        "valid_bytes": sum(len(t.encode("utf-8")) for t in valid_texts),
        "tokenizer": fingerprint(tokenizer),
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def default_tokenizer(presets: list[str]) -> str:
    """A BPE of the smallest vocabulary among the presets, at most DEFAULT_BPE tokens."""
    return f"bpe:{min([DEFAULT_BPE] + [preset_values(p)[1]['vocab_size'] for p in presets])}"


def tokenizer_size(spec: str) -> int:
    """Tokens of the tokenizer `spec` names ("byte", "bpe:<size>", a folder), read without training one."""
    if spec == "byte":
        return BYTE_VOCAB
    if spec.startswith("bpe:"):
        size = spec.removeprefix("bpe:")
        if not size.isdigit() or int(size) < BYTE_VOCAB:
            raise decoders.UsageError(f"--tokenizer {spec!r}: a BPE size must be a whole number >= {BYTE_VOCAB}")
        return int(size)
    if not Path(spec).is_dir():
        raise decoders.UsageError(f"--tokenizer {spec!r}: not 'byte', 'bpe:<size>' or a folder with tokenizer files")
    return len(make_tokenizer(spec))


def saved_spec(saved: Path) -> str | None:
    """The --tokenizer an earlier run made the tokenizer in `saved` from (None: not recorded)."""
    path = saved / SPEC_FILE
    return json.loads(path.read_text())["spec"] if path.exists() else None


def check_saved_tokenizer(spec: str, saved: Path) -> None:
    """Refuse a tokenizer saved in `saved` by a run with another --tokenizer: reusing it silently would
    train on a tokenizer the command line does not name."""
    if (saved / "tokenizer.json").exists():
        earlier = saved_spec(saved)
        if earlier is not None and earlier != spec:
            raise decoders.UsageError(f"{saved} holds a tokenizer made from --tokenizer {earlier}, not {spec}: "
                                      f"pass --tokenizer {earlier}, or another --out / --tokenizer-dir")


def load_or_make_tokenizer(spec: str, corpus: str, out: Path):
    """`spec` is a folder, "byte" or "bpe:<size>" (trained on the first documents of the corpus); saved to
    out/tokenizer with the spec, and reused from there by a later run with the same spec."""
    saved = out / "tokenizer"
    check_saved_tokenizer(spec, saved)
    if (saved / "tokenizer.json").exists():
        if saved_spec(saved) is None:
            print(f"warning: reusing the tokenizer in {saved} (its --tokenizer is not recorded)", file=sys.stderr)
        return make_tokenizer(str(saved))
    texts = None
    if spec.startswith("bpe:"):
        texts = []
        for text in documents(corpus, "train"):
            texts.append(text)
            if len(texts) >= BPE_SAMPLE_DOCS:
                break
    tokenizer = make_tokenizer(spec, texts)
    save_tokenizer(tokenizer, saved)
    (saved / SPEC_FILE).write_text(json.dumps({"spec": spec}) + "\n")
    return tokenizer


def batch_at(stream: np.ndarray, step: int, batch: int, seq_len: int) -> torch.Tensor:
    """[batch, seq_len + 1] windows of step `step`: row r starts at r * (len / batch) + step * seq_len (mod len)."""
    n = len(stream)
    lane = n // batch
    starts = (np.arange(batch, dtype=np.int64) * lane + step * seq_len) % n
    idx = (starts[:, None] + np.arange(seq_len + 1)) % n
    return torch.from_numpy(stream[idx].astype(np.int64))


def loss_fn(dec):
    """The family's training loss of tokens x [B, T+1]: next-token cross-entropy through the model's
    parallel forward (its reference path: impl="ref" where the forward takes an impl), or for
    Mask-Predict the block loss of the first T tokens (a clean prompt, then a masked block that ends
    the sequence: what its decoding and scoring see)."""
    model = dec.model
    if dec.state_kind == "canvas":
        from declab_arch.maskpredict import block_loss

        return lambda x, generator=None: block_loss(model, x[:, :-1], bidirectional=MASKPREDICT_BIDIRECTIONAL, generator=generator)
    kwargs = {"impl": "ref"} if "impl" in inspect.signature(model.forward).parameters else {}

    def next_token(x, generator=None):
        logits = model(x[:, :-1], **kwargs)
        return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())

    return next_token


def throughput(name: str, tokenizer, *, batch: int, seq_len: int, device, steps: int = 6, warmup: int = 2, seed: int = 0) -> float:
    """Training tokens/s of preset `name` (forward, backward, clipping and AdamW, as `train` runs them)
    on random tokens, timed over `steps` steps after `warmup` steps."""
    device = torch.device(device)
    dec = build_decoder(name, tokenizer, device=device, seed=seed)
    model = dec.model
    model.train()
    loss = loss_fn(dec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randint(0, len(tokenizer), (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed)).to(device)
    t0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            value = loss(x, generator=gen)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return steps * batch * seq_len / (time.perf_counter() - t0)


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup to `peak` over `warmup` steps, then cosine decay to floor * peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_model(dec, folder: Path) -> None:
    """The model in the lab's own format (config.json with declab_family + model.safetensors) and the tokenizer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dec.save(folder)
    save_tokenizer(dec.tokenizer, folder)


def validate(model, loss, valid: np.ndarray, *, batch: int, seq_len: int, max_tokens: int, device, autocast: bool) -> float:
    """Mean loss over the first `max_tokens` of the validation stream, in consecutive windows."""
    n_windows = max(1, min(max_tokens, len(valid) - 1) // seq_len)
    windows = [valid[i * seq_len : i * seq_len + seq_len + 1] for i in range(n_windows)]
    windows = [w for w in windows if len(w) == seq_len + 1]
    gen = torch.Generator(device=device).manual_seed(0)
    model.eval()
    total = 0.0
    with torch.no_grad(), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(np.stack(windows[i : i + batch]).astype(np.int64)).to(device)
            total += loss(x, generator=gen).item() * len(x)
    model.train()
    return total / len(windows)


def check_corpus(corpus: str, option: str = "--corpus") -> None:
    """A corpus path must exist and hold train and valid files; a name that is no path is left to
    `datasets` (read from the user's cache when training starts)."""
    path = Path(corpus)
    if not path.exists():
        if path.suffix or "/" in corpus or corpus.startswith("."):
            raise decoders.UsageError(f"{option} {corpus}: no such file or folder")
        return
    for split in ("train", "valid"):
        try:
            shard_files(path, split)
        except FileNotFoundError as e:
            raise decoders.UsageError(f"{option} {e}") from None


def check_args(args) -> None:
    """Everything `train` can refuse, checked before it writes anything."""
    family, values = preset_values(args.preset)
    for name in ("tokens", "seq_len", "batch", "val_every", "val_tokens", "save_every", "log_every"):
        if getattr(args, name) < 1:
            raise decoders.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.stop_at is not None and args.stop_at < 1:
        raise decoders.UsageError(f"--stop-at must be at least 1, got {args.stop_at}")
    if not args.lr > 0 or not args.clip > 0 or not 0 <= args.warmup < 1 or not args.weight_decay >= 0:
        raise decoders.UsageError("--lr and --clip must be > 0, --warmup in [0, 1), --weight-decay >= 0")
    decoders.parse_device(args.device)
    check_corpus(args.corpus)
    check_output_dir(args.out, "--out")
    for option, folder in (("--tokenizer-dir", args.tokenizer_dir), ("--data", args.data)):
        if folder:
            check_output_dir(folder, option)
    if args.tokenizer is None:
        args.tokenizer = default_tokenizer([args.preset])
    size = tokenizer_size(args.tokenizer)
    if size > values["vocab_size"]:
        raise decoders.UsageError(f"--tokenizer {args.tokenizer} has {size} tokens, more than {args.preset}'s vocab_size {values['vocab_size']}")
    check_saved_tokenizer(args.tokenizer, Path(args.tokenizer_dir or args.out) / "tokenizer")
    check_resumable(args)


def check_resumable(args) -> None:
    """A train_state.pt already in --out must be a run of the same preset and steps (a rerun resumes
    it); read memory-mapped, so only its two small fields are loaded."""
    state_path = Path(args.out) / "train_state.pt"
    if state_path.exists():
        state = torch.load(state_path, map_location="cpu", weights_only=False, mmap=True)
        steps = max(1, args.tokens // (args.batch * args.seq_len))
        if state["preset"] != args.preset or state["steps"] != steps:
            raise decoders.UsageError(f"{state_path} is a run of {state['preset']} for {state['steps']} steps, not {args.preset} for {steps}: use another --out")


def train(args) -> Path:
    check_args(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = decoders.parse_device(args.device)
    torch.manual_seed(args.seed)
    tokenizer = load_or_make_tokenizer(args.tokenizer, args.corpus, Path(args.tokenizer_dir or out))
    data_dir = Path(args.data or out / "data")
    steps = max(1, args.tokens // (args.batch * args.seq_len))
    meta = prepare_data(args.corpus, tokenizer, steps * args.batch * args.seq_len + args.batch, data_dir)
    stream = np.fromfile(data_dir / "train.bin", dtype=np.int32)
    valid = np.fromfile(data_dir / "valid.bin", dtype=np.int32)
    if len(valid) < args.seq_len + 1:
        raise decoders.UsageError(f"{args.corpus}: the validation split has {len(valid)} tokens, fewer than seq_len + 1")
    bytes_per_token = meta["valid_bytes"] / meta["valid_tokens"]

    dec = build_decoder(args.preset, tokenizer, device=device, seed=args.seed)
    model = dec.model
    model.train()
    loss = loss_fn(dec)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    autocast = device.type == "cuda"
    warmup = max(1, int(args.warmup * steps))
    start = 0
    # Draws of the loss itself (Mask-Predict's mask ratios and positions), saved with the checkpoint.
    gen = torch.Generator(device=device).manual_seed(args.seed)
    state_path = out / "train_state.pt"
    if state_path.exists():
        state = torch.load(state_path, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        gen.set_state(state["generator"].cpu())
        start = state["step"]
    log = out / "train.jsonl"
    params = parameter_count(dec)
    append_jsonl(log, {"kind": "start", "step": start, "preset": args.preset, "family": dec.family, "params": params, "steps": steps,
                       "tokens": steps * args.batch * args.seq_len, "args": vars(args), "data": meta, **environment(device)})

    def checkpoint(step: int):
        save_model(dec, out)
        tmp = out / "train_state.pt.tmp"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "steps": steps, "preset": args.preset,
                    "rng": torch.get_rng_state(), "generator": gen.get_state()}, tmp)
        os.replace(tmp, state_path)

    def evaluate(step: int, elapsed: float):
        val = validate(model, loss, valid, batch=args.batch, seq_len=args.seq_len, max_tokens=args.val_tokens, device=device, autocast=autocast)
        record = {"kind": "val", "step": step, "tokens": step * args.batch * args.seq_len, "val_loss": val,
                  "val_bpb": val / bytes_per_token / math.log(2), "lr": lr_at(step, steps, args.lr, warmup), "elapsed_s": elapsed}
        append_jsonl(log, record)
        return record

    t0 = time.perf_counter()
    if start == 0:
        evaluate(0, 0.0)
    last = min(steps, args.stop_at or steps)
    # Under torchrun (eval.study's spread runs) rank 0 alone shows its progress.
    bar = tqdm(range(start, last), initial=start, total=steps, desc=f"train {args.preset}", dynamic_ncols=True,
               disable=distributed.world().rank != 0)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, warmup)
        x = batch_at(stream, step, args.batch, args.seq_len).to(device, non_blocking=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            value = loss(x, generator=gen)
        value.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done % args.log_every == 0 or done == steps:
            bar.set_postfix(loss=f"{value.item():.3f}", lr=f"{lr_at(step, steps, args.lr, warmup):.2e}", gnorm=f"{norm.item():.2f}")
        if done % args.val_every == 0 or done == steps:
            rec = evaluate(done, time.perf_counter() - t0)
            bar.write(f"step {done}: val loss {rec['val_loss']:.4f}, {rec['val_bpb']:.4f} bits/byte")
        if done % args.save_every == 0 or done == last:
            checkpoint(done)
    bar.close()
    if last == steps:
        append_jsonl(log, {"kind": "end", "step": steps, "elapsed_s": time.perf_counter() - t0, **environment(device)})
    return out


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m eval.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, help="size preset: configs/<name>.json (e.g. llama-30m, mamba2-tiny)")
    p.add_argument("--corpus", required=True, help="corpus folder (train-*.txt.gz, valid.txt.gz), a text/jsonl file, or a datasets name")
    p.add_argument("--out", required=True, help="output folder: the checkpoint (lab format), train_state.pt, train.jsonl")
    p.add_argument("--tokens", type=int, required=True, help="training token budget (steps = tokens / (batch * seq_len))")
    p.add_argument("--tokenizer", default=None, help='"byte", "bpe:<vocab>" (trained on the corpus) or a folder with tokenizer files '
                   f"(default: a BPE of the preset's vocab_size, at most {DEFAULT_BPE})")
    p.add_argument("--tokenizer-dir", help="where the tokenizer is saved/reused (default: --out); share it between matched runs")
    p.add_argument("--data", help="tokenised-data cache folder (default: <out>/data); share it between matched runs")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=float, default=0.02, help="warmup as a fraction of the steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--val-every", type=int, default=500)
    p.add_argument("--val-tokens", type=int, default=1 << 18)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-at", type=int, help="stop after this step with a resumable checkpoint, as an interruption would (for time-sliced jobs)")
    p.add_argument("--device")
    return p


def main(argv=None):
    with decoders.user_errors():
        out = train(parser().parse_args(argv))
    print(json.dumps({"checkpoint": str(out)}))


if __name__ == "__main__":
    main()
