"""Reading a text corpus as documents: the lab's shard format, JSON lines, or a datasets name.

The lab's format is one paragraph per line with documents separated by an empty line, in plain or
gzipped shards (train-00.txt.gz, train-01.txt.gz, ..., valid.txt.gz). JSON lines files (`.jsonl`,
`.jsonl.gz`) hold one document per line in a "text" field. A name that is not a file or folder is
read with `datasets.load_dataset(name, config, split=...)` from the user's datasets cache (its "text"
column), written `name` or `name:config` (e.g. `wikitext:wikitext-103-raw-v1`).
"""

import gzip
import json
from pathlib import Path

from decoders.base import UsageError


def open_text(path: Path):
    path = Path(path)
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def is_jsonl(path: Path) -> bool:
    return ".jsonl" in Path(path).suffixes or ".json" in Path(path).suffixes


def file_documents(path: Path):
    """Documents (str, paragraphs joined by newlines) of one file."""
    with open_text(path) as f:
        if is_jsonl(path):
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        text = json.loads(line)["text"]
                    except (ValueError, TypeError, KeyError):
                        text = None
                    if not isinstance(text, str):
                        raise UsageError(f"{path}:{number}: not a JSON object with a \"text\" string")
                    yield text
            return
        paragraphs = []
        for line in f:
            line = line.rstrip("\n")
            if line.strip():
                paragraphs.append(line)
            elif paragraphs:
                yield "\n".join(paragraphs)
                paragraphs = []
        if paragraphs:
            yield "\n".join(paragraphs)


def shard_files(source: str | Path, split: str) -> list[Path]:
    """The files of `split` ("train" or "valid") in a corpus folder (`<split>*.txt[.gz]`, `<split>*.jsonl[.gz]`), or `source` itself when a file."""
    path = Path(source)
    if path.is_file():
        return [path]
    files = sorted(p for p in path.glob(f"{split}*") if p.is_file() and any(s in (".txt", ".jsonl", ".json") for s in p.suffixes))
    if not files:
        raise FileNotFoundError(f"{path}: no {split}*.txt[.gz] or {split}*.jsonl[.gz] files")
    return files


def documents(source: str | Path, split: str = "train"):
    """Documents of a corpus: a folder of shards, one file, or a datasets name (its "text" column)."""
    path = Path(source)
    if path.exists():
        for file in shard_files(path, split):
            try:
                yield from file_documents(file)
            except (UnicodeDecodeError, EOFError, OSError) as e:
                # A binary, truncated or not-really-gzip file: the user's corpus, named in one line.
                raise UsageError(f"{file}: not readable as UTF-8 text or gzip ({type(e).__name__}: {e})") from None
        return
    import datasets

    name, _, config = str(source).partition(":")
    hf_split = {"valid": "validation"}.get(split, split)
    for row in datasets.load_dataset(name, config or None, split=hf_split):
        if row["text"].strip():
            yield row["text"]
