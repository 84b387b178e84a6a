# Sourced by gpu_suite.sh and serving_suite.sh after OUT_DIR is made: what a fresh machine can reuse
# from an earlier call. TRITON_CACHE_DIR (default /tmp/declab-triton-cache) receives the pieces
# TRITON_CACHE_SEED/triton-cache-part-* (the save-cache stage's), and DECLAB_GEMV_CHOICES (default
# OUT_DIR/gemv_choices.jsonl, so that it comes back with the results) starts from
# TRITON_CACHE_SEED/gemv_choices.jsonl: the GEMV picks of the earlier call, neither measured nor
# compiled again.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/declab-triton-cache}
export DECLAB_GEMV_CHOICES=${DECLAB_GEMV_CHOICES:-$out/gemv_choices.jsonl}
mkdir -p "$TRITON_CACHE_DIR"
if [ -n "${TRITON_CACHE_SEED:-}" ]; then
  if compgen -G "$TRITON_CACHE_SEED/triton-cache-part-*" >/dev/null; then
    cat "$TRITON_CACHE_SEED"/triton-cache-part-* | tar -xz -C "$TRITON_CACHE_DIR" && echo "triton cache: unpacked from $TRITON_CACHE_SEED"
  fi
  if [ -f "$TRITON_CACHE_SEED/gemv_choices.jsonl" ] && [ ! -f "$DECLAB_GEMV_CHOICES" ]; then
    cp "$TRITON_CACHE_SEED/gemv_choices.jsonl" "$DECLAB_GEMV_CHOICES" && echo "gemv choices: $(wc -l <"$DECLAB_GEMV_CHOICES") from $TRITON_CACHE_SEED"
  fi
fi
