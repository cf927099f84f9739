#!/usr/bin/env bash
# kvcore serve vs transformers serve (continuous batching) on SmolLM2-135M-Instruct, CPU, the
# chat dataset, measured one server after the other through the same `kvcore bench serve` client.
# Both servers: 2 torch threads, OMP_WAIT_POLICY=PASSIVE, nice -n 5. Usage (one seed per call;
# the runs are saved as $OUT/{kvcore,transformers-serve}-seed$SEED.json and scored at the end by
# benches/score_serve.py: goodput ratio, p95 TTFT ratio at the peer's knee, server overhead):
#   SEED=1 RATES="0.125 0.5 2" N=24 MAXTOK=32 OUT=/tmp/serve_bench bash benches/serve_vs_transformers.sh
#   python benches/score_serve.py /tmp/serve_bench --slo-ttft-ms 1000 --slo-itl-ms 300  # all seeds
# (docs/serving.md: window A ran RATES="0.25 0.5 1 2" SEED=0 at SLO 5000/500; windows B and C
# ran RATES="0.125 0.5 2" with SEED=1 and SEED=0/2, the SLO below.)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/python:$PWD/kernels OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1
RATES=${RATES:-"0.125 0.5 2"}; N=${N:-24}; MAXTOK=${MAXTOK:-32}; SEED=${SEED:-0}
SLO=${SLO:-"--slo-ttft-ms 1000 --slo-itl-ms 300"}; OUT=${OUT:-/tmp/serve_bench}; mkdir -p "$OUT"
# transformers serve needs `architectures` in config.json: a sibling view of kvcore's cached copy.
CKPT=$(python -c "from kvcore.models import smollm2_checkpoint; print(smollm2_checkpoint())")
HF="$OUT/smollm2-hf"; mkdir -p "$HF"
for f in model.safetensors tokenizer.json tokenizer_config.json chat_template.jinja; do
  ln -sf "$CKPT/$f" "$HF/$f"; done
python - "$CKPT" "$HF" <<'PY'
import json, sys
c = json.load(open(f"{sys.argv[1]}/config.json")); c["architectures"] = ["LlamaForCausalLM"]
json.dump(c, open(f"{sys.argv[2]}/config.json", "w"), indent=1)
PY
wait_up() { for _ in $(seq 300); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
bench() {  # label port
  nice -n 5 python -m kvcore.entrypoints bench serve --base-url "http://127.0.0.1:$2" --dataset chat \
    --num-prompts "$N" --max-tokens "$MAXTOK" --request-rate $RATES --seed "$SEED" $SLO \
    --cost-per-hour 0.10 --timeout 400 --label "$1" --save-json "$OUT/$1-seed$SEED.json" \
    | tee "$OUT/$1-seed$SEED.txt" || true
}
# PEER=0 / KVCORE=0 skip a server (e.g. to rerun the peer alone after the shared machine's OOM
# killer took it); PEER_FLAGS go to transformers serve (e.g. "--cb-num-blocks 1455 --cb-block-size
# 16", kvcore's KV capacity, caps its memory; by default it sizes its cache itself).
if [ "${KVCORE:-1}" != 0 ]; then
  nice -n 5 python -m kvcore.entrypoints serve --model smollm2-135m --threads 2 --port 8931 \
    > "$OUT/kvcore-server.log" 2>&1 & PID=$!
  wait_up 8931 && bench kvcore 8931; kill -TERM $PID; wait $PID || true
fi
[ "${PEER:-1}" = 0 ] || {
nice -n 5 transformers serve "$HF" --device cpu --continuous-batching --host 127.0.0.1 --port 8932 \
  ${PEER_FLAGS:-} > "$OUT/transformers-server.log" 2>&1 & PID=$!
wait_up 8932 && bench transformers-serve 8932; kill -TERM $PID; wait $PID || true; }
python benches/score_serve.py "$OUT" $SLO | tee "$OUT/score.txt"
