#!/usr/bin/env bash
# One call's share of the full benchmark matrix (every zoo model, precision and world size): runs what
# exp/records/matrix/<network>.json does not yet record as ok (the first call creates it) and packs the
# results (JSON, plans, the generated section and figure) into OUTDIR/matrix-<network>.tgz.
#   bash exp/gpu_matrix.sh OUTDIR NETWORK [bench flags, e.g. --worlds 4 --time-budget 480]
# A network without a profile in exp/records/matrix measures one, taking the per-op times of the NVLink
# profile there (compute does not depend on the network) and timing only the shapes it lacks.
set -u
out=$1; net=$2; shift 2
mkdir -p "$out"
. exp/gpu_env.sh
m=exp/records/matrix
docs=/tmp/hidup_matrix_docs
flags=(--network "$net" --out "$m" --docs "$docs" --resume --stall-timeout 120)
if [[ ! -f $m/$net-profile.json && -f $m/nvlink-profile.json && $net != nvlink ]]; then
  flags+=(--ops-from "$m/nvlink-profile.json")
fi
python3 exp/bench.py "${flags[@]}" "$@" >"$out/bench-$net.log" 2>&1  # whole: a stall prints the ranks' stacks
grep -v Warning "$out/bench-$net.log" | tail -60
tar czf "$out/matrix-$net.tgz" "$m"/"$net"*.json "$m/plans/$net" "$docs" 2>/dev/null
ls -la "$out"
