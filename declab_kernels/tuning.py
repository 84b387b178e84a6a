"""Every measured threshold of the decode steps, in one place (H200, bf16, graphed steps unless said).

The kernels, the model files and the decoders read these; each line says what it was measured at
and where the record is (`results/`). Change one only with a new measurement, recorded the same way.
It sits at the bottom of the import graph (eval -> decoders -> declab_arch -> declab_kernels), so
every layer may read it.
"""

# Rows up to which a projection may run as the Triton GEMV (fused or not) instead of cuBLAS: the
# per-shape measurement decides below it; more rows are cuBLAS's (declab_kernels/gemv/README.md,
# "When it runs"; results/gemv.jsonl at M = 1, 4, 8).
MAX_ROWS = 8

# Weight tiles a GEMV program loads before its PDL wait, unless a rule below says otherwise: one
# everywhere measured faster than two (mamba2-1.3b 1110 -> 1092 us, rwkv7-1.5b 1272 -> 1258 us at a55bdb9;
# results/step_ab.jsonl).
EARLY_TILES = 1

# Weight tiles loaded before the PDL wait by the GEMVs on either side of a latency-bound kernel that
# leaves HBM idle: llama's q/k/v and o projections around the decode attention (773b8ec, 58e3f42:
# llama-1b 882 -> 871 us at 4k, 1150 -> 1131 at 32k, 501 tok/s at 128k against 479; results/step_ab.jsonl,
# results/compare_early_tiles.jsonl) and Mamba-2's out_proj after its SSM step (below). After the short
# RWKV-7 norm kernels two were slower (980.9 -> 1036.5 us, `rwkv_early_tiles` in results/step_ab.jsonl).
EARLY_TILES_BESIDE_LATENCY = 2

# llama: packed rows up to which each RMSNorm runs inside the GEMV after it and each residual add inside
# the GEMV before it (1: llama-1b batch-1 step at 4k 859 -> 847 us; slower at 4 rows, where the
# norm kernel + GEMV pair wins; 2b4fe07, results/step_ab.jsonl).
FOLD_ROWS = 1

# Mamba-2: sequences up to which the SSM decode step applies the gate and writes the gated norm's
# statistics, out_proj adds the residual and writes the next norm's, and the next projection applies
# 1 / rms (mamba2-1.3b at 4k, e4d4587: 1394 -> 1338 us at 2, 1575 -> 1735 at 4, 1930 -> 2135 at 8;
# results/step_ab.jsonl).
GATE_IN_STEP_ROWS = 2

# Mamba-2: sequences up to which out_proj after the SSM step loads EARLY_TILES_BESIDE_LATENCY tiles
# before its PDL wait (0f3bd57, `out_proj_early_tiles`: batch 1 921 -> 901 us, batch 2 1347 -> 1361; results/step_ab.jsonl).
OUT_PROJ_EARLY_TILES_ROWS = 1

# RWKV-7: the r/k/v and LoRA down-projections of up to this many rows of mixed inputs (six per sequence)
# run unfused as one GEMM of every input by the whole packed weight (the wasted products cost nothing
# while the weight read dominates); above it as one batched GEMM for r/k/v and one for the LoRAs
# (results/LOG.md, rwkv7 fused step; the row-select GEMV covers up to MAX_ROWS sequences: abaac93,
# results/step_ab.jsonl `select_linear`, 1190 -> 1122 us at batch 1).
CROSS_ROWS = 96

# Paged decode attention: batches up to this size use the "long" kernel variant (half the splits,
# 16 KB tiles, flat merge): 0.23 / 0.63 / 0.88 of copy bandwidth at 4k / 32k / 128k (D=64) against
# the default "split" variant's 0.17 / 0.52 / 0.80 (results/paged_attention_b1.jsonl).
LONG_ATTENTION_BATCH = 1


def attention_variant(batch: int) -> str:
    """The paged decode attention's kernel variant for a batch of `batch` sequences."""
    return "long" if batch <= LONG_ATTENTION_BATCH else "split"


# Quantised linears (`declab_kernels.quant_gemv`), per weight format: rows up to which the CUDA-core
# GEMV runs ("fma"); from the next row up to QUANT_DOT_ROWS the dequantising tensor-core kernel ("dot");
# above it dequantise + cuBLAS. From the H200 (bc19fe3, results/quant_gemv.jsonl, both candidates at
# M = 1 and 512): at one row int8's GEMV beat the dot kernel 1.5-2.2x at every llama shape (4096 x 4096:
# 6.7 against 15.0 us) while int4's dot kernel beat its GEMV 1.1-2.1x (9.9 against 16.0), so int4 takes
# the dot kernel from one row. At 512 rows the dense path won for both (4096 x 4096: int4 62 against
# 109 us, int8 37 against 67); the crossovers, interpolated linearly between 16 and 512 rows, lie near
# 250 rows (int4) and 130 (int8): not yet measured between those points (the benchmark now adds 128).
QUANT_FMA_ROWS = {"int8": 1, "int4": 0}
QUANT_DOT_ROWS = {"int8": 128, "int4": 256}
