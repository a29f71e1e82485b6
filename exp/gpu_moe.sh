#!/usr/bin/env bash
# MoE ranks at full speed on one GPU: the routed-experts kernels, then one rank of each MoE plan file
# against the single-device share that `transformers` builds with its grouped-GEMM experts.
#   0. (SEARCH="mixtral:4 qwen3_moe:8:expert-all-to-all ...") `hidup search --precision bf16 --compiled`
#      of each exp.rank_models factory at its world (and --style, when a third field names one) under
#      $PROFILE_JSON, on this host (a plan fits the torch and transformers versions it was traced with),
#      into $OUT/<model>-w<world>[-<style>].json; PLAN_FILES defaults to them;
#   1. exp/moe_kernels.py: the grouped kernel against the masked form, and the op's time;
#   2. exp/gemm_check.py --points and exp/op_check.py: the plans' GEMMs at their shapes and the
#      routed-experts op at its local shapes (balanced routing), into a copy of $PROFILE_JSON, the
#      profile the registered predictions use; POINTS_JSON (a profile with the points already) skips
#      the GEMMs; OPS_FLAGS (e.g. --compiled) go to op_check, whose profile is $OUT/profile$OPS_SUFFIX.json;
#   3. `hidup bench-rank --plan` for every plan of $BENCH_FILES (default $PLAN_FILES), rank 0, bf16, rank modes $MODES, the
#      share (exp/rank_models.py: experts_implementation "grouped_mm") in $SHARE_MODES.
# Usage (repository root): OUT=/some/dir PLAN_FILES="a.json b.json" bash exp/gpu_moe.sh
# STEPS=1,2,3 picks the steps; CAP (seconds, default 240) bounds each bench-rank.
set -u -o pipefail
OUT=${OUT:?set OUT to an output directory}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
STEPS=${STEPS:-1,2,3}
CAP=${CAP:-240}
MODES=${MODES:-compile+graph,eager}
SHARE_MODES=${SHARE_MODES:-compile,compile+graph}
PROFILE_JSON=${PROFILE_JSON:-exp/records/predict/h200-10/h200-ops.json}
SEARCH=${SEARCH:-}
searched=""
plan_name() {  # model:world[:style] -> model-wworld[-style]
  local model world style
  IFS=: read -r model world style <<< "$1"
  echo "$model-w$world${style:+-$style}"
}
for spec in $SEARCH; do
  searched="$searched $OUT/$(plan_name "$spec").json"
done
PLAN_FILES=${PLAN_FILES:-$searched}
[ -n "$PLAN_FILES" ] || { echo "set PLAN_FILES or SEARCH"; exit 2; }
BENCH_FILES=${BENCH_FILES:-$PLAN_FILES}
{
  echo "== $(date -u +%FT%TZ) gpu_moe.sh; commit $(git rev-parse --short HEAD 2>/dev/null)"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  for spec in $SEARCH; do
    IFS=: read -r model world style <<< "$spec"
    $PY -m hidup search --model "exp.rank_models:$model" --world "$world" --profile "$PROFILE_JSON" \
      --precision bf16 --compiled --style "${style:-searched}" --quiet --out "$OUT/$(plan_name "$spec").json"
  done
  if [[ ,$STEPS, == *,1,* ]]; then
    $PY exp/moe_kernels.py --out "$OUT/moe_kernels.json"; echo "moe_kernels exit status $?"
  fi
  if [[ ,$STEPS, == *,2,* ]]; then
    points=${POINTS_JSON:-$OUT/points.json}
    if [ -z "${POINTS_JSON:-}" ]; then
      # shellcheck disable=SC2086
      $PY exp/gemm_check.py $PLAN_FILES --profile "$PROFILE_JSON" --precisions bf16 --out "$OUT/gemms.json" \
        --points "$points" > "$OUT/gemm_check.log" 2>&1; echo "gemm_check exit status $?"
    fi
    # shellcheck disable=SC2086
    $PY exp/op_check.py $PLAN_FILES --profile "$points" --precisions bf16 ${OPS_FLAGS:-} \
      --out "$OUT/profile${OPS_SUFFIX:-}.json"
    echo "op_check exit status $?"
  fi
  if [[ ,$STEPS, == *,3,* ]]; then
    for plan in $BENCH_FILES; do
      name=$(basename "$plan" .json)
      echo "== $name (cap $CAP s)"
      timeout --signal=TERM --kill-after=10 "$CAP" $PY -m hidup bench-rank --plan "$plan" --rank 0 \
        --precisions bf16 --modes "$MODES" --share-modes "$SHARE_MODES" --steps 10 --rounds 3 --warmup 2 ${BENCH_FLAGS:-} \
        --out "$OUT/rank-$name.json"
      echo "bench-rank exit status $?"
    done
  fi
} 2>&1 | tee "$OUT/gpu_moe.log"
