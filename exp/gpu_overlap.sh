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
set -u -o pipefail
OUT=${OUT:?set OUT to an output directory}
mkdir -p "$OUT"
. exp/gpu_env.sh
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
