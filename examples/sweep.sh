#!/usr/bin/env bash
# A loss sweep as a plain shell loop: loss rate x mean burst length, each run with its own
# statistics directory, then one `lossy report` over all of them (table + plot).
#
#   examples/sweep.sh [OUT_DIR]
#
# The workload defaults to the CPU demo (4 local ranks through the plugin). For a training
# job, set SWEEP_CMD, e.g.
#   SWEEP_CMD="torchrun --nproc-per-node 2 train.py" examples/sweep.sh sweeps/gpt
# `lossy run` sets NCCL_NET_PLUGIN, NCCL_NET=lossy, the profile, the overrides, the stats
# directory and (for data-corrupting effects) NCCL_PROTO=Simple for the command.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
LOSSY=${LOSSY:-lossy}
out=${1:-sweep-out}
cmd=${SWEEP_CMD:-"$LOSSY demo --sizes 1M,4M"}
profile=${SWEEP_PROFILE:-$here/configs/bursty-ge-1pct.toml}
rates=${SWEEP_RATES:-"0.001 0.01 0.05"}
bursts=${SWEEP_BURSTS:-"1 8"}

mkdir -p "$out"
for rate in $rates; do
  for burst in $bursts; do
    dir="$out/rate${rate}-burst${burst}"
    rm -rf "$dir"
    echo "== loss rate $rate, mean burst $burst -> $dir" >&2
    # shellcheck disable=SC2086 # the command is meant to be split into words
    "$LOSSY" run --profile "$profile" \
      --set "model.rate=$rate" --set "model.mean_burst=$burst" \
      --stats "$dir" -- $cmd
  done
done
"$LOSSY" report "$out"/rate* --plot "$out/sweep.png"
