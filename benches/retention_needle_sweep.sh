#!/usr/bin/env bash
# The needle sweep of docs/retention.md: per context C and seed S, full, window:B and H2O at the
# same budget B = 20% of C (H2O: 4 sink tokens, recent window 75% of B), 5 depths, SmolLM2 bf16.
# Usage: benches/retention_needle_sweep.sh "2048 4096 8192" "0 1 2"  (raw outputs in OUT)
set -euo pipefail
OUT=${OUT:-benches/results/retention}
for C in $1; do
  B=$((C / 5)); W=$((B * 3 / 4))
  for S in $2; do
    nice -n 5 python -m kvcore eval-kv --doc-len 0 --needle-contexts "$C" \
      --needle-depths 10,30,50,70,90 --seed "$S" --threads 1 --dtype bfloat16 \
      --retention "full,window:$B,h2o:budget=$B+sink=4+window=$W" \
      > "$OUT/needle-$C-seed$S.txt" 2>&1
    echo "done C=$C S=$S $(date -u +%H:%M:%S)"
  done
done
