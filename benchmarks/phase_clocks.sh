#!/usr/bin/env bash
# Where a block's time goes, on a GPU machine: builds the standalone kernel check of a tree made with
# `bash benchmarks/ab_tree.sh clocks main JSMLA_PHASE_CLOCKS=1` (carry .ab), runs its --profile-small
# for each shape of $JSMLA_PHASE_SHAPES (tile heads tokens splits; default the 16-head tile at T = 1
# H = 128 with 16 splits and the 64-head tile at T = 16 H = 128 with 4), each once after the merge and
# once with the split kernel launched twice back to back (JSMLA_PHASE_BACK_TO_BACK=1), and prints
# benchmarks/phase_clocks.py's tables (medians only). Every case is checked against the float64
# reference. Logs and tables: $OUT/phase_clocks.tgz (default OUT /tmp/jsmla_phase).
#
#   bash benchmarks/phase_clocks.sh .ab/clocks
set -uo pipefail
tree=$(cd "${1:?usage: phase_clocks.sh <tree built with JSMLA_PHASE_CLOCKS=1>}" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/jsmla_phase}
mkdir -p "$out"
build=/tmp/jsmla_phase_build_$(basename "$tree")  # a folder per tree: CMake keeps one source per folder
grep -qE "^#define JSMLA_PHASE_CLOCKS 1" "$tree/kernels/cuda/launch_params.h" ||
  { echo "phase_clocks.sh: $tree is not built with JSMLA_PHASE_CLOCKS=1 (benchmarks/ab_tree.sh)"; exit 2; }
source "$repo/benchmarks/check_build.sh"
build_check_tree "$tree" "$build" "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
ghz=$(nvidia-smi --query-gpu=clocks.max.sm --format=csv,noheader,nounits | head -1 | awk '{print $1 / 1000}')
status=0
IFS=';' read -ra shapes <<< "${JSMLA_PHASE_SHAPES:-h16 128 1 16;h64 128 16 4}"
for shape in "${shapes[@]}"; do
  name=$(echo $shape | tr ' ' _)
  for mode in after_merge back_to_back; do
    log="$out/${name}_$mode.log"
    if [ $mode = back_to_back ]; then
      JSMLA_PHASE_BACK_TO_BACK=1 "$build/portable_check" --profile-small $shape > "$log" 2>&1 || status=1
    else
      "$build/portable_check" --profile-small $shape > "$log" 2>&1 || status=1
    fi
    echo "=== $shape, $mode: $(grep -cE " PASS" "$log") PASS, $(grep -cE " FAIL" "$log") FAIL"
    python3 "$repo/benchmarks/phase_clocks.py" "$log" --ghz "$ghz" > "$out/${name}_$mode.md" || status=1
    grep -vE "^\|---|^$|^\| mark" "$out/${name}_$mode.md" | sed -E 's/\| ([0-9.]+) \| ([0-9.]+) \|$/|/'
  done
done
(cd "$out" && tar czf phase_clocks.tgz --remove-files -- *.log *.md) || status=1
exit $status
