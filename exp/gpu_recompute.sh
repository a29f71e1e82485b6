# A model that does not fit one GPU without recomputation trains on it with recomputation: zoo GPT
# with 24 layers, d_model 2048, FFN 8192, sequence 2048, 16 sequences, bf16, Adam.  The plan is
# searched for world 1 under a 70 GB budget (recompute=auto picks the fewest recomputed layers that
# fit), then, next to the same plan with recomputation off, rank 0 runs it (`hidup bench-rank`:
# peak memory, step time) and `hidup train` trains it for a few steps.
#   OUT=results bash exp/gpu_recompute.sh
set -u
. exp/gpu_env.sh
mkdir -p "$OUT/recompute"
MODEL="--model gpt --world 1 --layers 24 --d-model 2048 --heads 16 --ffn 8192 --seq-len 2048 --batch-per-gpu 16 --vocab 32000"
for RC in auto off; do
  hidup search $MODEL --precision bf16 --memory 70 --recompute $RC --quiet --out "$OUT/recompute/plan-$RC.json" 2>&1 | tail -2
  python -c "import json,sys; p=json.load(open('$OUT/recompute/plan-$RC.json')); print('$RC', len(p['recompute']), 'layers recomputed; predicted', round(p['memory']['total']/2**30,2), 'GiB,', round(p['predicted']['total']*1e3,1), 'ms')"
done
for RC in auto off; do
  echo "== bench-rank, recompute $RC"
  timeout 200 hidup bench-rank --plan "$OUT/recompute/plan-$RC.json" --modes eager,compile+graph --share-modes none \
    --precisions bf16 --steps 3 --rounds 2 --warmup 2 --out "$OUT/recompute/rank-$RC.json" 2>&1 | tail -4
done
echo "== train, recompute auto"
timeout 200 hidup train --plan "$OUT/recompute/plan-auto.json" --world 1 --iterations 8 --precision bf16 2>&1 | tail -6
