#!/usr/bin/env bash
# kvcore serve vs transformers serve (continuous batching) on SmolLM2-135M-Instruct, CPU, the
# chat dataset, measured one server after the other through the same `kvcore bench serve` client.
# Every server: 2 torch threads, OMP_WAIT_POLICY=PASSIVE, nice -n 5. One seed per call; each run
# is saved as $OUT/LABEL-seed$SEED.json and scored at the end by benches/tools/score_serve.py (goodput
# ratio, p95 TTFT ratio at the peer's knee, server overhead), once per peer:
#   KVCORE_FLAGS  extra `kvcore serve` flags, e.g. "--dtype bfloat16" (default: none)
#   KVCORE_LABEL  kvcore's label (default kvcore; e.g. kvcore-bf16 with --dtype bfloat16)
#   BENCH_FLAGS   extra `kvcore bench serve` flags, e.g. "--max-concurrency 1" (with RATES=inf:
#                 one request at a time, no queueing: each server's own TTFT floor)
#   PEER_DTYPES   transformers serve runs: "auto" (its default: the checkpoint's fp32, label
#                 transformers-serve) and/or "bfloat16" (--dtype bfloat16, label
#                 transformers-serve-bf16); default "auto bfloat16"
#   SEED=0 KVCORE_FLAGS="--dtype bfloat16" KVCORE_LABEL=kvcore-bf16 PEER_DTYPES=bfloat16 \
#     OUT=/tmp/serve_bench bash benches/serve_vs_transformers.sh
# (defaults RATES="2 3 4 6 8 12" N=48: past both servers' knees, so that the peak goodputs and
# the peer's knee are measured, not capped by the highest rate run; 2026-11-30 23:2x UTC)
#   python benches/tools/score_serve.py /tmp/serve_bench --kvcore kvcore-bf16 --peer transformers-serve-bf16
# (docs/serving.md: window A ran RATES="0.25 0.5 1 2" SEED=0 at SLO 5000/500; windows B and C
# ran RATES="0.125 0.5 2" with SEED=1 and SEED=0/2, the SLO below, fp32 on both sides; the
# bf16 runs of 21:03 UTC RATES="0.5 2" N=24.)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/python:$PWD/kernels OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1
RATES=${RATES:-"2 3 4 6 8 12"}; N=${N:-48}; MAXTOK=${MAXTOK:-32}; SEED=${SEED:-0}
SLO=${SLO:-"--slo-ttft-ms 1000 --slo-itl-ms 300"}; OUT=${OUT:-/tmp/serve_bench}; mkdir -p "$OUT"
# transformers serve needs `architectures` in config.json: a sibling view of kvcore's cached copy.
CKPT=$(python -c "from kvcore.models.loader import smollm2_checkpoint; print(smollm2_checkpoint())")
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
    --cost-per-hour 0.10 --timeout 400 --label "$1" --save-json "$OUT/$1-seed$SEED.json" ${BENCH_FLAGS:-} \
    | tee "$OUT/$1-seed$SEED.txt" || true
}
# PEER=0 / KVCORE=0 skip a side (e.g. to rerun the peer alone after the shared machine's OOM
# killer took it); PEER_FLAGS go to every transformers serve run (e.g. "--cb-num-blocks 1455
# --cb-block-size 16", kvcore's KV capacity, caps its memory; by default it sizes its cache).
KVCORE_LABEL=${KVCORE_LABEL:-kvcore}; PEER_DTYPES=${PEER_DTYPES:-"auto bfloat16"}
if [ "${KVCORE:-1}" != 0 ]; then
  nice -n 5 python -m kvcore.entrypoints serve --model smollm2-135m --threads 2 --port 8931 \
    ${KVCORE_FLAGS:-} > "$OUT/$KVCORE_LABEL-server.log" 2>&1 & PID=$!
  wait_up 8931 && bench "$KVCORE_LABEL" 8931; kill -TERM $PID; wait $PID || true
fi
PEERS=""
if [ "${PEER:-1}" != 0 ]; then
  for DT in $PEER_DTYPES; do
    case $DT in auto) L=transformers-serve;; bfloat16) L=transformers-serve-bf16;;
      *) echo "PEER_DTYPES: auto or bfloat16, got $DT" >&2; exit 2;; esac
    PEERS="$PEERS $L"
    nice -n 5 transformers serve "$HF" --device cpu --continuous-batching \
      --dtype "$DT" --host 127.0.0.1 --port 8932 ${PEER_FLAGS:-} > "$OUT/$L-server.log" 2>&1 &
    PID=$!
    wait_up 8932 && bench "$L" 8932; kill -TERM $PID; wait $PID || true
  done
fi
for L in ${PEERS:-transformers-serve}; do
  python benches/tools/score_serve.py "$OUT" --kvcore "$KVCORE_LABEL" --peer "$L" $SLO \
    | tee "$OUT/score-$KVCORE_LABEL-vs-$L.txt" || true
done
