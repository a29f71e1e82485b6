#!/usr/bin/env bash
# The multi-GPU judge on one host (docs/benchmarks.md, "Several GPUs"), in two phases that bracket a
# commit of the registered predictions:
#   PHASE=profile bash exp/gpu_fair.sh OUTDIR
#       measures this host's profile over NVLink (GEMM grid, attention, collectives) and over NCCL's
#       socket transport (the collectives; compute taken from the NVLink one) into OUTDIR;
#       copy them to exp/records/multi/, search the plans there with `exp/bench.py --search-only` and commit
#       the <network>-registered.json it writes (the predictions) before the matrix runs.
#   PHASE=matrix NETWORK=nvlink|sockets [SETS="zoo llama mixtral"] bash exp/gpu_fair.sh OUTDIR
#       runs every method on the committed profile and plans, REPEATS (3) interleaved rounds, and
#       packs exp/records/multi/<network>*.json and the plans into OUTDIR/multi-<network>.tgz.
#       <SET>_METHODS / <SET>_VARIANTS (e.g. LLAMA_METHODS="ddp hidup-auto") narrow one set's runs.
set -u
out=$1; phase=${PHASE:-matrix}; net=${NETWORK:-nvlink}; world=${WORLD:-2}
rec=exp/records/multi
mkdir -p "$out"
. exp/gpu_env.sh
if [[ $phase == profile ]]; then
  timeout 300 python3 -m hidup profile --cpn "$world" --quick --dtypes bf16,tf32 --gemm-sizes 256,1024,4096,16384 \
    --name "h200x$world-nvlink-measured" --out "$out/nvlink-profile.json" --no-progress 2>&1 | grep -v Warning | tail -15
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout 200 python3 -m hidup profile --cpn "$world" --quick --gemm-sizes none \
    --no-attention --dtypes bf16 --merge "$out/nvlink-profile.json" --comm-rounds 3 \
    --name "h200x$world-sockets-measured" --out "$out/sockets-profile.json" --no-progress 2>&1 | grep -v Warning | tail -15
  rm -f "$out"/*.raw.json
  ls -la "$out"; exit 0
fi
common=(--network "$net" --worlds "$world" --methods ${METHODS:-single ddp fsdp expert hidup-auto}
        --variants ${VARIANTS:-compile-graph} --repeats "${REPEATS:-3}" --profile "$rec/$net-profile.json"
        --out "$rec" --docs /tmp/hidup_fair_docs --resume --run-cap "${CAP:-20}" --stall-timeout 150 --search-jobs 0)
for group in ${SETS:-zoo llama mixtral}; do
  case $group in
    zoo) args=(--models ${ZOO:-bert-sgmoe bert-switch} --precisions ${ZOO_PRECISIONS:-bf16 tf32}); budget=${ZOO_S:-170} ;;
    llama) args=(--models exp.rank_models:llama --layers 20 --precisions bf16); budget=${LLAMA_S:-200} ;;
    mixtral) args=(--models exp.rank_models:mixtral --precisions bf16); budget=${MIXTRAL_S:-170} ;;
  esac
  echo "== $net $group ($budget s)"
  m=${group^^}_METHODS v=${group^^}_VARIANTS  # e.g. LLAMA_METHODS="ddp hidup-auto"
  methods=${!m:-} variants=${!v:-}
  # transformers' grouped_mm experts copy from the CPU inside the step: no capture, so compile is tried too
  [[ $group == mixtral && -z $variants ]] && variants="compile compile-graph"
  timeout $((budget + 90)) python3 exp/bench.py "${common[@]}" "${args[@]}" --time-budget "$budget" \
    ${methods:+--methods $methods} ${variants:+--variants $variants} 2>&1 | grep -v -i warn | grep -E "^\[bench|^\[search|^[0-9]+ runs|rror" | tail -40
  cp "$rec/$net.json" "$out/" 2>/dev/null  # what ran so far comes back even if a later set overruns
done
tar czf "$out/multi-$net.tgz" "$rec/$net"*.json "$rec/plans/$net" /tmp/hidup_fair_docs 2>/dev/null
ls -la "$out"
