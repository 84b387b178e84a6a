"""Shared helpers of the eval tests: a tiny corpus in the lab's shard format, made per test."""

import gzip
import random

import pytest


def _write_corpus(folder, docs=30, seed=0):
    """train-00.txt.gz and valid.txt.gz: paragraphs of random words, documents separated by an empty line."""
    rng = random.Random(seed)
    words = "the a cat dog sat ran on under mat river sky blue green home far away and then".split()
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("train-00", "valid"):
        with gzip.open(folder / f"{name}.txt.gz", "wt") as f:
            for _ in range(docs):
                for _ in range(rng.randint(1, 3)):
                    f.write(" ".join(rng.choice(words) for _ in range(rng.randint(25, 50))) + ".\n")
                f.write("\n")
    return folder


@pytest.fixture(scope="session")
def write_corpus():
    return _write_corpus
