#!/usr/bin/env bash
# The recorded GPU session: BERT-SGMoE (paper defaults, tf32, 4 GPUs) side by side with the baselines
# on NVLink and on NCCL-over-sockets, then the robustness study on sockets (about 9 minutes).
#   [SEEDS=10] bash exp/gpu_bench.sh OUTDIR [extra bench flags]
set -u
out=${1:-gpu_out}; shift || true
work=/tmp/hidup_bench; mkdir -p "$out" "$work"
. exp/gpu_env.sh
common=(--worlds 4 --models bert-sgmoe --precisions tf32 --methods single single-graph ddp expert hidup hidup-nodup
        hidup-eager --out "$work/bench" --docs "$work/docs" "$@")
timeout 170 python3 exp/bench.py --network nvlink --breakdown --time-budget 90 "${common[@]}" 2>&1 | grep -v Warning | tail -25
timeout 190 python3 exp/bench.py --network sockets --time-budget 110 "${common[@]}" 2>&1 | grep -v Warning | tail -25
timeout 200 python3 exp/noise.py --world 4 --seeds "${SEEDS:-4}" --bench-out "$work/bench" --docs "$work/docs" \
  --time-budget 140 2>&1 | grep -v Warning | tail -25
cp "$work"/docs/benchmarks.md "$work"/docs/robustness.md "$work"/docs/robustness.json "$out"/ 2>/dev/null
cp "$work"/bench/nvlink.json "$work"/bench/sockets.json "$out"/ 2>/dev/null
cp "$work"/bench/nvlink-profile.json "$work"/bench/sockets-profile.json "$out"/ 2>/dev/null
ls -la "$out"
