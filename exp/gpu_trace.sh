#!/usr/bin/env bash
# Trace plans on a GPU host: each run trains a plan for a few steps with `hidup train`, writes its
# step times (JSON) and rank 0's chrome trace (gzipped), and breaks the trace down (exp/breakdown.py).
#   NETWORK=sockets|nvlink RUNS="name:plan.json:flags ..." bash exp/gpu_trace.sh OUTDIR
# A run is name:plan:extra `hidup train` flags (commas for spaces), e.g.
#   RUNS="s9:plans/s9.json: s9-off:plans/s9.json:--no-duplication s9-eager:plans/s9.json:--cuda-graphs,off"
# Model flags for every run come from MODEL_FLAGS (default: bert-sgmoe at the paper defaults, tf32).
set -u
out=${1:-gpu_trace}
mkdir -p "$out"
. exp/gpu_env.sh
if [[ ${NETWORK:-nvlink} == sockets ]]; then export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1; fi
world=${WORLD:-4}
model_flags=${MODEL_FLAGS:---model bert-sgmoe --precision tf32}
for run in ${RUNS:?set RUNS}; do
  IFS=: read -r name plan extra <<<"$run"
  extra=${extra//,/ }
  trace=/tmp/hidup_trace/$name
  rm -rf "$trace"
  # shellcheck disable=SC2086
  timeout ${RUN_TIMEOUT:-150} python3 exp/train.py --world "$world" $model_flags --plan "$plan" \
    --iterations ${ITERS:-12} --warmup 4 --chrome-trace "$trace" --json "$out/$name.json" $extra 2>&1 \
    | grep -v Warning | grep -E "step mode|iteration time|Error|error" | sed "s/^/[$name] /"
  if [[ -f $trace/trace_rank0.json ]]; then
    gzip -c "$trace/trace_rank0.json" >"$out/$name-trace.json.gz"
    python3 exp/breakdown.py "$out/$name-trace.json.gz" --json "$out/$name-breakdown.json" | tail -3
  fi
done
ls -la "$out"
