"""Quantised linears: the Triton kernels (the FMA GEMVs, the dequantising tensor-core kernels, the
dense path) against the float32 reference, their dispatch, and the int4 packing.

On the CPU the kernels run under the Triton interpreter in float32 (where tl.dot is exact), on odd N,
K a multiple of 8 but not of the tile, groups of every kind (a multiple of four words a thread, of
two, odd groups and odd word counts that leave one word a thread; 32 / 64 / 128 for the dot kernel),
1..4 rows (the int4 GEMV), 1..16 (the int8 GEMV), 1..300 (the dot kernels, split along K or not),
strided x rows, outputs pre-filled with NaN. Tests marked `gpu` run bf16 on CUDA at the llama shapes.
"""

import pytest
import torch

from declab_kernels import quant_gemv as Q

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def rel(a, b):
    """||a - b|| / ||b|| in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def int4_case(N, K, group, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=g)
    scales = (torch.rand(N, K // group, generator=g) * 0.02 + 0.001).half()
    zeros = torch.randint(0, 16, (N, K // group), generator=g).to(torch.uint8)
    return Q.pack_int4(codes).to(device), scales.to(device), zeros.to(device)


def int8_case(N, K, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (N, K), generator=g).to(torch.int8).to(device), (torch.rand(N, generator=g) * 0.01).to(device)


def test_pack_int4_layout_and_round_trip():
    codes = torch.randint(0, 16, (5, 24))
    packed = Q.pack_int4(codes)
    assert packed.shape == (5, 3) and packed.dtype == torch.int32
    # nibble i of word j is code i K / 8 + j: word 1 holds inputs 1, 4, 7, ..., 22
    word = int(packed[2, 1]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == codes[2, 1::3].tolist()
    assert torch.equal(Q.unpack_int4(packed), codes)
    assert torch.equal(Q.unpack_int4(Q.pack_int4(torch.full((1, 8), 15))), torch.full((1, 8), 15))


def test_dequantize_int4_ref_formula():
    qweight, scales, zeros = int4_case(3, 16, 8, device="cpu")
    codes = Q.unpack_int4(qweight).float()
    w = Q.dequantize_int4(qweight, scales, zeros, 8, torch.float32, impl="ref")
    assert torch.allclose(w[1, 9], (codes[1, 9] - zeros[1, 1].float()) * scales[1, 1].float())


@pytest.mark.parametrize("N, K, group", [(37, 384, 128), (33, 200, 40), (16, 256, 32), (9, 512, 512), (5, 64, 8), (7, 96, 24)])
@pytest.mark.parametrize("M", [1, 3, 4])
def test_int4_gemv_triton_matches_ref(N, K, group, M, nan_empty):
    qweight, scales, zeros = int4_case(N, K, group)
    x = torch.randn(M, K, device=DEVICE)
    out = Q.int4_linear(x, qweight, scales, zeros, group, impl="triton", kernel="fma")
    assert out.shape == (M, N) and not out.isnan().any()
    assert rel(out, Q.int4_linear_ref(x, qweight, scales, zeros, group)) < 1e-5


@pytest.mark.parametrize("N, K, group, v", [(21, 512, 64, 4), (11, 336, 42, 2), (9, 200, 40, 1), (6, 24, 3, 1)])
@pytest.mark.parametrize("block_t", [1, 4])
def test_int4_words_per_thread_and_tiles(N, K, group, v, block_t, nan_empty):
    """Every V (words a thread sums before it scales) and tile widths that leave a partial last tile."""
    from declab_kernels.quant_gemv.triton import int4_gemv_triton, words_per_thread

    assert words_per_thread(K // 8, group) == v
    qweight, scales, zeros = int4_case(N, K, group)
    x = torch.randn(3, K, device=DEVICE)
    config = dict(BLOCK_N=8, BLOCK_T=block_t)
    assert rel(int4_gemv_triton(x, qweight, scales, zeros, group, config=config), Q.int4_linear_ref(x, qweight, scales, zeros, group)) < 1e-5


@pytest.mark.parametrize("N, K", [(37, 200), (8, 1024), (33, 136)])
@pytest.mark.parametrize("M", [1, 3, 16])
def test_int8_gemv_triton_matches_ref(N, K, M, nan_empty):
    qweight, scale = int8_case(N, K)
    x = torch.randn(M, K, device=DEVICE)
    out = Q.int8_linear(x, qweight, scale, impl="triton", kernel="fma")
    assert out.shape == (M, N) and not out.isnan().any()
    assert rel(out, Q.int8_linear_ref(x, qweight, scale)) < 1e-5


@pytest.mark.parametrize("kernel", ["fma", "dot"])
def test_strided_rows(kernel):
    qweight, scales, zeros = int4_case(19, 128, 64)
    big = torch.randn(3, 200, device=DEVICE)
    x = big[:, 10:138]  # row stride 200
    got = Q.int4_linear(x, qweight, scales, zeros, 64, impl="triton", kernel=kernel)
    assert rel(got, Q.int4_linear_ref(x.contiguous(), qweight, scales, zeros, 64)) < 1e-5
    q8, s8 = int8_case(19, 128)
    assert rel(Q.int8_linear(x, q8, s8, impl="triton", kernel=kernel), Q.int8_linear_ref(x.contiguous(), q8, s8)) < 1e-5


@pytest.mark.parametrize("group", [32, 40])
def test_many_rows_dequantise_then_dense(group, nan_empty):
    qweight, scales, zeros = int4_case(21, 160, group)
    x = torch.randn(Q.MAX_ROWS + 3, 160, device=DEVICE)
    dense = Q.dequantize_int4(qweight, scales, zeros, group, torch.float32, impl="triton")
    assert torch.equal(dense, Q.dequantize_int4(qweight, scales, zeros, group, torch.float32, impl="ref"))
    # 20 words a row: no tile of 16 words in one group, so the dot kernel cannot take this shape.
    assert Q.int4_kernel(x.shape[0], 160, group) == "dequant+cublas"
    assert rel(Q.int4_linear(x, qweight, scales, zeros, group, impl="triton"), Q.int4_linear_ref(x, qweight, scales, zeros, group)) < 1e-5
    q8, s8 = int8_case(21, 160)
    assert torch.equal(Q.dequantize_int8(q8, s8, torch.float32, impl="triton"), Q.dequantize_int8(q8, s8, torch.float32, impl="ref"))
    got = Q.int8_linear(x, q8, s8, impl="triton", kernel="dequant+cublas")
    assert rel(got, Q.int8_linear_ref(x, q8, s8)) < 1e-5


@pytest.mark.parametrize("N, K, group", [(37, 384, 128), (33, 256, 32), (20, 512, 64)])
@pytest.mark.parametrize("M", [1, 2, 5, 16, 17, 300])
def test_int4_dot_matches_ref(N, K, group, M, nan_empty):
    """The tensor-core kernel: decode rows padded to 16 (split along K where the few column blocks
    would leave SMs idle: here every M but 300, INTERPRET_SMS being 4), prefill rows in blocks of 64."""
    qweight, scales, zeros = int4_case(N, K, group)
    x = torch.randn(M, K, device=DEVICE)
    out = Q.int4_linear(x, qweight, scales, zeros, group, impl="triton", kernel="dot")
    assert out.shape == (M, N) and not out.isnan().any()
    assert rel(out, Q.int4_linear_ref(x, qweight, scales, zeros, group)) < 1e-5


@pytest.mark.parametrize("N, K", [(37, 200), (20, 512)])
@pytest.mark.parametrize("M", [1, 2, 5, 16, 17, 300])
def test_int8_dot_matches_ref(N, K, M, nan_empty):
    qweight, scale = int8_case(N, K)
    x = torch.randn(M, K, device=DEVICE)
    out = Q.int8_linear(x, qweight, scale, impl="triton", kernel="dot")
    assert out.shape == (M, N) and not out.isnan().any()
    assert rel(out, Q.int8_linear_ref(x, qweight, scale)) < 1e-5


@pytest.mark.parametrize("N, K, group", [(37, 384, 128), (33, 256, 32)])
@pytest.mark.parametrize("M", [1, 5, 16, 17])
@pytest.mark.parametrize("codes", ["random", "extreme"])
def test_int4_dot_fp16(N, K, group, M, codes, nan_empty):
    """fp16 x runs the decode tile's 16-bit path (the bf16 one but for its two constants; the
    interpreter's tl.dot is wrong on bf16): two weights a register, 1040 + code - zero made by integer
    operations. "extreme" puts code - zero at +15 and -15 (every code 15 and zero 0, or code 0 and
    zero 15, row by row), the ends of the range in which the halves must not carry into each other."""
    qweight, scales, zeros = int4_case(N, K, group)
    if codes == "extreme":
        high = (torch.arange(N, device=DEVICE) % 2 == 0)[:, None]
        qweight = torch.where(high, torch.full_like(qweight, -1), torch.zeros_like(qweight))
        zeros = torch.where(high, torch.zeros_like(zeros), torch.full_like(zeros, 15))
    x = torch.randn(M, K, device=DEVICE).half()
    out = Q.int4_linear(x, qweight, scales, zeros, group, impl="triton", kernel="dot")
    assert out.shape == (M, N) and out.isfinite().all()
    assert rel(out, Q.int4_linear_ref(x.float(), qweight, scales, zeros, group)) < 3e-3


@pytest.mark.parametrize("dtype, offset", [(torch.bfloat16, 144), (torch.float16, 1040)])
def test_int4_pair_pattern(dtype, offset):
    """The decode tile's 16-bit weights: the pattern PAIR_* (one half of it) plus code - zero, read as
    a float of x's dtype, is offset + code - zero exactly for every code and zero (bf16 runs only on
    the GPU, so its constant is checked here)."""
    from declab_kernels.quant_gemv import triton as T

    pair = (T.PAIR_BF16 if dtype == torch.bfloat16 else T.PAIR_FP16).value
    assert pair >> 16 == pair & 0xFFFF
    d = torch.arange(16)[:, None] - torch.arange(16)[None, :]  # code - zero
    bits = ((pair & 0xFFFF) + d).to(torch.int16)
    assert torch.equal(bits.view(dtype).float() - offset, d.float())


@pytest.mark.parametrize("split", [1, 2, 3, 4, 8])
def test_dot_split_k(split, nan_empty):
    """Every split count, those leaving splits without a tile too (int4: 6 tiles of 16 words at
    split 4 and 8; int8: 7 tiles of 32 codes at 8), equal to the reference and the same bits run to run."""
    from declab_kernels.quant_gemv import triton as T

    qweight, scales, zeros = int4_case(21, 768, 64)
    x = torch.randn(3, 768, device=DEVICE)
    got = T.int4_dot_triton(x, qweight, scales, zeros, 64, split=split)
    assert rel(got, Q.int4_linear_ref(x, qweight, scales, zeros, 64)) < 1e-5
    assert torch.equal(got, T.int4_dot_triton(x, qweight, scales, zeros, 64, split=split))
    q8, s8 = int8_case(21, 200)
    x8 = torch.randn(3, 200, device=DEVICE)
    got = T.int8_dot_triton(x8, q8, s8, split=split)
    assert rel(got, Q.int8_linear_ref(x8, q8, s8)) < 1e-5
    assert torch.equal(got, T.int8_dot_triton(x8, q8, s8, split=split))


def test_split_k_rule():
    from declab_kernels.quant_gemv.triton import MAX_SPLIT, split_k

    # llama-8b at 16 rows on 132 SMs, BLOCK_N 64: 4096 outputs split 4 ways, 14336 not at all.
    assert split_k(64, 8, 132) == 4 and split_k(224, 8, 132) == 1
    assert split_k(16, 100, 132) == MAX_SPLIT and split_k(16, 3, 132) == 2


def test_dispatch(monkeypatch):
    from declab_kernels import tuning

    monkeypatch.setattr(tuning, "QUANT_FMA_ROWS", {"int8": 1, "int4": 0})
    monkeypatch.setattr(tuning, "QUANT_DOT_ROWS", {"int8": 512, "int4": 256})
    assert [Q.int8_kernel(m) for m in (1, 2, 512, 513)] == ["fma", "dot", "dot", "dequant+cublas"]
    assert [Q.int4_kernel(m, 4096, 128) for m in (1, 2, 256, 257)] == ["dot", "dot", "dot", "dequant+cublas"]
    monkeypatch.setattr(tuning, "QUANT_FMA_ROWS", {"int8": 1, "int4": 2})
    assert [Q.int4_kernel(m, 4096, 128) for m in (1, 2, 3)] == ["fma", "fma", "dot"]
    # 25 words a row: no dot tile, so the GEMV up to its 4 rows, the dense path above.
    assert [Q.int4_kernel(m, 200, 40) for m in (1, 4, 5)] == ["fma", "fma", "dequant+cublas"]
    assert Q.int4_dot_words(512, 128) == 128 and Q.int4_dot_words(1792, 128) == 128 and Q.int4_dot_words(48, 32) == 16
    assert Q.int4_dot_words(25, 40) == 0 and Q.int4_dot_words(20, 32) == 0


def test_kernel_choice_refused():
    qweight, scales, zeros = int4_case(8, 200, 40)
    x = torch.randn(5, 200, device=DEVICE)
    with pytest.raises(ValueError, match="'fma' kernel cannot"):
        Q.int4_linear(x, qweight, scales, zeros, 40, impl="triton", kernel="fma")
    with pytest.raises(ValueError, match="'dot' kernel cannot"):
        Q.int4_linear(x, qweight, scales, zeros, 40, impl="triton", kernel="dot")
    q8, s8 = int8_case(8, 200)
    with pytest.raises(ValueError, match="kernel must be one of"):
        Q.int8_linear(x, q8, s8, impl="triton", kernel="cublas")
    with pytest.raises(ValueError, match="'fma' kernel cannot"):
        Q.int8_linear(torch.randn(Q.MAX_ROWS + 1, 200, device=DEVICE), q8, s8, impl="triton", kernel="fma")


def test_gemv_refuses_bad_x():
    from declab_kernels.quant_gemv.triton import int4_gemv_triton

    qweight, scales, zeros = int4_case(8, 64, 32)
    with pytest.raises(ValueError, match="x must be"):
        int4_gemv_triton(torch.randn(2, 72, device=DEVICE), qweight, scales, zeros, 32)


def gpu_only(test):
    return pytest.mark.gpu(pytest.mark.skipif(not GPU, reason="needs a GPU")(test))


@gpu_only
@pytest.mark.parametrize("N, K", [(4096, 4096), (14336, 4096), (4096, 14336), (2048, 8192), (3000, 2056)])
@pytest.mark.parametrize("M", [1, 4, 16, 40])
def test_bf16_gpu(N, K, M):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    qweight, scales, zeros = int4_case(N, K, 128 if K % 128 == 0 else 8)
    group = 128 if K % 128 == 0 else 8
    assert rel(Q.int4_linear(x, qweight, scales, zeros, group, impl="triton"), Q.int4_linear_ref(x, qweight, scales, zeros, group)) < 1e-2
    q8, s8 = int8_case(N, K)
    assert rel(Q.int8_linear(x, q8, s8, impl="triton"), Q.int8_linear_ref(x, q8, s8)) < 1e-2


@gpu_only
@pytest.mark.parametrize("N, K, M, kernel", [(4096, 4096, 1, "dot"), (14336, 4096, 512, "dot"), (4096, 4096, 512, "dequant+cublas"),
                                             (2048, 8192, 16, "dot")])
def test_bf16_gpu_kernels(N, K, M, kernel):
    """The candidates the benchmark times beside the dispatched kernel (dot at one row, the dense path
    at prefill rows), and the dot kernel's split-K at 2048 outputs."""
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    qweight, scales, zeros = int4_case(N, K, 128)
    got = Q.int4_linear(x, qweight, scales, zeros, 128, impl="triton", kernel=kernel)
    assert rel(got, Q.int4_linear_ref(x, qweight, scales, zeros, 128)) < 1e-2
    q8, s8 = int8_case(N, K)
    assert rel(Q.int8_linear(x, q8, s8, impl="triton", kernel=kernel), Q.int8_linear_ref(x, q8, s8)) < 1e-2


@gpu_only
@pytest.mark.parametrize("M", [1, 4])
def test_cuda_graph_replay(M):
    """The GEMV (1 row) and the dot kernel split along K (4 rows: 64 column blocks, split 4) replayed."""
    qweight, scales, zeros = int4_case(4096, 4096, 128)
    x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
    # Autotuning and compilation happen at the first call, outside the capture.
    expected = Q.int4_linear(x, qweight, scales, zeros, 128, impl="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = Q.int4_linear(x, qweight, scales, zeros, 128, impl="triton")
    x.normal_()
    graph.replay()
    assert rel(out, Q.int4_linear_ref(x, qweight, scales, zeros, 128)) < 1e-2
    assert not torch.equal(out, expected)


@pytest.mark.interpreter
@pytest.mark.parametrize("M, N, K, group", [(1, 9, 64, 32), (3, 17, 200, 40), (2, 5, 1024, 128), (1, 6, 24, 8)])
def test_int4_pdl_path(monkeypatch, M, N, K, group):
    """Weights before the wait, x and the output after it (test_pdl's guard), results bit for bit."""
    from test_pdl import run_pdl

    from declab_kernels.quant_gemv import triton as T

    def make():
        qweight, scales, zeros = int4_case(N, K, group)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
        config = dict(BLOCK_N=8, BLOCK_T=2)
        return (lambda: [T.int4_gemv_triton(x, qweight, scales, zeros, group, config=config)]), (x,)

    run_pdl(monkeypatch, "quant_gemv", make)


@pytest.mark.interpreter
@pytest.mark.parametrize("M, N, K", [(1, 9, 100), (4, 33, 300)])
def test_int8_pdl_path(monkeypatch, M, N, K):
    from test_pdl import run_pdl

    from declab_kernels.quant_gemv import triton as T

    def make():
        qweight, scale = int8_case(N, K)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
        return (lambda: [T.int8_gemv_triton(x, qweight, scale)]), (x,)

    run_pdl(monkeypatch, "quant_gemv", make)


@pytest.mark.interpreter
@pytest.mark.parametrize("M, split", [(2, 1), (5, 4), (17, 2)])
def test_dot_pdl_path(monkeypatch, M, split):
    """The dot kernels under PDL: weights (and int8's scales) before the wait; x, the output, the
    split-K partials and counters after it; results bit for bit, empty splits (4 of 3 tiles) included."""
    from test_pdl import run_pdl

    from declab_kernels.quant_gemv import triton as T

    def make():
        qweight, scales, zeros = int4_case(19, 384, 128)
        q8, s8 = int8_case(19, 96)
        x = torch.randn(M, 384, generator=torch.Generator().manual_seed(1))
        x8 = torch.randn(M, 96, generator=torch.Generator().manual_seed(2))
        return (lambda: [T.int4_dot_triton(x, qweight, scales, zeros, 128, split=split), T.int8_dot_triton(x8, q8, s8, split=split)]), (x, x8)

    run_pdl(monkeypatch, "quant_gemv", make)


@gpu_only
def test_gpu_pdl_equals_no_pdl(monkeypatch):
    qweight, scales, zeros = int4_case(4096, 4096, 128)
    q8, s8 = int8_case(4096, 4096)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)

    def chain():
        # Each product feeds the next: a PDL kernel reads what the one before it wrote.
        y = Q.int4_linear(x, qweight, scales, zeros, 128, impl="triton")
        return Q.int8_linear(y, q8, s8, impl="triton")

    with_pdl = chain()
    monkeypatch.setenv("DECLAB_PDL", "0")
    assert torch.equal(chain(), with_pdl)
