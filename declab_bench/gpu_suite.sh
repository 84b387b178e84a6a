#!/usr/bin/env bash
# One call on a CUDA machine: the GPU tests, the kernel benchmarks and the compare sweeps, each stage
# bounded in time, results under OUT_DIR (JSON lines, one file per benchmark) and every stage's
# output in OUT_DIR/suite.log (few files: the machine's transfer back counts them).
#
#   declab_bench/gpu_suite.sh OUT_DIR tests fused profile gemv kernels prefill wkv7 compare-triton compare-8b compare-batch peers ablation quant-quality compare-ref
#   declab_bench/gpu_suite.sh OUT_DIR gpu-tests version-ab quant-gemv compare-quant kv-fp8 persistent-tests persistent   (GPU_TESTS: the test files; AB_BEFORE: the baseline tree)
#
# Triton's compiled kernels and the GEMV picks can outlive a machine: the stage save-cache packs the
# cache into OUT_DIR/triton-cache-part-* (15 MB pieces), the picks are in OUT_DIR/gemv_choices.jsonl,
# and TRITON_CACHE_SEED=FOLDER holding such files seeds a later call on a fresh machine (seed.sh).
#
# Peers (flash-linear-attention, mamba-ssm) are used when importable; put wheels in WHEEL_DIR
# (default .whl) to have them installed into a scratch folder first. On a copy of the tree without
# its .git, set DECLAB_GIT_SHA (and DECLAB_GIT_DIRTY=1 if needed) so every record names its commit.
set -uo pipefail
out=${1:?usage: declab_bench/gpu_suite.sh OUT_DIR STAGE...}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# Autotuning results (fla's kernels tune for minutes) kept on disk, so later stages reuse them.
export TRITON_CACHE_AUTOTUNING=1
wheels=${WHEEL_DIR:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/declab-peers "$wheels"/*.whl \
    && export PYTHONPATH="/tmp/declab-peers:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
source "$(dirname "$0")/seed.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader

log="$out/suite.log"
stage() {  # stage NAME SECONDS COMMAND...: run, log, never stop the suite
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date +%T), limit ${limit}s)" | tee -a "$log"
  timeout "$limit" "$@" >"/tmp/declab-stage.log" 2>&1
  local rc=$?
  cat /tmp/declab-stage.log >>"$log"
  echo "=== $name rc=$rc ($(date +%T))" | tee -a "$log"
  tail -n 25 /tmp/declab-stage.log
}

eval_setup() {  # eval_setup DIR: lm-eval's wheels (EVAL_WHEEL_DIR) installed, ABL_CORPUS's tokenizer copied into DIR
  if compgen -G "${EVAL_WHEEL_DIR:-.whl-eval}/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/declab-eval "${EVAL_WHEEL_DIR:-.whl-eval}"/*.whl
  fi
  mkdir -p "$1"
  if [ -d "${ABL_CORPUS:-.corpus}/tokenizer" ]; then cp -r "${ABL_CORPUS:-.corpus}/tokenizer" "$1/"; fi
}

for s in "$@"; do
  case $s in
    tests)
      for f in $(grep -l "mark.gpu\|mark\.gpu\|@gpu\|GPU\b" -r tests --include "test_*.py" | sort); do
        stage "tests_$(basename "$f" .py)" "${TEST_LIMIT:-60}" python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf "$f"
      done ;;
    fused)  # every test of the fused decode kernels, on the GPU (bf16 and float32)
      stage tests_fused 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/kernels/test_rmsnorm.py tests/kernels/test_rotary.py \
        tests/kernels/test_swiglu.py tests/kernels/test_mamba2_norm.py tests/kernels/test_rwkv7_fused.py ;;
    profile)
      for m in llama-1b mamba2-1.3b rwkv7-1.5b; do
        stage "profile_$m" 90 python3 -m decoders.profile --model "$m" --ctx 4k --out "$out/profile.jsonl"
      done ;;
    kernels)
      stage paged_attention 170 python3 -m declab_bench.paged_attention --budget-s 120 --flex-budget-s 80 --out "$out/paged_attention.jsonl"
      stage ssd 120 python3 -m declab_bench.ssd --out "$out/ssd.jsonl"
      stage wkv7 120 python3 -m declab_bench.wkv7 --out "$out/wkv7.jsonl" ;;
    # The causal prefill against SDPA's flash backend at D 128 and 64, and the tile sweep (issue 33's TTFT item).
    prefill) stage prefill "${PREFILL_LIMIT:-180}" python3 -m declab_bench.paged_attention --sections prefill,prefill_tuning --budget-s 150 --out "$out/paged_attention.jsonl" ;;
    wkv7) stage wkv7 "${WKV7_LIMIT:-150}" python3 -m declab_bench.wkv7 --out "$out/wkv7.jsonl" ${WKV7_ARGS:-} ;;
    gemv) stage gemv 120 python3 -m declab_bench.gemv --out "$out/gemv.jsonl" ;;
    compare-batch) stage compare_batch 240 python3 -m decoders.compare --no-progress --impl triton \
        --models llama-1b,mamba2-1.3b,rwkv7-1.5b --ctx "${BATCH_CTX:-4k,32k}" --batch 16,64 --new-tokens 16 --out "$out/compare_batch.jsonl" ;;
    # Peers alone (each compiles or captures per context) beside a compare-triton sweep of the lab.
    peers) stage compare_peers "${PEER_LIMIT:-420}" python3 -m decoders.compare --no-progress --impl triton --peers "${PEERS:-hf,mamba_ssm,fla}" --peers-only ${POINT_TIMEOUT:+--point-timeout $POINT_TIMEOUT} \
        --models llama-1b,mamba2-1.3b,rwkv7-1.5b --ctx "${PEER_CTX:-4k,32k,128k}" --batch 1 --out "$out/compare_peers.jsonl" ;;
    compare-triton) stage compare_triton 330 python3 -m decoders.compare --no-progress --impl triton \
        --models llama-1b,mamba2-1.3b,rwkv7-1.5b --ctx 4k..128k --batch 1 --out "$out/compare_triton.jsonl" --plot "$out/scaling.png" ;;
    compare-8b) stage compare_8b "${LIMIT_8B:-240}" python3 -m decoders.compare --no-progress --impl triton \
        --models llama-8b --ctx "${CTX_8B:-4k,32k,128k}" --batch 1 --out "$out/compare_8b.jsonl" ;;
    # The quality ablation (eval.ablation): lm-eval and its dependencies from EVAL_WHEEL_DIR (default
    # .whl-eval), the corpus folder ABL_CORPUS (default .corpus, with an optional pre-trained
    # tokenizer in ABL_CORPUS/tokenizer), the arguments in ABL_ARGS.
    ablation)
      eval_setup "$out/ablation"
      PYTHONPATH="/tmp/declab-eval:$PYTHONPATH" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 HF_HOME=/tmp/declab-hf \
        stage ablation "${ABL_LIMIT:-540}" python3 -m eval.ablation --corpus "${ABL_CORPUS:-.corpus}" --out "$out/ablation" ${ABL_ARGS:---time-budget 190} ;;
    # The ablation with its quantised half (--quant) on the four 30M presets, sized for about 300 s
    # (training 90 s of it); the same set-up as ablation, QQ_ARGS in place of the sizing.
    quant-quality)
      eval_setup "$out/quant_quality"
      PYTHONPATH="/tmp/declab-eval:$PYTHONPATH" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 HF_HOME=/tmp/declab-hf \
        stage quant_quality "${QQ_LIMIT:-450}" python3 -m eval.ablation --corpus "${ABL_CORPUS:-.corpus}" --out "$out/quant_quality" \
        --quant none,int8,int4-rtn,int4 ${QQ_ARGS:---time-budget 90 --task-docs 40 --mp-iterations= --genppl-prompts 0 --calib-sequences 64 --eval-args dtype=bfloat16,max_length=512,batch_size=32} ;;
    compare-ref) stage compare_ref 300 python3 -m decoders.compare --no-progress --impl ref \
        --models llama-1b,mamba2-1.3b,rwkv7-1.5b --ctx 4k..128k --batch 1 --new-tokens 16 --out "$out/compare_ref.jsonl" ;;
    # GPU_TEST_WORKERS=N: N pytest processes (pytest-xdist) share the GPU, so Triton compiles on N cores;
    # -v names each test as it ends, so a run stopped by its limit still says which passed.
    gpu-tests) stage gpu_tests "${TEST_LIMIT:-240}" python3 -m pytest -v -m gpu -p no:cacheprovider --tb=short -rf \
        ${GPU_TEST_WORKERS:+-n $GPU_TEST_WORKERS} ${GPU_TESTS:?GPU_TESTS: the test files} ;;
    # The graphed decode step of the baseline tree AB_BEFORE against this one (tokens and step times).
    version-ab) stage version_ab "${AB_LIMIT:-330}" python3 -m declab_bench.version_ab "$out/version_ab.jsonl" \
        --tree before="${AB_BEFORE:?AB_BEFORE: the baseline source tree}" --tree after=. ${AB_ARGS:-} ;;
    quant-gemv) stage quant_gemv 170 python3 -m declab_bench.quant_gemv --out "$out/quant_gemv.jsonl" ;;
    kv-fp8) stage kv_fp8 "${FP8_LIMIT:-200}" python3 -m decoders.compare --no-progress --impl triton --models "${FP8_MODEL:-llama-1b}" \
        --ctx "${FP8_CTX:-128k}" --batch 1 --kv-dtype bf16,fp8 --out "$out/compare_kv_fp8.jsonl" ;;
    # The persistent decode step (issue 35, llama, Mamba-2 and RWKV-7): its GPU tests; then against the graphed step, then its timeline
    # (PERSIST_MODELS, PERSIST_CTX and PERSIST_TIMELINE_MODELS narrow the sweep).
    persistent-tests) stage tests_persistent "${PERSIST_TEST_LIMIT:-240}" python3 -m pytest -v -m gpu -p no:cacheprovider --tb=short -rf \
        ${GPU_TEST_WORKERS:+-n $GPU_TEST_WORKERS} tests/decoders/test_persistent_families.py \
        tests/kernels/test_persistent_step.py tests/bench/test_persistent_timeline.py ;;
    persistent)
      stage compare_persistent "${PERSIST_LIMIT:-300}" python3 -m decoders.compare --no-progress --impl triton --models "${PERSIST_MODELS:-llama-1b,mamba2-1.3b,rwkv7-1.5b}" \
        --ctx "${PERSIST_CTX:-4k,32k,128k}" --batch 1 --step graphed,persistent --point-timeout 300 --out "$out/persistent.jsonl"
      for m in ${PERSIST_TIMELINE_MODELS:-llama-1b mamba2-1.3b rwkv7-1.5b}; do
        stage "persistent_timeline_$m" "${PERSIST_TIMELINE_LIMIT:-120}" python3 -m declab_bench.persistent_timeline --model "$m" --ctx 4k --out "$out/persistent_timeline.jsonl"
      done ;;
    # Quantised decoding against bf16 in one run (issue 31): llama-1b and llama-8b at 4k, batch 1 (QUANT_MODELS, QUANT_KINDS).
    compare-quant) stage compare_quant "${QUANT_LIMIT:-300}" python3 -m decoders.compare --no-progress --impl triton --models "${QUANT_MODELS:-llama-1b,llama-8b}" \
        --ctx 4k --batch 1 --quant "${QUANT_KINDS:-none,int8,int4-rtn}" --out "$out/compare_quant.jsonl" ;;
    save-cache) tar -cz -C "$TRITON_CACHE_DIR" . | split -b 15m - "$out/triton-cache-part-" && ls -la "$out"/triton-cache-part-* ;;
    *) echo "unknown stage $s" ;;
  esac
done
