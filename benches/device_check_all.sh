#!/usr/bin/env bash
# One GPU check for a lent machine (issue 24 item 6): the engine step of issue 15 and the kernels
# of issue 16 from one script. Results of its first runs (H200, 2026-12-04): docs/gpu.md. Stages (each under its own timeout, killed past it; the script goes on; logs to
# $OUT, else /tmp):
#   1. environment, kvcore's binary from KVCORE_WHEEL (as benches/device_check.sh)      ~10 s
#   2. the CUDA-marked kernel tests and the quantized-cache tests (whole: CUDA where there is
#      one), side by side, each in parallel workers where pytest-xdist is there (Triton's
#      compiles use the CPU), then the CUDA-graph tests alone     <= max(T1, T1B) + T1C s
#   3. bench_e2e --device cuda --dtype bfloat16 --peers --no-b1 --static-only --profile-table:
#      the decode step at 64 (decode_step_ms_b64, gpu_busy_pct_b64, device_ops_per_step),
#      end to end against transformers' static batches of 8 and 64 (its continuous
#      batching ran past 90 s on the H200 and is left out), the profiler's table      <= T2 s
#   3b. bench_e2e --device cuda --dtype float32 --peers --no-b1 --static-only --requests 16:
#      fp32 greedy outputs through the graphs and the compiled forward equal transformers'
#      generate (hf_*_outputs_equal_kvcore: 16/16)                                     <= T5 s
#   4. bench_attention.py --device cuda --quick (decode b1 / b32 / b256, prefill vs SDPA) <= T3 s
#   5. bench_quant.py --device cuda (every format at 32K, batch 1 and 8)              <= T4 s
#   6. only when asked (--only ...,tune): benches/tune_cuda_decode.py, other decode launch
#      choices (BLOCK_N, warps, stages, splits) on the shapes of stage 5                <= T6 s
# Usage (the session's `run` tool, carry ["dist"]):
#   maturin build --release -o dist                                   # here, with Rust
#   KVCORE_WHEEL='dist/kvcore-*.whl' bash benches/device_check_all.sh [--only tests,e2e,exact,sweep,quant]
# --dry-run: no GPU, the plumbing only (tiny CPU shapes, the interpreter).
# Test workers: DEVICE_WORKERS (default 8). Timeouts: DEVICE_T1, _T1B, _T1C, _T2, _T3, _T4
# (default 90 / 90 / 120 / 170 / 80 / 80 s), DEVICE_T5 (120 s), DEVICE_T6 (180 s). All stages take about 10 minutes, more than a
# 15-minute lease can hold twice (the machine's start counts too): split them, e.g.
# `--only tests,e2e` (about 7 minutes), then `--only exact,sweep,quant` (about 4.5 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/python:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
LOGS="${OUT:-/tmp}"
PY="${PYTHON:-python3}"
DRY=0 ONLY="tests,e2e,exact,sweep,quant"
while [[ $# -gt 0 ]]; do
    case $1 in
        --dry-run) DRY=1 ;;
        --only) ONLY=$2; shift ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
want() { [[ ",$ONLY," == *",$1,"* ]]; }
T1=${DEVICE_T1:-90} T1B=${DEVICE_T1B:-90} T1C=${DEVICE_T1C:-120} T2=${DEVICE_T2:-170} T3=${DEVICE_T3:-80} T4=${DEVICE_T4:-80} T5=${DEVICE_T5:-120} T6=${DEVICE_T6:-180}

source benches/device_env.sh

RCDIR=$(mktemp -d)
stage() {  # stage NAME TIMEOUT LOG COMMAND...: run under a timeout, tee to LOG, keep rc and time
    local name=$1 limit=$2 log=$3; shift 3
    local t=$SECONDS
    timeout -k 15 "$limit" "$@" 2>&1 | tee "$LOGS/$log"
    echo "${PIPESTATUS[0]} $((SECONDS - t))" > "$RCDIR/$name"
}

if want tests; then
    # The CUDA-marked kernel tests; the quantized-cache tests whole (they pick the device
    # themselves: CUDA here).
    MARK=(-m cuda) QTESTS=(tests/test_quant_kernels.py tests/test_quant_layout.py)
    [[ $DRY == 1 ]] && MARK=(-k "device or ladder or bucket or fill") QTESTS=(-k fp8 "${QTESTS[@]}")
    PAR=()
    if [[ $DRY == 0 ]] && $PY -c "import xdist" 2>/dev/null; then PAR=(-n "${DEVICE_WORKERS:-8}"); fi
    COMMON=(-p no:cacheprovider -o addopts="" --maxfail=30 -W ignore::DeprecationWarning -rfE -v)
    # The kernel tests and the quantized-cache tests run side by side (correctness only;
    # nothing timed runs meanwhile); the CUDA-graph tests after them, in one process without
    # workers and each under a time limit, so that their reports are printed (the first H200
    # run lost them when the parallel run outlasted its limit).
    stage tests "$T1" device_tests.log $PY -m pytest "${MARK[@]}" "${PAR[@]}" tests/kernels \
        "${COMMON[@]}" > /dev/null &
    stage qtests "$T1B" device_qtests.log $PY -m pytest "${PAR[@]}" "${QTESTS[@]}" \
        "${COMMON[@]}" > /dev/null &
    wait
    PTO=()
    $PY -c "import pytest_timeout" 2>/dev/null && PTO=(--timeout 100)
    if [[ $HAVE_KVCORE == 1 ]]; then
        stage graphs "$T1C" device_graphs.log $PY -m pytest "${MARK[@]}" "${PTO[@]}" \
            tests/test_cuda_graphs.py "${COMMON[@]}" > /dev/null
    fi
fi

if want e2e && [[ $HAVE_KVCORE == 1 ]]; then
    BENCH=(--device cuda --dtype bfloat16 --peers --no-b1 --static-only --profile-table)
    [[ $DRY == 1 ]] && BENCH=(--device cpu --requests 4 --eager)
    stage e2e "$T2" device_e2e.log $PY benches/bench_e2e.py "${BENCH[@]}"
fi

if want exact && [[ $HAVE_KVCORE == 1 ]]; then
    EX=(--device cuda --dtype float32 --peers --no-b1 --static-only --requests 16 --require-equal)
    [[ $DRY == 1 ]] && EX=(--device cpu --dtype float32 --peers --no-b1 --static-only \
        --requests 4 --eager --require-equal)
    stage exact "$T5" device_exact.log $PY benches/bench_e2e.py "${EX[@]}"
fi

if want sweep; then
    SW=(--device cuda --quick)
    [[ $DRY == 1 ]] && SW=(--device cuda --dry-run)
    stage sweep "$T3" device_sweep.log $PY benches/bench_attention.py "${SW[@]}"
fi

if want quant; then
    QA=(--device cuda)
    [[ $DRY == 1 ]] && QA=(--dry-run)
    stage quant "$T4" device_quant.log $PY benches/bench_quant.py "${QA[@]}"
fi

if want tune; then
    TU=(--budget $((T6 - 40)))
    [[ $DRY == 1 ]] && TU=(--dry-run --budget 20 --formats auto)
    stage tune "$T6" device_tune.log $PY benches/tune_cuda_decode.py "${TU[@]}"
fi

echo
echo "================ kvcore device check (issues 15, 16, 24) ================"
cat "$LOGS/device_env.log"
bad=0
for s in tests qtests graphs e2e exact sweep quant tune; do
    if [[ ! -f "$RCDIR/$s" ]]; then  # asked for but not run: kvcore's binary does not import
        asked=$s
        [[ $s == qtests || $s == graphs ]] && asked=tests
        if want "$asked" && [[ $s != qtests ]]; then
            echo "$s: NOT RUN (kvcore does not import)"
            bad=1
        fi
        continue
    fi
    read -r rc secs < "$RCDIR/$s"
    echo "$s: rc=$rc ($secs s)"
    [[ $rc != 0 ]] && bad=1
    case $s in
        tests | qtests | graphs)
            grep -E ' in [0-9.]+s' "$LOGS/device_$s.log" | tail -1
            echo "$(grep -c ' PASSED ' "$LOGS/device_$s.log") PASSED lines"
            grep -E '^(FAILED|ERROR)' "$LOGS/device_$s.log" | head -30 ;;
        e2e)
            PAT='^(kvcore_(tok_per_s|startup_s|compiled|engine_overhead_pct|all_blocks_free|recompiles_timed)'
            PAT+='|compile_|capture_s|cuda_graphs|graph_memory|decode_step|gpu_busy|profiled_step|device_ops'
            PAT+='|hf_.*_(tok_per_s|outputs_equal_kvcore)|best_peer|ratio_vs_best_peer|ttft_p50_ratio)'
            grep -E "$PAT" "$LOGS/device_e2e.log" ;;
        exact)
            grep -E '^(kvcore_(tok_per_s|compiled)|cuda_graphs|hf_.*_outputs_equal_kvcore)' \
                "$LOGS/device_exact.log" ;;
        sweep)
            grep -E '^(device|check_|copy_|targets|decode_|prefill_)' "$LOGS/device_sweep.log"
            grep -E '^\| ' "$LOGS/device_sweep.log" ;;
        tune)
            grep -E '^(device|tune_)' "$LOGS/device_tune.log" ;;
        quant)
            grep -E '^(copy_|decode_speedup|decode_pct|store_over|check_|target_)' \
                "$LOGS/device_quant.log" ;;
    esac
done
exit $bad
