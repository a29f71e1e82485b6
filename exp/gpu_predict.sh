#!/usr/bin/env bash
# Measured against predicted: one rank of world-4 plans on one GPU, for exp/rank_predict.py.
#   1. (PROFILE=1) the GPU's own device profile: matmul rates (fp32, tf32, bf16) by square size and by
#      GEMM shape (the (m, n, k) grid), attention times by variant (float32 and bf16), copy bandwidth, the
#      fixed cost per op eagerly and inside a CUDA graph (`hidup profile`, one process; collectives
#      from the built-in h200x4-nvlink profile, which no prediction here uses);
#   2. `hidup bench-rank --plan` for every plan file in $PLANS matching $MATCH (default all), or for the
#      space-separated plan files of $PLAN_FILES when set, rank 0,
#      duplication off, modes cuda-graph and compile+graph, tf32 and bf16, fused Adam, no share,
#      kernel time by kind (--kernels); one JSON per plan: $OUT/rank-<plan>.json.
# With QUIET=1 the timings are not printed (only which runs finished); they are in the JSON files.
# MODES (default cuda-graph,compile+graph) picks the bench-rank modes, PRECISIONS (default tf32,bf16) the
# precisions; PROFILE=0 skips step 1;
# KERNELS=0 leaves out the kernel-time breakdown (one profiled run per precision less).
# CODE=1 keeps inductor's generated code of each plan (every kernel with the bytes inductor counts it to
# move, `kernel_num_gb`): $OUT/code-<plan>.tgz, the *.py files of that plan's own inductor cache.
# GPU (default h100) names the profile: $OUT/$GPU.json, profile name $GPU-measured.
# Usage (repository root): OUT=/some/dir PLANS=exp/records/predict/rank-plans [MATCH='bert*'] bash exp/gpu_predict.sh
set -u -o pipefail
OUT=${OUT:?set OUT to an output directory}
PLANS=${PLANS:-exp/records/predict/rank-plans}
MATCH=${MATCH:-*}
PY=${PYTHON:-python}
CAP=${CAP:-200}
GPU=${GPU:-h100}
mkdir -p "$OUT"
kernels=--kernels; [ "${KERNELS:-1}" = 1 ] || kernels=
echo "== $(date -u +%FT%TZ) gpu_predict.sh"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
if [ "${PROFILE:-1}" = 1 ]; then
  timeout 300 $PY -m hidup profile --quick --dtypes fp32,tf32,bf16 --matmul-sizes 1024,2048,4096,8192 \
    --merge h200x4-nvlink --name "$GPU-measured" --out "$OUT/$GPU.json" --no-progress > "$OUT/profile.log" 2>&1
  echo "profile exit status $?"; grep -i -e "flop\|bandwidth\|overhead" "$OUT/profile.log" | head -12
fi
if [ -n "${PLAN_FILES:-}" ]; then read -r -a plans <<< "$PLAN_FILES"; else plans=("$PLANS"/$MATCH.json); fi
for plan in "${plans[@]}"; do
  name=$(basename "$plan" .json)
  code_dir=
  if [ "${CODE:-0}" = 1 ]; then
    code_dir=$(mktemp -d); export TORCHINDUCTOR_CACHE_DIR=$code_dir TORCHINDUCTOR_BENCHMARK_KERNEL=1
  fi
  timeout --signal=TERM --kill-after=10 "$CAP" $PY -m hidup bench-rank --plan "$plan" --rank 0 \
    --duplication off --modes "${MODES:-cuda-graph,compile+graph}" --precisions "${PRECISIONS:-tf32,bf16}" --share-modes none \
    --steps 10 --rounds 3 --warmup 2 $kernels --out "$OUT/rank-$name.json" > "$OUT/rank-$name.log" 2>&1
  status=$?
  if [ -n "$code_dir" ]; then
    (cd "$code_dir" && find . -name '*.py' | tar czf "$OUT/code-$name.tgz" -T -); rm -rf "$code_dir"
    unset TORCHINDUCTOR_CACHE_DIR TORCHINDUCTOR_BENCHMARK_KERNEL
  fi
  if [ "${QUIET:-0}" = 1 ]; then echo "$name: exit status $status"; else echo "== $name: exit $status"; grep -e "^rank " -e "ms" "$OUT/rank-$name.log" | tail -6; fi
done
echo "== $(date -u +%FT%TZ) done"
