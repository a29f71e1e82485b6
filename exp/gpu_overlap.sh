#!/usr/bin/env bash
# Do the prefetched weight gathers of an FSDP-style plan overlap compute, eagerly and compiled? On two
# GPUs (NCCL, world 2), exp/overlap.py runs a 4-layer transformers Llama (exp/rank_models.py:llama:
# hidden 2048, 16 heads / 4 KV heads, MLP 5632, vocab 32000; 2 sequences of 1024 per GPU) in bf16 under
# an FSDP-style plan (every weight stored split), forward and backward, eagerly and compiled (inductor),
# prefetch off and on: per run the median step time and, from a torch.profiler trace, the all-gather
# kernels' time and the share of it during which compute kernels run (the overlap), beside hidup's
# predicted step in that mode, eager, compiled and compiled+captured as one CUDA graph.  Results in
# $OUT/overlap.json, rank 0's traces in $OUT/overlap-traces/, log in $OUT/gpu_overlap.log.
#   OUT=results bash exp/gpu_overlap.sh          (ARGS="--layers 8 ..." passes more flags to exp/overlap.py)
# About 3-6 minutes on two H200 (four inductor compilations per rank).
#
# JUDGE=1: the judge instead (exp/overlap.py --judge): the ~1B Llama (LAYERS, default 20: 1.03B
# parameters; 2 x 1024 tokens per GPU), hidup's FSDP-style plan with prefetch and bf16 gathers / fp32
# reduction against FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), both compiled
# (inductor) and compiled + captured as one CUDA graph, the fused Adam step inside the step; per run the
# median of 5 windows of 10 steps, the communication kernel time and its exposed part (no compute kernel
# beside it) from a torch.profiler trace of 3 steps on each rank, and hidup's predicted step and exposed
# communication, priced on the two-H200 host's measured profile (exp/records/multi/nvlink-profile.json).
# Results in $OUT/judge.json (COMMIT=<sha> recorded in it), rank 0's traces in $OUT/judge-traces/, log in
# $OUT/gpu_judge.log, the table printed last.  About 5-8 minutes on two H200 (inductor compiles of
# hidup's whole program and of FSDP2's blocks, twice each at most).
#   JUDGE=1 COMMIT=$(git rev-parse --short HEAD) OUT=results bash exp/gpu_overlap.sh
#   JUDGE=1 LAYERS=8 OUT=results bash exp/gpu_overlap.sh      (shorter compiles; ARGS passes more flags)
set -u -o pipefail
OUT=${OUT:?set OUT to an output directory}
mkdir -p "$OUT"
. exp/gpu_env.sh
if [ "${JUDGE:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  timeout 510 python3 -m torch.distributed.run --nproc_per_node 2 exp/overlap.py --judge --layers "${LAYERS:-20}" \
    --profile exp/records/multi/nvlink-profile.json --out "$OUT/judge.json" --trace-dir "$OUT/judge-traces" \
    ${COMMIT:+--commit "$COMMIT"} ${ARGS:-} \
    2>&1 | grep -v Warning | tee "$OUT/gpu_judge.log" | tail -40
  [ -f "$OUT/judge.json" ] && python3 exp/overlap.py --table "$OUT/judge.json"
  exit 0
fi
# shellcheck disable=SC2086
timeout 560 python3 -m torch.distributed.run --nproc_per_node 2 exp/overlap.py --out "$OUT/overlap.json" \
  --trace-dir "$OUT/overlap-traces" ${ARGS:-} \
  2>&1 | grep -v Warning | tee "$OUT/gpu_overlap.log" | tail -20
python3 - "$OUT/overlap.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for run in r["runs"]:
    key = f"{run['mode']}-prefetch-{'on' if run['prefetch'] else 'off'}"
    print(f"{key:22s} step {run['step_ms']:7.2f} ms (predicted {r['predicted'][key]['total']:7.2f}); all-gather "
          f"{run.get('allgather_ms', float('nan')):6.2f} ms, overlapped {run.get('overlap') or 0:.0%}")
PY
