# Predicted vs measured peak memory of rank 0 (docs/memory.md): the plans of exp/memory_plans.py (zoo
# GPT at world 8; data, FSDP-style and tensor; recomputation off and on), each run by `hidup bench-rank`
# on one GPU with the other ranks stood in for by torch's fake process group; bench-rank records beside the
# measured peak the memory model's figure and the peak of a fake-tensor run of the same program
# (hidup peak). Two recomputed plans and a resharded one also run with duplication on (bf16).
# PLANS_MEM and PLANS_MEM_DUP (space-separated names) pick the plans of each loop.
#   OUT=results bash exp/gpu_memory.sh        # writes $OUT/mem/<plan>.json
set -u
. exp/gpu_env.sh
mkdir -p "$OUT/mem" plans_mem
${PYTHON:-python} exp/memory_plans.py --out plans_mem
for P in ${PLANS_MEM:-data data-recompute fsdp fsdp-recompute fsdp-reshard fsdp-reshard-recompute tensor tensor-recompute}; do
  echo "== $P"
  timeout 150 hidup bench-rank --plan "plans_mem/$P.json" --rank 0 --duplication off --modes eager \
    --share-modes none --precisions tf32,bf16 --steps 2 --rounds 1 --warmup 2 --out "$OUT/mem/$P.json" 2>&1 | tail -6
done
for P in ${PLANS_MEM_DUP-tensor-recompute fsdp-recompute fsdp-reshard}; do
  echo "== $P, duplication on"
  timeout 150 hidup bench-rank --plan "plans_mem/$P.json" --rank 0 --duplication on --modes eager \
    --share-modes none --precisions bf16 --steps 2 --rounds 1 --warmup 2 --out "$OUT/mem/$P-dup.json" 2>&1 | tail -4
done
