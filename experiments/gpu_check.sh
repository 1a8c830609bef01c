#!/usr/bin/env bash
# One pass over everything that needs a GPU, for a machine lent for a short while: device facts, the `gpu` test
# tier (both kernels compiled natively and checked against their references), the kernel benchmark with its
# same-run bandwidth/FLOP peaks, and a GPU run of chosen fast-tier modules (the generator with the kernels as the
# "auto" implementation). Each stage has its own time limit, so one hang does not eat the rest; logs and JSON go
# to $OUT (default experiments/results/tmp).
#
#   bash experiments/gpu_check.sh [stage ...]      stages: facts build gpu_tier bench bench_large fast_tier (the default)
#                                                   and, on SmolLM2 (MODEL: a .gguf path, default the embedded name):
#                                                   speculative (bench_speculative at batch 1 and 4, with each
#                                                   drafter's outputs compared with plain decoding's) and price
#                                                   (ngram_bound --price: a verification's cost by width)
#
# Needs the project's dependencies importable (pip install -e ".[cuda12,test]"); wheels placed in .whl/ are
# installed first into /tmp/site (for a machine without a package index).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-experiments/results/tmp}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
PYTEST=($PY -m pytest -p pallas_kernels.pytest_plugin -q -ra)
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(facts build gpu_tier bench bench_large fast_tier)
FAST_MODULES=${FAST_MODULES:-tests}
FAST_TIMEOUT=${FAST_TIMEOUT:-330}
FAST_WORKERS=${FAST_WORKERS:-14}
MODEL=${MODEL:-smollm2-135m}

for stage in "${stages[@]}"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case $stage in
    facts)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv
      $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
      ;;
    build)  # the native CPU kernel, in place (the tree runs from source here): its tests check the build
      $PY setup.py -q build_ext --inplace 2>&1 | grep -i "not built\|error" ; ls pallas_kernels/*.so
      ;;
    gpu_tier)
      timeout 240 "${PYTEST[@]}" -n 0 -m gpu -s tests/pallas_kernels 2>&1 | tee "$OUT/gpu_tier.log" | tail -40
      ;;
    bench)
      timeout 120 $PY -m experiments.bench_kernels --json_out "$OUT/kernels_gpu.json" 2>&1 | tee "$OUT/bench.log" \
        | tail -30
      ;;
    bench_large)  # shapes that fill the GPU: Llama-3-8B heads (8 KV x 4 x 128), bf16 cache, 7B-sized matmuls
      timeout 170 $PY -m experiments.bench_kernels --heads 8x4x128 --page_size 16 --cache_dtype bfloat16 \
        --attn_shapes decode64x4096,decode256x2048,prefill2048x2048,mixed512+64x2048 \
        --matmul_shapes 1x4096x14336,16x4096x14336,64x4096x14336,256x4096x14336 --kinds q4_1,int8 \
        --json_out "$OUT/kernels_gpu_large.json" 2>&1 | tee "$OUT/bench_large.log" | tail -30
      ;;
    fast_tier)  # exact-token tests compare with float32 references: no TF32 in the GPU's float32 dots. Each test's
      # outcome is logged as it finishes (-vv against PYTEST's -q), so a run cut by its time limit still names its
      # failures (on the H200 the whole fast tier takes more than 300 s)
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout $FAST_TIMEOUT "${PYTEST[@]}" -vv -n $FAST_WORKERS -m "not slow" \
        $FAST_MODULES --maxfail=30 >"$OUT/fast_tier.log" 2>&1
      echo "fast_tier rc=$?"; grep -E "FAILED|ERROR" "$OUT/fast_tier.log" | head -40; tail -5 "$OUT/fast_tier.log"
      ;;
    speculative)
      timeout 200 $PY -m experiments.bench_speculative --model "$MODEL" --drafters none,ngram,ngram_adaptive \
        --batch_sizes 1,4 --num_prompts 16 --max_new_tokens 96 --json_out "$OUT/speculative_gpu.json" 2>&1 \
        | tee "$OUT/speculative.log" | tail -20
      ;;
    price)
      timeout 160 $PY -m experiments.ngram_bound --model "$MODEL" --price --json_out "$OUT/ngram_bound_gpu.json" 2>&1 \
        | tee "$OUT/price.log" | tail -12
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
