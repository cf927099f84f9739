#!/usr/bin/env bash
# The engine-step GPU check (issue 15; under 8 minutes). The kernels' own check (quantized
# decode, split-K, prefill vs SDPA; issue 16) is benches/device_check_kernels.sh. The lent machine has Python 3.12,
# torch, triton and transformers, but no Rust and no network, so kvcore's Rust extension comes
# from a wheel built beforehand on a machine with Rust:
#
#   maturin build --release -o dist            # dist/kvcore-<ver>-cp3x-abi3-<platform>.whl
#   KVCORE_WHEEL=dist/kvcore-*.whl bash benches/device_check.sh
#
# (the session's `run` tool: carry ["dist"], command as above). The wheel is abi3, so it imports
# on Python 3.12 whatever Python built it. Only its binary (kvcore/_kvcore.abi3.so) is taken and
# put into python/kvcore/, so the checked-out Python code runs with it; without KVCORE_WHEEL an
# existing python/kvcore/_kvcore.abi3.so is used (carry it instead), else the kvcore stages skip.
#
# Stages, each under its own timeout (killed past it; the script goes on) and logged to $OUT
# (else /tmp):
#   1. environment (versions, GPU)                                                    ~10 s
#   2. CUDA tests: kernels (-m cuda), device normalisation, CUDA graphs              <= 150 s
#   3. bench_e2e --device cuda --dtype bfloat16 --peers (compile + CUDA graphs, the
#      decode step at 64 running: decode_step_ms_b64, gpu_busy_pct_b64, profiler)   <= 200 s
#   4. bench_e2e --device cuda --dtype float32 --peers --no-b1: fp32 greedy outputs equal
#      transformers' generate (*_outputs_equal_kvcore), only while time is left      <= 110 s
#      (--sweep: the kernels' decode/prefill sweep, benches/bench_attention.py --quick, instead)
# Then one summary. --dry-run (no GPU): the plumbing only, stage 2 and 3 on tiny CPU shapes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/python:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
LOGS="${OUT:-/tmp}"
PY="${PYTHON:-python3}"
DRY=0 SWEEP=0
for arg in "$@"; do
    [[ $arg == --dry-run ]] && DRY=1
    [[ $arg == --sweep ]] && SWEEP=1
done

source benches/device_env.sh

t0=$SECONDS
TESTS=(tests/kernels)
if [[ $HAVE_KVCORE == 1 ]]; then TESTS+=(tests/test_cuda_graphs.py); fi
MARK=(-m cuda)
if [[ $DRY == 1 ]]; then MARK=(-k "device or ladder or bucket or fill"); fi
timeout 150 $PY -m pytest -q "${MARK[@]}" "${TESTS[@]}" -p no:cacheprovider -o addopts="" \
    --maxfail=20 -W ignore::DeprecationWarning 2>&1 | tee "$LOGS/device_tests.log"
tests_rc=${PIPESTATUS[0]}
t1=$SECONDS

BENCH=(--device cuda --dtype bfloat16 --peers --no-b1 --static-only --profile-table)
if [[ $DRY == 1 ]]; then BENCH=(--device cpu --requests 4 --eager); fi
bench_rc=skipped
if [[ $HAVE_KVCORE == 1 ]]; then
    timeout 200 $PY benches/bench_e2e.py "${BENCH[@]}" 2>&1 | tee "$LOGS/device_bench_bf16.log"
    bench_rc=${PIPESTATUS[0]}
fi
t2=$SECONDS

fp32_rc=skipped
left=$((460 - SECONDS))
if [[ $SWEEP == 1 && $DRY == 0 && $left -gt 60 ]]; then
    timeout $((left < 110 ? left : 110)) $PY benches/bench_attention.py --device cuda --quick \
        2>&1 | tee "$LOGS/device_sweep.log"
    fp32_rc=${PIPESTATUS[0]}
    grep -E '^\| ' "$LOGS/device_sweep.log"
elif [[ $HAVE_KVCORE == 1 && $DRY == 0 && $left -gt 60 ]]; then
    timeout $((left < 110 ? left : 110)) $PY benches/bench_e2e.py --device cuda --dtype float32 \
        --peers --no-b1 --static-only 2>&1 | tee "$LOGS/device_bench_fp32.log"
    fp32_rc=${PIPESTATUS[0]}
fi
t3=$SECONDS

echo
echo "================ kvcore device check (issue 15) ================"
cat "$LOGS/device_env.log"
echo "tests: rc=$tests_rc ($((t1 - t0)) s): $(grep -E '(passed|failed|error|skipped)' "$LOGS/device_tests.log" | tail -1)"
grep -E '^(FAILED|ERROR)' "$LOGS/device_tests.log" | head -20
PAT='^(kvcore_(tok_per_s|startup_s|compiled|engine_overhead_pct|all_blocks_free|recompiles_timed)'
PAT+='|compile_|capture_s|cuda_graphs|graph_memory|decode_step|gpu_busy|profiled_step|device_ops'
PAT+='|hf_.*_(tok_per_s|outputs_equal_kvcore)|best_peer|ratio_vs_best_peer)'
echo "bench bf16: rc=$bench_rc ($((t2 - t1)) s)"
[[ -f "$LOGS/device_bench_bf16.log" ]] && grep -E "$PAT" "$LOGS/device_bench_bf16.log"
echo "bench fp32: rc=$fp32_rc ($((t3 - t2)) s)"
[[ -f "$LOGS/device_bench_fp32.log" ]] && grep -E "$PAT" "$LOGS/device_bench_fp32.log"
bad=$((tests_rc != 0))
for rc in "$bench_rc" "$fp32_rc"; do [[ "$rc" != skipped && "$rc" != 0 ]] && bad=1; done
exit $bad
