#!/usr/bin/env bash
# One GPU-host session: NCCL parity suite (eager and with each step captured as a CUDA graph), a quick machine profile, and a paper-default training run.
#   bash exp/gpu_check.sh OUTDIR [WORLD]
set -u
out=${1:-gpu_out}; world=${2:-4}
mkdir -p "$out"
. exp/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
python3 exp/parity.py --world "$world" --steps 3 --json "$out/parity_nccl.json" 2>&1 | grep -v Warning | tee "$out/parity.log"
python3 exp/parity.py --world "$world" --steps 3 --cuda-graph --json "$out/parity_nccl_graph.json" 2>&1 | grep -v Warning \
  | tee "$out/parity_graph.log"
CPN=$world NNODES=1 NODERANK=0 MASTER_PORT=29517 python3 exp/profiler.py --quick --name "h200x${world}-nvlink-measured" \
  --out "$out/h200x${world}-nvlink-measured.json" --no-progress 2>&1 | tail -5 | tee "$out/profile.log"
python3 exp/strategy.py --world "$world" --profile "$out/h200x${world}-nvlink-measured.json" --precision tf32 \
  --out "$out/strategy_bert-sgmoe.json" 2>&1 | tail -30 | tee "$out/strategy.log"
python3 exp/train.py --world "$world" --plan "$out/strategy_bert-sgmoe.json" --precision tf32 --iterations 30 \
  --master-port 29518 --json "$out/train.json" 2>&1 | tail -8 | tee "$out/train.log"
