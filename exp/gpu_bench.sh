#!/usr/bin/env bash
# The recorded GPU session: BERT-SGMoE (paper defaults, tf32, 4 GPUs) side by side with the baselines
# on NVLink and on NCCL-over-sockets, then the robustness study on sockets.
#   [SEEDS=10] [PARTS="bench noise"] bash exp/gpu_bench.sh OUTDIR [extra bench flags]
# PARTS=bench (about 3 minutes) and PARTS=noise (about 2.5, the full study: 10 seeds) fit one 10-minute
# call together; the noise part reads the sockets profile from OUTDIR when the bench part wrote it there, else exp/records/.
set -u
out=${1:-gpu_out}; shift || true
parts=${PARTS:-bench noise}
work=/tmp/hidup_bench; mkdir -p "$out" "$work"
. exp/gpu_env.sh
common=(--worlds 4 --models bert-sgmoe --precisions tf32 --methods single single-graph ddp expert hidup hidup-nodup
        hidup-eager --out "$work/bench" --docs "$work/docs" "$@")
if [[ " $parts " == *" bench "* ]]; then
  timeout 200 python3 exp/bench.py --network nvlink --breakdown --time-budget 120 --iters 30 "${common[@]}" 2>&1 \
    | grep -v Warning | tail -25
  timeout 210 python3 exp/bench.py --network sockets --time-budget 130 "${common[@]}" 2>&1 | grep -v Warning | tail -25
  cp "$work"/docs/benchmarks.md "$work"/bench/nvlink.json "$work"/bench/sockets.json "$out"/ 2>/dev/null
  cp "$work"/bench/nvlink-profile.json "$work"/bench/sockets-profile.json "$out"/ 2>/dev/null
fi
if [[ " $parts " == *" noise "* ]]; then
  profile=$out/sockets-profile.json; [[ -f $profile ]] || profile=exp/records/sockets-profile.json
  timeout 330 python3 exp/noise.py --world 4 --seeds "${SEEDS:-10}" --profile "$profile" --bench-out "$work/bench" \
    --docs "$work/docs" --time-budget 260 --warmup 2 --iters 6 2>&1 | grep -v Warning | tail -25
  cp "$work"/docs/robustness.md "$work"/docs/robustness.json "$out"/ 2>/dev/null
fi
ls -la "$out"
