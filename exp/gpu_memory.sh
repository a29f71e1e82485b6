# Predicted vs measured peak memory of rank 0 (docs/memory.md): the plans of exp/memory_plans.py (zoo
# GPT at world 8; data, FSDP-style and tensor; recomputation off and on), each run by `hidup bench-rank`
# on one GPU with the other ranks stood in for by torch's fake process group.
#   OUT=results bash exp/gpu_memory.sh        # writes $OUT/mem/<plan>.json
set -u
. exp/gpu_env.sh
mkdir -p "$OUT/mem" plans_mem
python exp/memory_plans.py --out plans_mem
for P in data data-recompute fsdp fsdp-recompute tensor tensor-recompute; do
  echo "== $P"
  timeout 150 hidup bench-rank --plan "plans_mem/$P.json" --rank 0 --duplication off --modes eager \
    --share-modes none --precisions tf32,bf16 --steps 2 --rounds 1 --warmup 2 --out "$OUT/mem/$P.json" 2>&1 | tail -6
done
