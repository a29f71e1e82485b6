# A model that does not fit one GPU without recomputation trains on it with recomputation: zoo GPT
# with 24 layers, d_model 2048, FFN 8192, sequence 2048, 16 sequences, bf16, Adam.  The plan is
# searched for world 1 under a 70 GB budget: with recomputation off no plan fits; recompute=auto picks
# the fewest recomputed layers that fit.  Rank 0 then runs that plan (`hidup bench-rank`: peak memory
# against the prediction, step time) and `hidup train` trains it for a few steps.
#   OUT=results bash exp/gpu_recompute.sh
set -u
. exp/gpu_env.sh
mkdir -p "$OUT/recompute"
MODEL="--model gpt --world 1 --layers 24 --d-model 2048 --heads 16 --ffn 8192 --seq-len 2048 --batch-per-gpu 16 --vocab 32000"
hidup search $MODEL --precision bf16 --memory 70 --recompute off --quiet --out "$OUT/recompute/plan-off.json" 2>&1 | tail -1
hidup search $MODEL --precision bf16 --memory 70 --quiet --out "$OUT/recompute/plan.json" 2>&1 | tail -1
python -c "import json; p=json.load(open('$OUT/recompute/plan.json')); print(len(p['recompute']), 'layers recomputed; predicted', round(p['memory']['total']/2**30,2), 'GiB')"
echo "== bench-rank"
timeout 200 hidup bench-rank --plan "$OUT/recompute/plan.json" --modes eager,compile+graph --share-modes none \
  --precisions bf16 --steps 3 --rounds 2 --warmup 2 --out "$OUT/recompute/rank.json" 2>&1 | tail -4
echo "== train"
timeout 200 hidup train --plan "$OUT/recompute/plan.json" --world 1 --iterations 8 --precision bf16 2>&1 | tail -6
