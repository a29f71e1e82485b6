#!/usr/bin/env bash
# GEMMs of rank plans timed alone (exp/gemm_check.py), then the calibration runs exp/rank_predict.py lacks.
# Usage (repository root, on a GPU host): OUT=/some/dir bash exp/gpu_gemm_check.sh
# Its inputs (the plans of rank-plans and rank-plans-3, the H100 profile h100.json) are in the git history:
#   mkdir -p /tmp/h; git archive 6b9b137 docs/bench/predict | tar -x -C /tmp/h; P=/tmp/h/docs/bench/predict OUT=... bash exp/gpu_gemm_check.sh
set -u -o pipefail
OUT=${OUT:?set OUT to an output directory}
mkdir -p "$OUT"
P=${P:-exp/records/predict}
timeout 200 python3 exp/gemm_check.py $P/rank-plans/bert-sgmoe-data.json $P/rank-plans/gpt-data.json \
  $P/rank-plans-3/qwen2-tensor.json $P/rank-plans-3/gpt-512-data.json --profile $P/h100.json \
  --out "$OUT/gemms.json" > "$OUT/gemms.log" 2>&1
echo "gemm_check exit status $?"; grep "^==" "$OUT/gemms.log"
for plan in bert-sgmoe-data bert-sgmoe-fsdp bert-sgmoe-tensor gpt-tensor; do
  OUT=$OUT PROFILE=0 QUIET=1 CAP=100 MODES=compile+graph PRECISIONS=bf16 MATCH=$plan PLANS=$P/rank-plans \
    bash exp/gpu_predict.sh | grep -v "^== "
  mv "$OUT/rank-$plan.json" "$OUT/rank-$plan-bf16.json" 2>/dev/null
done
OUT=$OUT PROFILE=0 QUIET=1 CAP=150 MODES=compile+graph MATCH='gpt-[fs]*' PLANS=$P/rank-plans bash exp/gpu_predict.sh
