#!/usr/bin/env bash
# Loss sweep over the megatron-core GPT example (examples/megatron_gpt_lossy.py), tensor-parallel
# over two ranks on one GPU, every byte between them through the plugin.
#
#   examples/megatron_sweep.sh [OUT_DIR]            # default sweeps/megatron
#   python examples/megatron_results.py OUT_DIR     # tables and plots (docs/RESULTS.md)
#
# Settings (one directory each, OUT_DIR/<model>_<rate>_<scope>/ with train.jsonl, stats/, run.log):
#   none_0_all                      configs/lossless.toml (the baseline)
#   socket_0_all                    NCCL's own Socket transport, no plugin (SOCKET=0 to skip)
#   uniform_<rate>_<scope>          uniform loss, lost packets arrive as zeros
#   ge8_<rate>_<scope>              Gilbert-Elliott, same mean loss, mean burst 8 packets, zeros
# rates: RATES (default "0.001 0.01 0.05"); scope: "all" (every collective: the profile's default
# model) or one collective kind (configs/one-collective.toml with rules.0.collective set):
# SCOPES (default "all AllReduce AllGather ReduceScatter").
#
# A finished setting (its directory holds `done`) is skipped, so the sweep can be run again to
# continue after a time limit; ONLY=REGEX runs the settings whose name matches.
#   STEPS (default 200), PYTHON (default python3), CPU=1 (gloo dry run, tiny model, no plugin
#   traffic), EXTRA (more arguments for the training script).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-sweeps/megatron}
PY=${PYTHON:-python3}
steps=${STEPS:-200}
rates=${RATES:-"0.001 0.01 0.05"}
scopes=${SCOPES:-"all AllReduce AllGather ReduceScatter"}
only=${ONLY:-}
cpu=()
[ "${CPU:-0}" = 1 ] && cpu=(--cpu)
export PYTHONPATH="$here/python/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"

run() {  # run NAME ARGS...: one training run into OUT_DIR/NAME
  local name=$1; shift
  local dir="$out/$name"
  if [ -n "$only" ] && ! [[ $name =~ $only ]]; then return; fi
  if [ -f "$dir/done" ]; then echo "== $name: done, skipped" >&2; return; fi
  rm -rf "$dir"; mkdir -p "$dir/stats"
  echo "== $name" >&2
  local start=$SECONDS
  # shellcheck disable=SC2086 # EXTRA is meant to be split into words
  "$PY" "$here/examples/megatron_gpt_lossy.py" "${cpu[@]}" --steps "$steps" --setting "$name" \
    --log "$dir/train.jsonl" --stats "$dir/stats" "$@" ${EXTRA:-} > "$dir/run.log" 2>&1 \
    || { echo "   failed, see $dir/run.log:" >&2; tail -5 "$dir/run.log" >&2; return 1; }
  echo "   $((SECONDS - start)) s: $(tail -1 "$dir/train.jsonl")" >&2
  touch "$dir/done"
}

run none_0_all --profile "$here/configs/lossless.toml"
if [ "${SOCKET:-1}" = 1 ] && [ "${CPU:-0}" != 1 ]; then
  run socket_0_all --no-plugin
fi
for rate in $rates; do
  for scope in $scopes; do
    if [ "$scope" = all ]; then
      run "uniform_${rate}_all" --profile "$here/configs/uniform-1pct.toml" --set "model.rate=$rate"
      run "ge8_${rate}_all" --profile "$here/configs/bursty-ge-1pct.toml" --set "model.rate=$rate" \
        --set "model.mean_burst=8"
    else
      run "uniform_${rate}_${scope}" --profile "$here/configs/one-collective.toml" \
        --set "rules.0.collective=$scope" --set "rules.0.model={ kind = \"uniform\", rate = $rate }"
      run "ge8_${rate}_${scope}" --profile "$here/configs/one-collective.toml" \
        --set "rules.0.collective=$scope" \
        --set "rules.0.model={ kind = \"gilbert_elliott\", rate = $rate, mean_burst = 8 }"
    fi
  done
done
echo "sweep in $out: python examples/megatron_results.py $out" >&2
