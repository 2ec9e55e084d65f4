#!/usr/bin/env bash
# A/B of source trees in the JAX harness (benchmarks/bench.py), for what the standalone kernel check
# cannot see (launch attributes, the FFI handler, the planner): each tree given (`.` or .ab/<name> from
# ab_tree.sh) is built, installed and timed in turn on JSMLA_AB_BENCH_ARGS's cases (each case checked
# against the CPU kernel first), then the first tree again, so that the drift between builds shows; a
# table of every case's time per run and each run's ratio to the first comes last
# (ab_bench_table.py). Results: $OUT/ab_bench.md, each run's log beside it, and its results and logs
# ($OUT/<i>_<tree>/) packed into $OUT/runs.tgz, since a device call returns few files (default OUT
# /tmp/jsmla_ab_bench).
#
#   bash benchmarks/ab_tree.sh variant main NAME=value   # a `#define NAME` knob of the CUDA sources
#   bash benchmarks/ab_bench.sh . .ab/variant            # on a GPU machine (carry .ab)
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: ab_bench.sh <tree> [<tree> ...]"; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/jsmla_ab_bench}
mkdir -p "$out"
args=${JSMLA_AB_BENCH_ARGS:---cases dsv3_2:1:128,dsv3_2:1:16,dsv3_2:16:128,dsv3_2:32:128 --prefill=false --flashmla off}
status=0
trees=("$@" "$1")
for i in "${!trees[@]}"; do
  tree=$(cd "${trees[$i]}" && pwd)
  name="${i}_$(basename "$tree")"
  [ "$tree" = "$repo" ] && name="${i}_main"
  OUT="$out/$name" JSMLA_SESSION_TREE="$tree" JSMLA_BENCH_ARGS="$args" \
    bash "$repo/benchmarks/gpu_session.sh" bench-cases > "$out/$name.log" 2>&1 || status=1
  echo "$name: $(tail -1 "$out/$name.log")"
done
python3 "$repo/benchmarks/ab_bench_table.py" "$out" | tee "$out/ab_bench.md" || status=1
(cd "$out" && tar czf runs.tgz --remove-files -- [0-9]*_*/) || status=1
exit $status
