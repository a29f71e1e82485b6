#!/usr/bin/env bash
# One rank of each tuned baseline on one GPU: rank 0 of the world-4 DDP, FSDP2 and expert-parallel
# baselines (exp/baselines/harness.py --fake-world: torch's fake process group stands in for the other
# ranks), BERT-SGMoE at the paper defaults, in every variant (eager, compile, graph, compile-graph),
# beside the single-device share -- what `hidup bench-rank` measures of hidup's ranks.
# Results: one JSON line per run in $OUT/baselines_rank.jsonl (a failed variant: its error in the log).
# Usage (repository root): OUT=/some/dir [PRECISION=bf16] [CAP=70] [BASELINES="ddp expert"] bash exp/gpu_baselines_rank.sh
set -u -o pipefail
OUT=${OUT:?set OUT to an output directory}
PRECISION=${PRECISION:-bf16}
CAP=${CAP:-70}
PY=${PYTHON:-python}
mkdir -p "$OUT"
echo "== $(date -u +%FT%TZ) gpu_baselines_rank.sh, $PRECISION"
for baseline in ${BASELINES:-single ddp fsdp expert}; do
  for variant in eager compile graph compile-graph; do
    [ "$baseline" = single ] && [ "$variant" != compile-graph ] && continue
    fake=(); [ "$baseline" != single ] && fake=(--fake-world)
    timeout --signal=TERM --kill-after=10 "$CAP" $PY exp/baselines/harness.py --baseline "$baseline" --world 4 \
      "${fake[@]}" --precision "$PRECISION" --variant "$variant" --warmup 3 --iters 10 --best-of 3 \
      --out "$OUT/baselines_rank.jsonl" > "$OUT/$baseline-$variant.log" 2>&1
    status=$?
    ms=$($PY -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][-1]; print(f\"{r['iter_time_s']*1e3:.2f} ms\" if r['baseline']==sys.argv[2] and r['variant']==sys.argv[3] else 'failed')" \
      "$OUT/baselines_rank.jsonl" "$baseline" "$variant" 2>/dev/null || echo failed)
    echo "$baseline $variant: exit $status, $ms"
    [ $status -ne 0 ] && grep -m1 -e "Error" "$OUT/$baseline-$variant.log"
  done
done
echo "== $(date -u +%FT%TZ) done"
