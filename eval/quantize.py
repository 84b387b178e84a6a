"""Quantise a model's linear layers and save it in the lab's format: int8, int4 (GPTQ, calibrated on
text the user gives) or int4-rtn.

    python -m eval.quantize MODEL --quant int4 --calib CORPUS --out FOLDER [--sequences 256] [--length 512]
                            [--split train] [--group-size N] [--head] [--device cuda] [--dtype bf16]

MODEL is a preset or a checkpoint folder; CORPUS is read with `eval.corpus.documents` (the lab's shard
folder, a .txt / .jsonl file, or a datasets name) from its `--split` (train by default, so the
calibration text is disjoint from the valid split the quality runs evaluate on): documents tokenised
with the model's tokenizer (<bos> text <eos>), concatenated and cut into `--sequences` rows of
`--length` tokens. int8 and int4-rtn need no calibration text. Every check (quant name, group size
against every layer, model, corpus, output folder) runs before any work. Prints the layers, bytes
before and after and the mean relative weight error, then one JSON line; the folder loads back with
`declab_arch.quant.read_checkpoint`.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import decoders
from declab_arch import quant
from decoders.base import UsageError
from decoders.cli import Parser, check_output_dir, run_command
from decoders.quant import check_quant, folder_spec
from eval.corpus import documents
from eval.tokenizer import save_tokenizer, tokenizer_for
from eval.train import tokenize_stream


def calibration_tokens(corpus, tokenizer, *, sequences: int = 256, length: int = 512, split: str = "train") -> torch.Tensor:
    """`[sequences, length]` token ids cut from the documents of `corpus` (its `split`), each document
    <bos> text <eos>, concatenated. UsageError when the split holds fewer tokens than that."""
    need = sequences * length
    stream = tokenize_stream(documents(corpus, split), tokenizer, need)
    if len(stream) < need:
        raise UsageError(f"calibration corpus {corpus} ({split}) has {len(stream)} tokens, fewer than {sequences} x {length} = {need}")
    return torch.from_numpy(stream[:need].astype("int64")).view(sequences, length)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parser() -> Parser:
    p = Parser(prog="python -m eval.quantize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="preset name or checkpoint folder")
    p.add_argument("--quant", required=True, help=f"quantisation ({quant.KNOWN})")
    p.add_argument("--out", required=True, help="folder the quantised checkpoint is written to (must be empty or new)")
    p.add_argument("--calib", help="calibration corpus (needed by int4, the GPTQ-calibrated method)")
    p.add_argument("--split", default="train", help="the corpus split the calibration text comes from (default train)")
    p.add_argument("--sequences", type=positive, default=256, help="calibration sequences (default 256)")
    p.add_argument("--length", type=positive, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--group-size", type=positive, help="int4 group size (default 128, or the -gN of the name)")
    p.add_argument("--head", action="store_true", help="quantise the LM head too (off by default)")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: CUDA when available)")
    p.add_argument("--dtype", help="activation dtype (default bf16 on a GPU, float32 on the CPU)")
    return p


def run(args) -> int:
    spec = check_quant(args.quant, args.group_size, model=args.model, head=args.head)
    if (held := folder_spec(args.model)) is not None:
        raise UsageError(f"{args.model} is already quantised ({held.name}): quantise its dense checkpoint")
    if spec.method == "gptq" and args.calib is None:
        raise UsageError(f"{spec.name} is calibrated (GPTQ): give the calibration text with --calib CORPUS (or use int4-rtn)")
    if spec.method != "gptq" and args.calib is not None:
        raise UsageError(f"{spec.name} takes no calibration text (--calib is for int4, GPTQ)")
    if args.calib is not None and not Path(args.calib).exists() and "/" in args.calib:
        raise UsageError(f"--calib {args.calib}: no such file or folder")
    decoders.parse_device(args.device)
    decoders.parse_dtype(args.dtype)
    out = check_output_dir(args.out, "--out")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out}: folder is not empty")
    calib = None
    if spec.method == "gptq":
        calib = {"corpus": args.calib, "split": args.split, "sequences": args.sequences, "length": args.length}
    summary = quantize_folder(args.model, spec, out, calib=calib, head=args.head, device=args.device, dtype=args.dtype)
    print(f"{args.model} -> {out}: {spec.name}, {summary['layers']} layers, {summary['dense_bytes'] / 2**20:.1f} MiB -> "
          f"{summary['quantized_bytes'] / 2**20:.1f} MiB, mean relative weight error {summary['mean_rel_weight_error']:.4f}, "
          f"{summary['seconds']:.1f} s")
    print(json.dumps(summary))
    return 0


def quantize_folder(model: str, spec: quant.QuantSpec, out: Path, *, calib=None, head: bool = False, device=None, dtype=None) -> dict:
    """Quantise `model` (a preset or dense folder, checked) as `spec` into the folder `out` (empty or
    new); `calib`: for GPTQ, the calibration text as `calibration_tokens` takes it (corpus, split,
    sequences, length). Returns the summary the command prints as JSON."""
    began = time.perf_counter()
    decoder = decoders.load(model, device=device, dtype=dtype, impl="ref")
    layers = len(quant.linear_layers(decoder.model)) + head
    tokenizer = tokenizer_for(decoder)
    tokens = calibration_tokens(tokenizer=tokenizer, **calib) if spec.method == "gptq" else None
    mapping = quant.quantize_model(decoder.model, spec.name, calib_tokens=tokens, head=head)
    weights = {n: w for n, w in mapping.items() if n.endswith(".weight")}
    params = dict(decoder.model.named_parameters())
    dense = {n: params[n] if n in params else quant.head_weight(decoder.model) for n in weights}
    errors = [((w.dequantize().float() - dense[n].float()).norm() / dense[n].float().norm()).item() for n, w in weights.items()]
    quant.save(out, decoder.model, mapping, spec, lambda model, folder: decoder.save(folder))
    if decoder.tokenizer is not None:
        save_tokenizer(tokenizer, out)
    dense_bytes = sum(t.numel() * t.element_size() for t in dense.values())
    packed_bytes = sum(w.nbytes for w in weights.values())
    return {"model": str(model), "out": str(out), "quant": spec.name, "method": spec.method, "group_size": spec.group_size,
            "layers": layers, "head": head, "dense_bytes": dense_bytes, "quantized_bytes": packed_bytes,
            "mean_rel_weight_error": sum(errors) / len(errors),
            "calibration": calib if tokens is not None else None,
            "seconds": round(time.perf_counter() - began, 1)}


def main(argv=None) -> int:
    return run_command(parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
