"""Train Medusa-style draft heads (`declab_arch.draft_heads`) on a trained transformer checkpoint.

    python -m eval.train_heads --target runs/llama-30m --corpus corpus/ --out runs/llama-30m-heads --seconds 20

The target is frozen; its final hidden states (before the norm) feed k residual blocks, head i
trained with cross-entropy against the token i + 2 positions ahead through the target's own norm
and LM head. Data, batches and schedule are `eval.train`'s: the target's tokenizer, the tokenised
stream cached in --data, `batch_at` windows, AdamW with `lr_at`'s warmup and cosine decay, gradient
clipping, bf16 autocast on a GPU. The budget is --tokens, or --seconds (the first steps are timed
and set the step count). Validation (top-1 accuracy of each head on the first --val-tokens of
valid.bin) and the end are JSON lines in <out>/heads_train.jsonl; the heads are saved in --out
(a folder of its own: `decoders.speculative(target, "heads:OUT")`).
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import decoders
from decoders import cli
from declab_arch.draft_heads import DraftHeads
from decoders.records import append_jsonl, environment
from eval import train

PROBE_STEPS = 4


def head_losses(heads: DraftHeads, model, x: torch.Tensor) -> list[torch.Tensor]:
    """Per head i, cross-entropy of its logits against x shifted i + 2 (x [B, T+1] token windows)."""
    T = x.shape[1] - 1
    with torch.no_grad():
        hidden = model.hidden(x[:, :T])  # [B, T, d]
    losses = []
    for i, block in enumerate(heads.blocks):
        h = hidden[:, : T - i - 1]
        logits = model.head(h + F.silu(block(h)))
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), x[:, i + 2 :].flatten()))
    return losses


def accuracy(heads: DraftHeads, model, valid: np.ndarray, *, seq_len: int, max_tokens: int, device, autocast: bool) -> list[float]:
    """Top-1 accuracy of each head over consecutive validation windows."""
    n = max(1, min(max_tokens, len(valid) - 1) // seq_len)
    windows = [valid[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    x = torch.from_numpy(np.stack([w for w in windows if len(w) == seq_len + 1]).astype(np.int64)).to(device)
    right = [0.0] * heads.k
    with torch.no_grad(), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = model.hidden(x[:, :seq_len])
        for i, block in enumerate(heads.blocks):
            h = hidden[:, : seq_len - i - 1]
            right[i] = (model.head(h + F.silu(block(h))).argmax(-1) == x[:, i + 2 :]).float().mean().item()
    return right


def train_heads(a) -> Path:
    train.check_corpus(str(a.corpus))
    cli.check_output_dir(a.out, "--out")
    device = decoders.parse_device(a.device)
    torch.manual_seed(a.seed)
    target = decoders.load(a.target, device=device, dtype="float32", impl="ref")
    if target.state_kind != "kv":
        raise decoders.UsageError(f"--target {a.target} is {target.family}: draft heads read a transformer's hidden states")
    if target.tokenizer is None:
        raise decoders.UsageError(f"--target {a.target} has no tokenizer: train it with eval.train")
    model = target.model
    model.requires_grad_(False)
    out = Path(a.out)
    data = Path(a.data or out / "data")
    step_tokens = a.batch * a.seq_len
    budget = a.tokens
    if budget is None:
        # Batches wrap around the stream: with --seconds any cached stream of this tokenizer will do.
        meta = data / "meta.json"
        budget = json.loads(meta.read_text())["train_tokens"] - a.batch if meta.exists() else 1 << 24
    train.prepare_data(a.corpus, target.tokenizer, budget + a.batch, data)
    stream = np.fromfile(data / "train.bin", dtype=np.int32)
    valid = np.fromfile(data / "valid.bin", dtype=np.int32)
    heads = DraftHeads(target.config.hidden_size, a.k).to(device)
    opt = torch.optim.AdamW(heads.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    autocast = device.type == "cuda"
    log = out / "heads_train.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    steps = max(1, a.tokens // step_tokens) if a.tokens is not None else None
    append_jsonl(log, {"kind": "start", "target": str(a.target), "k": a.k, "steps": steps, "args": {k: str(v) for k, v in vars(a).items()},
                       **environment(device)})
    t0 = time.perf_counter()
    step = 0
    while steps is None or step < steps:
        total = steps or PROBE_STEPS * 100
        for group in opt.param_groups:
            group["lr"] = train.lr_at(step, total, a.lr, max(1, total // 50))
        x = train.batch_at(stream, step, a.batch, a.seq_len).to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            losses = head_losses(heads, model, x)
        loss = sum(losses) / len(losses)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if steps is None and step == PROBE_STEPS:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            steps = max(step, int(a.seconds / ((time.perf_counter() - t0) / step)))
    acc = accuracy(heads, model, valid, seq_len=a.seq_len, max_tokens=a.val_tokens, device=device, autocast=autocast)
    heads.save(out)
    append_jsonl(log, {"kind": "end", "step": step, "tokens": step * step_tokens, "loss": loss.item(), "head_accuracy": acc,
                       "elapsed_s": time.perf_counter() - t0, **environment(device)})
    return out


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="python -m eval.train_heads", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="a trained transformer checkpoint folder (eval.train's --out)")
    p.add_argument("--corpus", required=True)
    p.add_argument("--out", required=True, help="folder for the heads (not the target's folder)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--tokens", type=int, help="training tokens")
    budget.add_argument("--seconds", type=float, help="training seconds (the first steps are timed)")
    p.add_argument("--k", type=int, default=4, help="number of heads (the most tokens a step can draft)")
    p.add_argument("--data", help="tokenised-data cache folder (share the target's: eval.train's --data)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--val-tokens", type=int, default=1 << 16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device")
    return p


def main(argv=None):
    with decoders.user_errors():
        a = parser().parse_args(argv)
        if a.k < 1:
            raise decoders.UsageError(f"--k must be >= 1, got {a.k}")
        out = train_heads(a)
    print(json.dumps({"heads": str(out)}))


if __name__ == "__main__":
    main()
