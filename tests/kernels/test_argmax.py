"""Greedy argmax: Triton against the reference (`x.argmax(-1)`, exact) on odd sizes, strided rows, ties
inside and across stage-1 blocks, equal and negative rows, infinities, NaN and signed zeros; the
output is poisoned first so that an unwritten row fails. On the CPU the kernels run under the
interpreter; the test marked `gpu` checks bf16 vocabularies of 50k-128k inside a CUDA graph."""

import pytest
import torch

from declab_kernels.argmax import argmax
from declab_kernels.argmax.triton import BLOCK, argmax_triton

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
INF, NAN = float("inf"), float("nan")


def randn(*shape, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE)


def check(x):
    """Triton equals the reference on x, and writes every row of its output."""
    out = torch.full((x.shape[0],), -1, dtype=torch.int64, device=x.device)
    got = argmax_triton(x, out=out)
    assert got is out
    assert torch.equal(got, argmax(x, impl="ref"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", [1, 7, 1000, 5003, 50288])
@pytest.mark.parametrize("B", [1, 3, 5])
def test_triton_matches_ref(B, V, dtype):
    # bf16 rounding of 50k normal values repeats the maximum often: the first one must win
    check(randn(B, V, seed=V + B).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_strided_rows(dtype):
    # rows of a wider buffer starting at an offset, as logits sliced out of a larger output
    wide = randn(3, 3 * BLOCK + 40, seed=1).to(dtype)
    check(wide[:, 5 : 3 * BLOCK + 5])


def test_ties_first_index_wins():
    V = 3 * BLOCK + 100
    ties = [
        [5, 17],  # inside one block
        [BLOCK - 1, BLOCK],  # on either side of a block boundary
        [BLOCK, 2 * BLOCK - 1, 2 * BLOCK],  # at a block's start and end, and the next block's start
        [2 * BLOCK + 50, V - 1],  # in the last two blocks, the last one partly masked
        [0, V - 1],
        [V - 1],
    ]
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.rand(len(ties), V, device=DEVICE).to(dtype)
        for row, cols in enumerate(ties):
            x[row, cols] = 2.0
        assert argmax(x, impl="triton").tolist() == [cols[0] for cols in ties]
        check(x)


def test_equal_negative_and_infinite_rows():
    V = 2 * BLOCK + 3
    x = -1 - torch.rand(6, V, device=DEVICE)
    x[0] = -3.5  # all equal
    x[1] = -INF  # all -inf: index 0
    x[2, ::3] = -INF  # negative values among -inf
    x[3, [BLOCK + 1, 7]] = INF  # +inf twice
    x[4, : BLOCK + 9] = -INF  # -inf up to a maximum in the next block
    x[5, [3, 2 * BLOCK + 1]] = 1e30
    for dtype in (torch.bfloat16, torch.float32):
        check(x.to(dtype))


def test_nan_and_signed_zeros_as_torch():
    V = 2 * BLOCK + 3
    x = -1 - torch.rand(4, V, device=DEVICE)
    x[0, [BLOCK + 2, 2 * BLOCK]] = NAN  # NaN beats every number
    x[0, 5] = INF
    x[1, [9, BLOCK]] = -NAN  # so does a NaN with the sign bit set
    x[2, [BLOCK - 1, 3]] = torch.tensor([-0.0, 0.0], device=DEVICE)  # -0.0 == +0.0: the first zero wins
    x[3, [4, BLOCK + 4]] = torch.tensor([-0.0, 0.0], device=DEVICE)
    for dtype in (torch.bfloat16, torch.float32):
        check(x.to(dtype))


def test_rejects_bad_layouts():
    with pytest.raises(ValueError):
        argmax_triton(randn(4, 3).t())
    with pytest.raises(ValueError):
        argmax_triton(randn(2, 0))
    with pytest.raises(ValueError):
        argmax_triton(randn(2, 5), out=torch.empty(2, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_out_and_advance(impl):
    # A decoder's step: the tokens land in its buffer and its positions move on by one, in the same call.
    x = randn(3, 5003, seed=4)
    out = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    positions = torch.tensor([7, 0, 4095], dtype=torch.int64, device=DEVICE)
    got = argmax(x, impl=impl, out=out, advance=positions)
    assert got is out
    assert torch.equal(out, x.argmax(dim=-1))
    assert positions.tolist() == [8, 1, 4096]
    with pytest.raises(ValueError):
        argmax_triton(x, advance=positions.to(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("V", [50288, 65536, 128256])
@pytest.mark.parametrize("B", [1, 16, 64])
def test_gpu_cuda_graph_bf16(B, V):
    # Captured once, replayed on new logits written in place: the partials come from the graph's pool.
    x = randn(B, V, seed=B).to(torch.bfloat16)
    out = torch.empty(B, dtype=torch.int64, device=DEVICE)
    argmax_triton(x, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax_triton(x, out=out)
    for seed in (1, 2):
        x.copy_(randn(B, V, seed=100 * seed + B))
        # ties across the first block boundary in row 0
        x[0, [BLOCK - 1, BLOCK]] = 10.0
        out.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x.argmax(dim=-1))
        assert out[0].item() == BLOCK - 1
