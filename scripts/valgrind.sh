#!/usr/bin/env bash
# Runs a harness workload through the plugin library under valgrind's memcheck: `lossy demo`
# with 2 ranks (all three collectives at 2 sizes, the embedded default profile: retransmitted
# loss), every worker process traced. Fails when any process reports an invalid access or a
# definite/indirect leak. `scripts/valgrind.supp` suppresses only reports whose stacks lie
# outside our library (see docs/hardening.md). Logs: target/valgrind/vg.<pid>.log.
#
# Usage: scripts/valgrind.sh [extra `lossy demo` arguments]
# Needs valgrind (Debian/Ubuntu: apt-get install -y valgrind).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v valgrind >/dev/null; then
  echo "valgrind is not installed (Debian/Ubuntu: apt-get install -y valgrind)" >&2
  exit 2
fi
# Release keeps debug info (Cargo.toml: debug = 1), so reports name our functions.
cargo build --release --bin lossy
out=target/valgrind
rm -rf "$out"
mkdir -p "$out"

# --keep-debuginfo: the harness dlcloses the library at the end, as NCCL does; keep its
# symbols so leaks allocated in it are still attributed.
set +e
valgrind --tool=memcheck --trace-children=yes --child-silent-after-fork=yes \
  --leak-check=full --show-leak-kinds=definite,indirect \
  --errors-for-leak-kinds=definite,indirect --keep-debuginfo=yes \
  --suppressions=scripts/valgrind.supp --gen-suppressions=all \
  --log-file="$out/vg.%p.log" \
  target/release/lossy demo --ranks 2 --sizes 64K,1M "$@"
status=$?
set -e

fail=0
procs=0
for log in "$out"/vg.*.log; do
  procs=$((procs + 1))
  cmd=$(grep -m1 -oE 'Command: .*' "$log" | cut -c10-80)
  errors=$(grep -oE 'ERROR SUMMARY: [0-9]+ errors' "$log" | grep -oE '[0-9]+' | tail -1)
  definite=$(grep -oE 'definitely lost: [0-9,]+ bytes' "$log" | tail -1 || true)
  invalid=$(grep -cE 'Invalid (read|write|free)|uninitialised|Mismatched free' "$log" || true)
  ours=$(grep -cE '^==[0-9]+== +(at|by) 0x.*(nccl_net_lossy|libnccl)' "$log" || true)
  echo "$(basename "$log"): ${cmd}: errors ${errors:-?}, invalid accesses ${invalid}, ${definite:-definitely lost: 0 bytes}, stack frames in our library ${ours}"
  if [ "${errors:-1}" != "0" ]; then fail=1; fi
done
echo "valgrind: ${procs} processes checked; demo exit status ${status}"
if [ "$status" -ne 0 ] || [ "$fail" -ne 0 ]; then
  echo "valgrind found problems: see $out" >&2
  exit 1
fi
echo "valgrind: no invalid access and no leak"
