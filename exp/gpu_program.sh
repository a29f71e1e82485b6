#!/usr/bin/env bash
# One network's benchmark with a profile calibrated inside the distributed program on this host:
# the quick profile (collectives measured here, per-op times carried from BASE) gets the compute
# factors of BERT-SGMoE's searched plans timed on the ranks (--calibrate-plans), then every model runs
# side by side with the baselines on plans searched with it.
#   bash exp/gpu_program.sh NETWORK BASE_PROFILE OUTDIR [extra bench flags]
set -u
network=$1 base=$2 out=$3; shift 3
mkdir -p "$out"
. exp/gpu_env.sh
timeout 560 python3 exp/bench.py --network "$network" --worlds 4 --ops-from "$base" --ops-seconds 0 \
  --calibrate-plans bert-sgmoe --out "$out" --docs "$out/docs" "$@" 2>&1 | grep -v Warning | tail -60
python3 - "$out/$network-profile.json" <<'PY'
import sys, hidup.profiler as hp
p = hp.load(sys.argv[1])
print("dist_scale", round(p.dist_scale, 4), "dist_dup_scale", round(p.dist_dup_scale, 4))
print(p.notes[p.notes.find("inside the distributed"):])
PY
