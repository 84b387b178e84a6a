#!/usr/bin/env bash
# One call on a CUDA machine: the serving engine, its benchmark, the server and speculative decoding
# measured in stages, each bounded by its own limit and by a deadline for the whole call, every
# stage's output in one log, results as JSON lines under OUT_DIR (few files: the machine's
# transfer back counts them).
#
#   declab_bench/serving_suite.sh OUT_DIR SECONDS STAGE...   (stages: deps tests engine64 compare64 sb8b bursty b256 http spec;
#   env: SB8B_RATES, SB8B_STEP_TOKENS, SB8B_LIMIT, BURSTY_RATE, B256_MODELS, B256_CTX, B256_NEW, B256_LIMIT)
#
# Wheels for the server and the HTTP client are installed from WHEEL_DIR (default .whl-serve) when
# the machine lacks them; TRITON_CACHE_SEED seeds Triton's cache and the GEMV picks as in gpu_suite.sh
# (seed.sh; the save-cache stage is gpu_suite.sh's); CORPUS (default .corpus, a folder of train / valid / test shards) is the spec stage's training text.
set -uo pipefail
out=${1:?usage: declab_bench/serving_suite.sh OUT_DIR SECONDS STAGE...}
deadline=$((SECONDS + ${2:?seconds for the whole call}))
shift 2
mkdir -p "$out"
export work=/tmp/serving_suite
mkdir -p "$work"
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
log="$out/suite.log"
source "$(dirname "$0")/seed.sh"

stage() {  # stage NAME SECONDS COMMAND...: run under min(SECONDS, time left), log, never stop the suite
  local name=$1 limit=$2 left=$((deadline - SECONDS))
  shift 2
  ((left < limit)) && limit=$left
  if ((limit < 10)); then echo "=== $name skipped: the call's deadline" | tee -a "$log"; return; fi
  echo "=== $name ($(date +%T), limit ${limit}s)" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  echo "=== $name rc=$? ($(date +%T))" | tee -a "$log"
}

http_stage() {  # the same seeded workload through the server over HTTP, then in-process
  local args=(--models "${HTTP_MODEL:-llama-1b}" --rate 8 --duration 10 --prompt-len 1024 --output-len 256 --no-progress --slo ttft=500ms,itl=50ms)
  python3 -m decoders.serve --model "${HTTP_MODEL:-llama-1b}" --port 8000 --max-waiting 4096 --log-level warning &
  local server=$!
  python3 -c "
import time, urllib.request
for _ in range(240):
    try:
        urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2); break
    except Exception: time.sleep(0.5)"
  python3 -m decoders.serve_bench "${args[@]}" --target http://127.0.0.1:8000 --out "$work/serve_http.jsonl"
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/metrics').read().decode()[-3000:])"
  kill -TERM $server; wait $server
  python3 -m decoders.serve_bench "${args[@]}" --out "$work/serve_http.jsonl"
}
export -f http_stage

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee -a "$log"
for s in "$@"; do
  case $s in
    deps) stage deps 60 python3 -m pip install -q --no-index --find-links "${WHEEL_DIR:-.whl-serve}" starlette uvicorn httpx openai aiohttp ;;
    tests) stage tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf tests/decoders/test_engine.py \
        tests/decoders/test_serve.py tests/decoders/test_serve_bench.py tests/decoders/test_speculative.py tests/arch/test_checkpoint.py \
        tests/decoders/test_gate_long_context.py tests/kernels/test_compile_log.py ;;
    engine64) for m in llama-1b mamba2-1.3b rwkv7-1.5b; do
        stage "engine64_$m" 70 python3 -m decoders.engine --model "$m" --batch 64 --ctx 1024 --new-tokens 256 --out "$out/engine.jsonl"
      done ;;
    compare64) stage compare64 110 python3 -m decoders.compare --no-progress --impl triton --models llama-1b,mamba2-1.3b,rwkv7-1.5b \
        --ctx 1k --batch 64 --new-tokens 256 --out "$out/compare_b64.jsonl" ;;
    # llama-8b loads, warms up (~25-35 s) and drains each point's last requests: 4 points need ~210 s.
    sb8b) stage sb8b "${SB8B_LIMIT:-300}" python3 -m decoders.serve_bench --models llama-8b --prompt-len 1024 --output-len 256 --rate "${SB8B_RATES:-8,16,32,inf}" \
        --max-step-tokens "${SB8B_STEP_TOKENS:-2048}" --duration 10 --slo ttft=500ms,itl=50ms --no-progress --out "$work/serve_bench.jsonl" ;;
    bursty) stage bursty 160 python3 -m decoders.serve_bench --models llama-1b,mamba2-1.3b,rwkv7-1.5b --prompt-len 1024 --output-len 256 \
        --rate "${BURSTY_RATE:-12}" --arrivals poisson,bursty --burst-period 5 --duration 10 --slo ttft=500ms,itl=50ms --no-progress --out "$work/serve_bench.jsonl" ;;
    # 256 requests of 4k: a step budget of 16384 tokens prefills them all before the first finishes its
    # 256 tokens (at 2048 none of the steps has all 256 decoding). rwkv7 took 69 s, mamba2 84 s.
    b256) for m in ${B256_MODELS:-mamba2-1.3b rwkv7-1.5b llama-1b}; do
        stage "b256_$m" "${B256_LIMIT:-120}" python3 -m decoders.engine --model "$m" --batch 256 --ctx "${B256_CTX:-4096}" --new-tokens "${B256_NEW:-256}" \
          --max-step-tokens 16384 --out "$out/engine.jsonl"
      done ;;
    http) stage http 130 bash -c http_stage ;;
    spec) stage spec 300 python3 -m eval.spec_study --corpus "${CORPUS:-.corpus}" --out "$out/spec.jsonl" --work "$work/spec" \
        --train-seconds 45 --draft-seconds 10 --heads-seconds 10 --batch 1,8 ;;
    *) echo "unknown stage $s" | tee -a "$log" ;;
  esac
done
for f in serve_bench serve_http; do [ -f "$work/$f.jsonl" ] && cp "$work/$f.jsonl" "$out/"; done
ls -la "$out"
