#!/usr/bin/env bash
# Side-by-side timing of kernel source trees on one GPU: builds the standalone kernel check
# (kernels/cuda/tests/portable_check.cu, CMake's jsmla_cuda library) of the working tree and of every
# tree given, runs each one's `--headline` cases (every case checked against the float64 reference and
# for bitwise determinism, then timed), the working tree's `--quick` correctness matrix, and prints the
# rows side by side with each tree's time relative to the first tree given (the baseline).
#
#   bash benchmarks/ab_kernels.sh .ab/base .ab/variant ...   # trees: copies of the repository
#                                                            # (benchmarks/ab_tree.sh makes them)
#
# The working tree runs first and again last, so the table shows how far the clocks drifted
# (AB_REPEAT_HEAD=0: not again). AB_QUICK_ALL=1: every tree runs the `--quick` matrix, not only the
# working tree (AB_QUICK_TREES names the trees that do); AB_RACECHECK=1: every tree's `--sanitize` cases
# also run under compute-sanitizer racecheck; AB_MODE=--ablate times only the dsv3_2 H = 128 rows (for
# trees that leave a stage of the kernel out); AB_MODE may name other runs of the check, ";"-separated, each
# with its arguments (AB_MODE="--profile-small h64 128 16 4 25;--profile-small h64 128 32 2 25": one
# small-batch shape each, checked, then timed); AB_BASELINE=head: the ratios are to the working tree instead
# of the first tree given (no separate baseline tree to build). Logs go to $OUT (default /tmp/jsmla_ab).
set -uo pipefail
out=${OUT:-/tmp/jsmla_ab}
mkdir -p "$out"
repo=$(cd "$(dirname "$0")/.." && pwd)
names=(head)
dirs=("$repo")
for t in "$@"; do
  names+=("$(basename "$t")")
  dirs+=("$(cd "$t" && pwd)")
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee "$out/gpu.txt"

source "$repo/benchmarks/check_build.sh"
build_tree() {  # name dir
  build_check_tree "$2" "/tmp/jsmla_ab_build_$1" "$out/build_$1.log"
}

start=$(date +%s)
for i in "${!names[@]}"; do
  if ! build_tree "${names[$i]}" "${dirs[$i]}"; then
    echo "${names[$i]}: BUILD FAILED"
    grep -E "error" "$out/build_${names[$i]}.log" | head -20
    exit 1
  fi
done
echo "builds: $(( $(date +%s) - start )) s"

status=0
run_headline() {  # name log: each of AB_MODE's ";"-separated argument lists, one run each, into one log
  local mode modes args
  : > "$out/$2"
  IFS=";" read -ra modes <<< "${AB_MODE:---headline}"
  for mode in "${modes[@]}"; do
    read -ra args <<< "$mode"
    timeout "${AB_TIMEOUT:-150}" "/tmp/jsmla_ab_build_$1/portable_check" "${args[@]}" >> "$out/$2" 2>&1 || status=1
  done
}
for i in "${!names[@]}"; do run_headline "${names[$i]}" "headline_${names[$i]}.log"; done
# AB_REPEAT_HEAD=0: no second run of the working tree (the clocks' drift goes unmeasured; saves a run).
[ "${AB_REPEAT_HEAD:-1}" = 1 ] && run_headline head headline_head_again.log
quick_trees=(head)
[ "${AB_QUICK_ALL:-0}" = 1 ] && quick_trees=("${names[@]}")
# AB_QUICK_TREES="name ...": the trees (by folder name) whose `--quick` matrix runs, instead (" ": none).
[ -n "${AB_QUICK_TREES:-}" ] && read -ra quick_trees <<< "$AB_QUICK_TREES"
for n in "${quick_trees[@]}"; do
  timeout "${AB_QUICK_TIMEOUT:-200}" "/tmp/jsmla_ab_build_$n/portable_check" --quick > "$out/quick_$n.log" 2>&1 || status=1
  echo "$n --quick: $(grep -cE " PASS" "$out/quick_$n.log") PASS, $(grep -cE " FAIL" "$out/quick_$n.log") FAIL; $(tail -1 "$out/quick_$n.log")"
done

if [ "${AB_RACECHECK:-0}" = 1 ]; then
  for n in "${names[@]}"; do
    timeout "${AB_SANITIZE_TIMEOUT:-120}" compute-sanitizer --tool racecheck --racecheck-report all --print-limit 5 \
      "/tmp/jsmla_ab_build_$n/portable_check" --sanitize > "$out/racecheck_$n.log" 2>&1
    echo "$n racecheck: exit $? :: $(grep -E "RACECHECK SUMMARY" "$out/racecheck_$n.log" | tr '\n' ' ')"
  done
fi

python3 "$repo/benchmarks/ab_kernels_table.py" "$out" "${names[@]}"
echo "ab: status $status, $(( $(date +%s) - start )) s"
(cd "$out" && tar czf logs.tgz --remove-files ./*.log 2>/dev/null)
exit $status
