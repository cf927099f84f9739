#!/usr/bin/env bash
# The server's cost, measured: served output tok/s at saturation (48 prompts at once, 128-384
# input tokens, 64 output, greedy, EOS ignored) over LLM.generate's on the same prompts, for
# the engine in its own process (default) and in a thread of the server (--engine-in-process).
# Per seed: both servers one after the other (order alternating by seed), then LLM.generate on
# the same prompts right after, so that a loaded machine's drift hits all three alike. Also
# prints the CPU seconds each server process used during its run (front-end vs engine) and
# LLM.generate's own: on a loaded machine, where wall-clock ratios drift with the neighbours'
# load, CPU seconds per token are the steadier cost figure. ONLY=offline runs LLM.generate only.
#   KVCORE_PY=/work/venvs/engproc/bin/python SEEDS="0 1 2" OUT=/tmp/ratio bash benches/serve_offline_ratio.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${KVCORE_PY:-python}; SEEDS=${SEEDS:-"0 1 2"}; OUT=${OUT:-/tmp/ratio}; N=${N:-48}; mkdir -p "$OUT"
FLAGS=${FLAGS:-"--model smollm2-135m --dtype bfloat16 --threads 2"}
export OMP_WAIT_POLICY=PASSIVE
BENCH="--dataset random --num-prompts $N --input-len 256 --max-tokens 64 --vocab-size 49152 --request-rate inf --warmup 4"
wait_up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
cpu() { awk '{print ($14+$15)/100}' "/proc/$1/stat" 2>/dev/null || echo 0; }

served() {  # label seed extra-serve-flags...
  local label=$1 seed=$2; shift 2
  $PY -m kvcore serve $FLAGS --port 8951 "$@" > "$OUT/$label-seed$seed-server.log" 2>&1 & local PID=$!
  wait_up 8951 || { kill $PID; return 1; }
  local EPID; EPID=$(curl -s localhost:8951/health | $PY -c "import json,sys; print(json.load(sys.stdin).get('engine_pid', 0))")
  # warm-up first (the bench's own --warmup), then measure CPU over the measured run only
  local f0 e0; f0=$(cpu $PID); e0=$( [ "$EPID" != 0 ] && cpu $EPID || echo 0)
  $PY -m kvcore bench serve --base-url http://127.0.0.1:8951 $BENCH --seed "$seed" > "$OUT/$label-seed$seed.txt" 2>&1 || true
  local f1 e1; f1=$(cpu $PID); e1=$( [ "$EPID" != 0 ] && cpu $EPID || echo 0)
  echo "cpu_s front-end $(echo "$f1 - $f0" | bc) engine $(echo "$e1 - $e0" | bc)" >> "$OUT/$label-seed$seed.txt"
  kill -TERM $PID; wait $PID || true
  echo "$label seed $seed: $(grep -E '^(output_tok_per_s|duration_s|server_overhead_pct_of_e2e|cpu_s)' "$OUT/$label-seed$seed.txt" | tr '\n' ' ') load $(cut -d' ' -f1 /proc/loadavg)"
}

offline() {  # seed
  $PY - "$seed" "$N" "$FLAGS" <<'PY'
import shlex, sys, time
from kvcore.tools.bench_data import make_dataset, rate_seed
from kvcore.tools.bench_serve import _Offline
seed, n, flags = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
reqs = make_dataset("random", n, seed=rate_seed(seed, 0), max_tokens=64, input_len=256, vocab_size=49152)
off = _Offline(flags)
cpu0 = time.process_time()  # every thread of this process
elapsed, tokens = off.run([r.body["prompt"] for r in reqs], [r.body["max_tokens"] for r in reqs])
cpu = time.process_time() - cpu0
print(f"offline seed {seed}: output_tok_per_s: {tokens / elapsed:.2f} ({tokens} tokens in "
      f"{elapsed:.1f} s) cpu_s {cpu:.2f}")
PY
}

i=0
for seed in $SEEDS; do
  if [ "${ONLY:-}" = offline ]; then
    :
  elif [ $((i % 2)) = 0 ]; then
    served proc "$seed"; served inproc "$seed" --engine-in-process
  else
    served inproc "$seed" --engine-in-process; served proc "$seed"
  fi
  offline "$seed" | tee "$OUT/offline-seed$seed.txt"; echo "load $(cut -d' ' -f1 /proc/loadavg)"
  i=$((i + 1))
done
