"""Tokenizers for the lab's own models: a built-in byte-level tokenizer and a BPE trained on a corpus.

Both are ordinary `tokenizers` objects wrapped as a transformers `PreTrainedTokenizerFast`, saved
as `tokenizer.json` (+ `tokenizer_config.json`) beside a checkpoint, so `declab_arch.checkpoint.load_tokenizer`
reads them back like any HF tokenizer. Nothing is downloaded.

Byte-level ids: 0..255 are the bytes, then the special tokens

    256 <bos>   257 <eos>   258 <pad>   259 <mask>

so a model needs vocab_size >= 260 (BYTE_VOCAB) to use it; every family's preset with a vocabulary
that large (llama-tiny, mamba2-tiny, ... have 512) gets this tokenizer when loaded from a preset, and
the unused rows above 259 are never produced. <mask> is always present so one tokenizer serves the
Mask-Predict family too. Encoding (with special tokens) prepends <bos>; a training document is
<bos> text <eos>.

The BPE (`train_bpe`) is byte-level too (no unknown characters), with the same four special tokens
at ids 0..3 and merges learnt from the corpus up to `vocab_size`.
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from decoders.base import UsageError

SPECIALS = ["<bos>", "<eos>", "<pad>", "<mask>"]
BYTE_VOCAB = 256 + len(SPECIALS)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE uses for its vocabulary."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _finish(tok: Tokenizer):
    """Byte-level decoding, <bos> prepended when special tokens are requested, wrapped for transformers."""
    from transformers import PreTrainedTokenizerFast

    tok.decoder = decoders.ByteLevel()
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", mask_token="<mask>")


def byte_tokenizer():
    """The built-in byte-level tokenizer (ids 0..255 bytes, 256..259 specials)."""
    table = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    # No regex split: every byte is its own token, spaces included.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.add_special_tokens(SPECIALS)
    return _finish(tok)


def train_bpe(texts, vocab_size: int):
    """A byte-level BPE of `vocab_size` tokens learnt from the strings `texts` (deterministic for the same input)."""
    if vocab_size < BYTE_VOCAB:
        raise UsageError(f"a BPE needs vocab_size >= {BYTE_VOCAB}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return _finish(tok)


def save_tokenizer(tokenizer, folder: Path) -> None:
    """tokenizer.json and tokenizer_config.json in `folder`, read back by `declab_arch.checkpoint.load_tokenizer`."""
    tokenizer.save_pretrained(str(folder))


def make_tokenizer(spec: str, texts=None):
    """A tokenizer from a spec: "byte", "bpe:<vocab_size>" (trained on `texts`) or a folder holding tokenizer files."""
    from declab_arch.checkpoint import load_tokenizer

    if spec == "byte":
        return byte_tokenizer()
    if spec.startswith("bpe:"):
        if texts is None:
            raise UsageError("training a BPE needs texts")
        return train_bpe(texts, int(spec.removeprefix("bpe:")))
    tokenizer = load_tokenizer(Path(spec))
    if tokenizer is None:
        raise UsageError(f"tokenizer {spec!r}: not 'byte', 'bpe:<size>' or a folder with tokenizer files")
    return tokenizer


def tokenizer_for(decoder):
    """The decoder's own tokenizer (checkpoint folder) or, for random-weight presets, the byte-level one."""
    if decoder.tokenizer is not None:
        return decoder.tokenizer
    vocab = decoder.config.vocab_size
    if vocab < BYTE_VOCAB:
        raise UsageError(f"{decoder.source} has no tokenizer and vocab_size {vocab} < {BYTE_VOCAB}, too small for the byte-level one")
    return byte_tokenizer()
