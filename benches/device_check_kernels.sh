#!/usr/bin/env bash
# Kernel GPU check (issue 16; the engine-step check of issue 15 is benches/device_check.sh)
# for a lent machine (Python with torch + triton, no Rust, no network): the CUDA-marked
# kernel tests and the quantized-cache tests, the decode/prefill sweep of
# benches/bench_attention_cuda.py, then benches/bench_quant.py (every format at 32K, batch 1 and
# 8). Needs only kvcore_kernels (pure Python, put on PYTHONPATH here). Under 8 minutes: tests
# <= 150 s, sweep <= 170 s, quant <= 150 s (each killed past its limit, and the script goes on).
# Prints one summary at the end.
# Usage: bash benches/device_check_kernels.sh [--quick]      (logs go to $OUT, else /tmp)
#        bash benches/device_check_kernels.sh --dry-run      (no GPU: the script's plumbing, tiny shapes)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
LOGS="${OUT:-/tmp}"
PY="${PYTHON:-python3}"
ARGS=("$@")
QARGS=()
if [[ "${1:-}" == "--dry-run" ]]; then export TRITON_INTERPRET=1; QARGS=(--dry-run); fi

$PY - <<'PY' 2>&1 | tee "$LOGS/device_env.log"
import torch, triton
print(f"python torch {torch.__version__} triton {triton.__version__} cuda {torch.version.cuda}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"gpu {props.name} sms {props.multi_processor_count} memory {props.total_memory >> 30} GiB")
else:
    print("gpu none (the cuda tests skip; only --dry-run makes sense here)")
PY

t0=$SECONDS
{ timeout 90 $PY -m pytest -q -m cuda tests/kernels -p no:cacheprovider -o addopts="" \
    --maxfail=20 -W ignore::DeprecationWarning
  timeout 60 $PY -m pytest -q tests/test_quant_kernels.py tests/test_quant_layout.py \
    -p no:cacheprovider -o addopts="" --maxfail=20 -W ignore::DeprecationWarning
} 2>&1 | tee "$LOGS/device_tests.log"
tests_rc=$(grep -cE '^(FAILED|ERROR)' "$LOGS/device_tests.log")
t1=$SECONDS
timeout 170 $PY benches/bench_attention.py --device cuda --quick "${ARGS[@]}" 2>&1 | tee "$LOGS/device_sweep.log"
sweep_rc=${PIPESTATUS[0]}
t2=$SECONDS
timeout 150 $PY benches/bench_quant.py --device cuda "${QARGS[@]}" 2>&1 | tee "$LOGS/device_quant.log"
quant_rc=${PIPESTATUS[0]}
t3=$SECONDS

echo
echo "================ kvcore_kernels device check ================"
cat "$LOGS/device_env.log"
echo "tests: $tests_rc failed ($((t1 - t0)) s):"
grep -E '(passed|failed|error|skipped)' "$LOGS/device_tests.log" | grep -E ' in [0-9.]+s' | tail -2
grep -E '^(FAILED|ERROR)' "$LOGS/device_tests.log" | head -20
echo "sweep: rc=$sweep_rc ($((t2 - t1)) s)"
if grep -q '^| ' "$LOGS/device_sweep.log"; then
    grep -E '^(device|check_|copy_|targets|decode_|prefill_)' "$LOGS/device_sweep.log"
    grep -E '^\| ' "$LOGS/device_sweep.log"
else  # killed before the tables: the per-shape lines printed so far
    grep -E '^(device|check_|copy_|decode b=)' "$LOGS/device_sweep.log"
fi
echo "quant: rc=$quant_rc ($((t3 - t2)) s)"
grep -E '^(copy_|decode_speedup|decode_bandwidth|decode_pct|store_over|check_|target_)' "$LOGS/device_quant.log"
exit $(( tests_rc != 0 || sweep_rc != 0 || quant_rc != 0 ))
