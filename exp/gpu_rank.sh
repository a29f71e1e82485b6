#!/usr/bin/env bash
# One rank of a world-4 plan on one GPU (`hidup bench-rank`, torch's fake process group standing in for
# the other three ranks), every mode (eager, cuda-graph, compile, compile+graph) in tf32 and bf16 with a
# fused Adam step, against the single-device share compiled and captured; for
#   1. BERT-SGMoE at the paper defaults (8 layers, d 768, 32 sequences of 128 per GPU, 2 experts per GPU),
#      the plan searched now with the built-in h200x4-nvlink profile, rank 0;
#   2. a transformers Llama (exp/rank_models.py:llama) with Llama-2-7B's layer shapes (4 layers, hidden 4096, 32 heads / 8 KV
#      heads, MLP 11008, vocab 32000; 8 sequences of 1024 per GPU): about 1.0 B parameters, whose
#      single-device share (weights, gradients, Adam state and activations) takes roughly 40-50 GB;
#      plan searched the same way, rank 0.
# Modes run in the order eager, cuda-graph, compile+graph, compile (the last reuses the compiled code),
# tf32 first, each rank run followed by the share's, so a run cut short keeps whole pairs.
# Results go to $OUT/rank_bert_w4.json and $OUT/rank_llama_w4.json (rewritten after every run, so a
# run cut short by its time cap keeps what it measured) and the log to $OUT/gpu_rank.log.
#
# Usage (repository root as the working directory): OUT=/some/dir bash exp/gpu_rank.sh
# Within 9 minutes on one H100: each model has a hard cap (BERT_CAP, LLAMA_CAP seconds). torch's compile
# caches are left on, so a second run compiles faster.
# MODELS="bert llama" (default) picks the models; DUPLICATION=plan|on|off (default plan: as searched) and
# MODES (comma-separated, default all four on CUDA) are handed to bench-rank; SUFFIX names the outputs
# rank_<model>_w4<SUFFIX>.json; KERNELS=1 also records each run's device time by kernel kind (--kernels);
# TORCH_MODES (default none) times the rank's eager module under plain torch.compile too (--torch-modes);
# LLAMA_LAYERS (default 4) sets the Llama's depth; PRECISIONS (default tf32,bf16) the precisions, the first
# of which the plan is searched for.
# DEVICE=cpu runs the same sequence at toy sizes (eager and compile modes, aot_eager backend) to check it.
set -u -o pipefail
OUT=${OUT:?set OUT to an output directory}
mkdir -p "$OUT"
PY=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
BERT_CAP=${BERT_CAP:-270}
LLAMA_CAP=${LLAMA_CAP:-230}
MODELS=${MODELS:-bert llama}
DUPLICATION=${DUPLICATION:-plan}
SUFFIX=${SUFFIX:-}
LOG="$OUT/gpu_rank${SUFFIX}.log"


if [ "$DEVICE" = cpu ]; then
  COMMON=(--device cpu --precisions fp32 --modes eager,compile --share-modes compile --backend aot_eager
          --steps 2 --rounds 2 --warmup 1)
  BERT_ARGS=(--layers 2 --d-model 32 --heads 4 --ffn 64 --seq-len 8 --batch-per-gpu 4 --vocab 64)
  LLAMA_ARGS=(--model-arg layers=2 --model-arg hidden=64 --model-arg heads=4 --model-arg kv_heads=2
              --model-arg ffn=128 --model-arg vocab=128 --model-arg seq=16 --model-arg batch=2)
else
  COMMON=(--precisions "${PRECISIONS:-tf32,bf16}" --modes "${MODES:-eager,cuda-graph,compile+graph,compile}"
          --share-modes compile+graph --steps 20 --rounds 3 --warmup 3)
  BERT_ARGS=()
  LLAMA_ARGS=(--model-arg layers="${LLAMA_LAYERS:-4}" --model-arg hidden=4096 --model-arg heads=32 --model-arg kv_heads=8
              --model-arg ffn=11008 --model-arg vocab=32000 --model-arg seq=1024 --model-arg batch=8)
fi

{
  echo "== $(date -u +%FT%TZ) gpu_rank.sh on $DEVICE"
  $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
  COMMON+=(--duplication "$DUPLICATION" --torch-modes "${TORCH_MODES:-none}")
  [ "${KERNELS:-0}" = 1 ] && COMMON+=(--kernels)
  for model in $MODELS; do
    case $model in
      bert) cap=$BERT_CAP; spec=bert-sgmoe; args=("${BERT_ARGS[@]}");;
      llama) cap=$LLAMA_CAP; spec=exp.rank_models:llama; args=("${LLAMA_ARGS[@]}");;
      *) echo "unknown model $model (bert or llama)"; continue;;
    esac
    echo "== $spec, world-4 plan, rank 0, duplication $DUPLICATION (cap $cap s)"
    timeout --signal=TERM --kill-after=10 "$cap" $PY -m hidup bench-rank --model "$spec" --world 4 \
      "${args[@]}" --profile h200x4-nvlink --rank 0 "${COMMON[@]}" --out "$OUT/rank_${model}_w4${SUFFIX}.json"
    echo "bench-rank exit status $?"
  done
  echo "== summary (median ms per step: forward, backward, fused Adam)"
  $PY - "$OUT" <<'PYEOF'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("rank_*_w4*.json")):
    data = json.loads(path.read_text())
    c = data["config"]
    print(f"{path.name}: {c['model']} rank {c['rank']} of {c['world']}, duplication {c.get('duplication')}, "
          f"{c['device']}, plan predicts {c.get('plan_predicted_ms')} ms per step")
    for r in data["runs"]:
        t = f"{r['step_ms_median']:.2f} ms (best {r['step_ms_best']:.2f})" if r["status"] == "ok" else "failed: " + r["error"]
        print(f"  {r['what']:5s} {r['precision']:5s} {r['mode']:14s} {t}")
PYEOF
} 2>&1 | tee "$LOG"
