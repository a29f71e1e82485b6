# One rank of a 2x2 mesh plan on one GPU: the searched plan and a data x tensor plan of zoo GPT
# (4 layers, d_model 1024, sequence 1024, 8 sequences per GPU), each rank's program run by
# `hidup bench-rank` with torch's fake process group standing in for the other three ranks, eager,
# and compiled (inductor) and captured as one CUDA graph, bf16.  Checks that mesh plans compile
# and run on CUDA; the per-mode times and peak memory go to $OUT/mesh/*.json.
#   OUT=results bash exp/gpu_mesh.sh
set -u
. exp/gpu_env.sh
mkdir -p "$OUT/mesh"
MODEL="--model gpt --mesh 2x2 --layers 4 --d-model 1024 --heads 16 --ffn 4096 --seq-len 1024 --batch-per-gpu 8 --vocab 8192"
hidup search $MODEL --precision bf16 --quiet --out "$OUT/mesh/plan.json" 2>&1 | tail -1
python - "$OUT/mesh" <<'PY'
import sys, warnings
import hidup
from hidup.search.api import forced
warnings.simplefilter("ignore")
out = sys.argv[1]
model, inputs = hidup.models.build("gpt", world_size=4, device="meta", layers=4, d_model=1024, heads=16, ffn=4096,
                                   seq_len=1024, batch_per_gpu=8, vocab=8192)
graph = hidup.trace(model, inputs, mesh=(2, 2), half_batch=True)
plan = forced(graph, "h200x4-nvlink", ("data", "tensor"), precision="bf16",
              model_source=("gpt", dict(layers=4, d_model=1024, heads=16, ffn=4096, seq_len=1024, batch_per_gpu=8, vocab=8192)))
plan.save(f"{out}/plan-data-tensor.json")
print("data x tensor plan saved; predicted", round(plan.predicted["total"] * 1e3, 2), "ms")
PY
for p in plan plan-data-tensor; do
  echo "== $p rank 0"
  timeout 200 hidup bench-rank --plan "$OUT/mesh/$p.json" --rank 0 --modes eager,compile+graph \
    --share-modes none --precisions bf16 --steps 5 --rounds 2 --warmup 2 --out "$OUT/mesh/$p-rank0.json" 2>&1 | tail -8
done
