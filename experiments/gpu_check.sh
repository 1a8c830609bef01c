#!/usr/bin/env bash
# The GPU campaign: one pass over everything that needs a GPU, for a machine lent for a short while. Device facts,
# the native CPU kernel built in place, the `gpu` test tier (the kernels compiled natively and checked against their
# references), the end-to-end benchmark on the presets (bench_e2e: decode tok/s against the copy-rate roofline) and
# the kernel sweeps (bench_kernels with its same-run peaks, at SmolLM2's and at Llama-3-8B's shapes). Each stage runs
# under its own time limit, cut to what is left of the campaign's BUDGET_S (default 690 s, what the default stages'
# limits add up to: the campaign fits in 12 minutes with the machine's start), so one hang does not eat the rest.
# Logs, JSON records and plots go to $OUT (default
# experiments/results/tmp), named by device (DEVICE, default from nvidia-smi: h100, h200, ...).
#
#   bash experiments/gpu_check.sh [stage ...]
#
# Default stages: facts build gpu_tier e2e bench bench_large. `e2e` is e2e_8b_bf16 e2e_8b_q4 e2e_1b e2e_smollm2
# (each also a stage of its own): Llama-3-8B in bf16 and q4_0 at batch 1/16/64/256, Llama-3.2-1B in bf16 at batch
# 1/16/64, and the embedded SmolLM2 (MODEL: a .gguf path, default the embedded name) single stream; records
# $OUT/e2e_<device>_<name>.json and .png; bench_large times pallas_gemv beside the tensor-core kernel. More stages,
# not in the default: gemv (pallas_gemv against pallas and XLA at 1-16 rows, for tuned_tables.GEMV_MAX_ROWS),
# fast_tier (the fast test tier on the GPU), split_decode (a mixed step's decode rows split over keys with
# split_max_q=1, against the unsplit default blocking, at Llama-3-8B's heads: every candidate's time in the record),
# speculative (bench_speculative at batch 1 and 4 on SmolLM2, each drafter's outputs compared with plain
# decoding's) and price (ngram_bound --price: a verification's cost by width).
#
# DRY_RUN=1 prints each command (to stderr, as `+ timeout LIMIT command ...`) instead of running it: the tests parse
# the printed command lines' flags on the CPU (tests/experiments/test_gpu_check.py).
#
# Needs the project's dependencies importable (pip install -e ".[cuda12,test]"); wheels placed in .whl/ are
# installed first into /tmp/site (for a machine without a package index).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-experiments/results/tmp}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
DRY_RUN=${DRY_RUN:-}
BUDGET_S=${BUDGET_S:-690}
START=$SECONDS
if [ -z "$DRY_RUN" ] && compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
PYTEST=($PY -m pytest -p pallas_kernels.pytest_plugin -q -ra)
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(facts build gpu_tier e2e bench bench_large)
FAST_MODULES=${FAST_MODULES:-tests}
FAST_TIMEOUT=${FAST_TIMEOUT:-330}
FAST_WORKERS=${FAST_WORKERS:-14}
MODEL=${MODEL:-smollm2-135m}
if [ -z "${DEVICE:-}" ]; then  # "NVIDIA H100 80GB HBM3" -> h100
  DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | sed 's/^NVIDIA //' \
    | awk '{print tolower($1)}' | tr -c 'a-z0-9\n' _)
  DEVICE=${DEVICE:-nogpu}
fi
exec 3>&2  # DRY_RUN prints here, past the stages' own redirections

run() {  # run LIMIT COMMAND...: COMMAND under `timeout`, LIMIT seconds cut to what is left of BUDGET_S
  local limit=$1 left=$((BUDGET_S - (SECONDS - START)))
  shift
  ((left < limit)) && limit=$left
  if [ -n "$DRY_RUN" ]; then
    printf '+ timeout %s' "$limit" >&3; printf ' %q' "$@" >&3; echo >&3
    return 0
  fi
  if ((limit < 5)); then
    echo "skipped: the campaign's BUDGET_S=$BUDGET_S s are spent"
    return 124
  fi
  timeout "$limit" "$@"
}

# Shared by the e2e stages: a bf16 cache in pages of 16 (as bench_large), 8 decode steps per dispatch, 512 tokens of
# context per row, a 2048-token prompt prefilled 512 tokens per step, compiled programs shared between the stages.
E2E_FLAGS=(--cache_dtype bfloat16 --page_size 16 --decode_steps 8 --context 512 --tokens 32 --prefill_tokens 2048
           --max_chunk_size 512 --compilation_cache_dir "$OUT/jax_cache_e2e")

e2e() {  # e2e LIMIT NAME FLAGS...: bench_e2e, its record, plot and log named by device and NAME
  local limit=$1 name=e2e_${DEVICE}_$2
  shift 2
  run "$limit" $PY -m experiments.bench_e2e "${E2E_FLAGS[@]}" "$@" --json_out "$OUT/$name.json" \
    --plot "$OUT/$name.png" 2>&1 | tee "$OUT/$name.log" | tail -12
}

e2e_stage() {  # one model's bench_e2e
  case $1 in
    e2e_8b_bf16) e2e 110 llama3-8b_bf16 --model preset:llama3-8b@bf16 --batch_sizes 1,16,64,256 ;;
    e2e_8b_q4) e2e 100 llama3-8b_q4_0 --model preset:llama3-8b@q4_0 --batch_sizes 1,16,64,256 ;;
    e2e_1b) e2e 50 llama3.2-1b_bf16 --model preset:llama3.2-1b@bf16 --batch_sizes 1,16,64 ;;
    e2e_smollm2) e2e 40 smollm2-135m --model "$MODEL" --batch_sizes 1 ;;
    *) echo "unknown stage $1"; exit 2 ;;
  esac
}

for stage in "${stages[@]}"; do
  echo "=== $stage $(date -u +%H:%M:%S) ($((SECONDS - START)) s of $BUDGET_S)"
  case $stage in
    facts)
      run 10 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,clocks.max.sm --format=csv
      run 15 $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
      ;;
    build)  # the native CPU kernel, in place (the tree runs from source here): its tests check the build
      run 60 $PY setup.py -q build_ext --inplace 2>&1 | grep -i "not built\|error"
      [ -n "$DRY_RUN" ] || ls pallas_kernels/*.so
      ;;
    gpu_tier)
      run 100 "${PYTEST[@]}" -n 0 -m gpu -s tests/pallas_kernels 2>&1 | tee "$OUT/gpu_tier_$DEVICE.log" | tail -40
      ;;
    e2e) for s in e2e_8b_bf16 e2e_8b_q4 e2e_1b e2e_smollm2; do e2e_stage $s; done ;;
    e2e_*) e2e_stage "$stage" ;;
    bench)
      run 75 $PY -m experiments.bench_kernels --json_out "$OUT/kernels_$DEVICE.json" 2>&1 \
        | tee "$OUT/bench_$DEVICE.log" | tail -30
      ;;
    bench_large)  # shapes that fill the GPU: Llama-3-8B heads (8 KV x 4 x 128), bf16 cache, 7B-sized matmuls
      run 130 $PY -m experiments.bench_kernels --heads 8x4x128 --page_size 16 --cache_dtype bfloat16 \
        --attn_shapes decode64x4096,decode256x2048,prefill2048x2048,mixed512+64x2048 \
        --matmul_shapes 1x4096x14336,16x4096x14336,64x4096x14336,256x4096x14336 --kinds q4_1,int8 \
        --matmul_impls pallas,pallas_gemv,xla \
        --json_out "$OUT/kernels_${DEVICE}_large.json" 2>&1 | tee "$OUT/bench_large_$DEVICE.log" | tail -30
      ;;
    split_decode)  # a mixed step (a 512-token chunk and 64 or 256 decode rows): the kernel's default blocking for it
      # (block_q 16, 4 pages of 16 per block) unsplit, and with the decode rows split over 2, 4, 8 programs
      # (split_max_q=1: the chunk attended whole); tuned[].timings in the record has each candidate's time
      run 120 $PY -m experiments.bench_kernels --ops attention --attn_impls pallas --heads 8x4x128 --page_size 16 \
        --cache_dtype bfloat16 --attn_shapes mixed512+64x2048,mixed512+256x2048 --sweep \
        --sweep_fix block_q=16,pages_per_block=4 --json_out "$OUT/split_decode_$DEVICE.json" 2>&1 \
        | tee "$OUT/split_decode_$DEVICE.log" | tail -30
      ;;
    gemv)  # pallas_gemv against the tensor-core kernel and XLA by rows (sets tuned_tables.GEMV_MAX_ROWS), and its
      # int-to-float conversion by cast instead of mantissa bits
      run 150 $PY -m experiments.bench_kernels --ops matmul --matmul_impls pallas,pallas_gemv,xla \
        --matmul_shapes 1x4096x14336,4x4096x14336,8x4096x14336,16x4096x14336 --kinds q4_1,q4_0,int8 \
        --json_out "$OUT/gemv_$DEVICE.json" 2>&1 | tee "$OUT/gemv_$DEVICE.log" | tail -30
      run 90 $PY -m experiments.bench_kernels --ops matmul --matmul_impls pallas_gemv \
        --matmul_tuning int_to_float=cast --matmul_shapes 1x4096x14336,4x4096x14336 --kinds q4_1,int8 \
        --json_out "$OUT/gemv_cast_$DEVICE.json" 2>&1 | tail -12
      ;;
    fast_tier)  # exact-token tests compare with float32 references: no TF32 in the GPU's float32 dots. Each test's
      # outcome is logged as it finishes (-vv against PYTEST's -q), so a run cut by its time limit still names its
      # failures (on the H200 the whole fast tier takes more than 300 s)
      run "$FAST_TIMEOUT" env JAX_DEFAULT_MATMUL_PRECISION=highest "${PYTEST[@]}" -vv -n "$FAST_WORKERS" \
        -m "not slow" $FAST_MODULES --maxfail=30 >"$OUT/fast_tier_$DEVICE.log" 2>&1
      echo "fast_tier rc=$?"; grep -E "FAILED|ERROR" "$OUT/fast_tier_$DEVICE.log" | head -40
      tail -5 "$OUT/fast_tier_$DEVICE.log"
      ;;
    speculative)
      run 200 $PY -m experiments.bench_speculative --model "$MODEL" --drafters none,ngram,ngram_adaptive \
        --batch_sizes 1,4 --num_prompts 16 --max_new_tokens 96 --json_out "$OUT/speculative_$DEVICE.json" 2>&1 \
        | tee "$OUT/speculative_$DEVICE.log" | tail -20
      ;;
    price)
      run 160 $PY -m experiments.ngram_bound --model "$MODEL" --price --json_out "$OUT/ngram_bound_$DEVICE.json" \
        2>&1 | tee "$OUT/price_$DEVICE.log" | tail -12
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S) ($((SECONDS - START)) s of $BUDGET_S)"
