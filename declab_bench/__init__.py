"""declab_bench: the lab's measurement tooling, outside the product.

Per-kernel GPU benchmarks (`python -m declab_bench.gemv|paged_attention|ssd|wkv7 --out FILE`), the
offline sm_90 compile check of the decode-step kernels (`python -m declab_bench.pdl_check`), the
graphed decode-step A/B (`python -m declab_bench.step_ab`), the decode attention's per-phase timeline
(`python -m declab_bench.attention_timeline`) and the shell suites that run them on a GPU machine
(`declab_bench/gpu_suite.sh`, `declab_bench/serving_suite.sh`). It imports the product
(`declab_kernels`, `decoders`); nothing in the product imports it.
"""
