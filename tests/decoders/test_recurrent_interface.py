"""The recurrent decoders' common interface (`decoders.base.RecurrentDecoder`), which the engine's state
runner and speculative decoding call: state tensors, row views, and chunk forwards over any rows at any
positions equal to one parallel forward. Every registered recurrent family, CPU, float32, impl="ref"."""

import inspect

import pytest
import torch

import decoders
from decoders import engine, speculative
from decoders.base import RecurrentDecoder

RECURRENT = [f for f in decoders.FAMILIES if decoders.family_class(f).state_kind == "recurrent"]
SEQS = [[3, 9, 4, 1, 7, 2, 8], [5, 6, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


@pytest.fixture(scope="module", params=RECURRENT)
def dec(request):
    preset = f"{decoders.family_class(request.param).presets}-tiny"
    return decoders.load(preset, device="cpu", dtype="float32", impl="ref", seed=0)


def padded(pieces: list[list[int]]) -> torch.Tensor:
    width = max(map(len, pieces))
    return torch.tensor([p + [0] * (width - len(p)) for p in pieces])


def test_every_recurrent_family_implements_the_interface():
    assert RECURRENT
    for family in RECURRENT:
        cls = decoders.family_class(family)
        assert issubclass(cls, RecurrentDecoder) and cls.state_fields
        assert cls.chunk_forward is not RecurrentDecoder.chunk_forward


def test_state_tensors_and_rows_view(dec):
    cache = dec.new_cache([4, 4, 4], 8)
    tensors = dec.state_tensors(cache)
    fields = {name for name, value in vars(cache).items() if isinstance(value, torch.Tensor)}
    assert set(dec.state_fields) == fields
    assert [t.shape[dim] for t, dim in tensors] == [3] * len(tensors)
    view = dec.rows_view(cache, 2)
    for (t, dim), (v, vdim) in zip(tensors, dec.state_tensors(view)):
        assert vdim == dim and v.shape[dim] == 2 and v.data_ptr() == t.data_ptr()
        v.select(dim, 1).fill_(7.0)
        assert (t.select(dim, 1) == 7.0).all() and not (t.select(dim, 2) == 7.0).all()


def test_chunk_forward_over_rows_and_positions_equals_one_forward(dec):
    full = [dec.logits(torch.tensor([s]))[0] for s in SEQS]
    cut = [4, 2, 6]
    cache = dec.new_cache([len(s) for s in SEQS], max(map(len, SEQS)))
    # Rows 2 and 0 first (different lengths, out of order), row 1 alone, then all rows from where each stopped.
    first = dec.chunk_forward(cache, padded([SEQS[2][:cut[2]], SEQS[0][:cut[0]]]), [0, 0], [cut[2], cut[0]], rows=[2, 0])
    torch.testing.assert_close(first, torch.stack([full[2][cut[2] - 1], full[0][cut[0] - 1]]), rtol=1e-4, atol=1e-4)
    assert dec.chunk_forward(cache, padded([SEQS[1][:cut[1]]]), [0], [cut[1]], rows=[1], logits="none") is None
    rest = [s[c:] for s, c in zip(SEQS, cut)]
    every = dec.chunk_forward(cache, padded(rest), cut, [len(r) for r in rest], logits="all")
    for b, (s, c) in enumerate(zip(SEQS, cut)):
        torch.testing.assert_close(every[b, : len(s) - c], full[b][c:], rtol=1e-4, atol=1e-4)


def test_decode_after_chunks_on_a_row_view_equals_one_forward(dec):
    full = [dec.logits(torch.tensor([s]))[0] for s in SEQS[:2]]
    cache = dec.new_cache([0, 0, 0], 16)
    prompts = [s[:-1] for s in SEQS[:2]]
    dec.chunk_forward(cache, padded(prompts), [0, 0], [len(p) for p in prompts], rows=[0, 1])
    tokens = torch.tensor([s[-1] for s in SEQS[:2]])
    positions = torch.tensor([len(p) for p in prompts])
    logits = dec.decode_forward(dec.rows_view(cache, 2), tokens, positions)
    torch.testing.assert_close(logits, torch.stack([f[-1] for f in full]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("module", [engine, speculative])
def test_the_engine_and_speculative_decoding_name_no_family(module):
    source = inspect.getsource(module)
    for family in decoders.FAMILIES:
        assert f'"{family}"' not in source and f"'{family}'" not in source, (module.__name__, family)
