#!/usr/bin/env bash
# Side-by-side timing of the CUDA backward of source trees on one GPU: for each tree given (a copy of the
# repository, e.g. `git archive <branch> | tar x -C .ab/<name>`, carried with .ab) it builds and
# installs the tree, runs its backward GPU tests, then this checkout's bench_backward.py on it (the
# same harness for every tree; XLA only on the sub-problem the gradients are checked on), and prints the rows side by side, each tree's
# forward+backward time relative to the first tree's (the baseline).
#
#   bash benchmarks/ab_backward.sh .ab/main .ab/variant ...
#   bash benchmarks/ab_backward.sh . .:JSMLA_BACKWARD_PARTIALS=mma   # one tree, with and without a variable
#
# A tree given as `path:VAR=VALUE` runs with that variable in the environment (its tests and benchmark),
# named `<tree>_<VALUE>`; a tree already built by the argument before it is not built again.
# AB_BACKWARD_ARGS replaces the benchmark's shape flags (default: bf16_576 and dsv3_2, T = 1024, H = 128,
# topk 2048, with and without the cache's gradient). Logs and each tree's rows go to $OUT (default
# /tmp/jsmla_ab_backward).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/jsmla_ab_backward}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
args=${AB_BACKWARD_ARGS:---formats bf16_576,dsv3_2 --tokens 1024 --heads 128 --topk 2048 --cache_tokens 65536 --cache_gradient both --repeats 5 --check_tokens 128}
status=0
runs=""
built=""
for spec in "$@"; do
  tree=${spec%%:*}
  setting=""
  [ "$tree" != "$spec" ] && setting=${spec#*:}
  dir=$(cd "$tree" && pwd)
  name=$(basename "$dir")${setting:+_${setting#*=}}
  if [ "$dir" != "$built" ]; then
    if ! JSMLA_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-build-isolation --no-deps "$dir" \
        -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real > "$out/build_$name.log" 2>&1; then
      echo "$name: BUILD FAILED"
      tail -20 "$out/build_$name.log"
      exit 1
    fi
    built=$dir
  fi
  # shellcheck disable=SC2086  # $setting is one VAR=VALUE word or nothing
  (cd /tmp && env $setting python3 -m pytest -q -p no:cacheprovider -m gpu "$dir/tests/gpu/test_backward_cuda.py") \
    > "$out/tests_$name.log" 2>&1 || status=1
  echo "$name tests: $(tail -1 "$out/tests_$name.log")"
  # shellcheck disable=SC2086
  (cd /tmp && env $setting python3 "$repo/benchmarks/bench_backward.py" $args --notime_xla --out_dir "$out/$name") \
    > "$out/bench_$name.log" 2> "$out/bench_$name.err" || status=1
  grep -E "^\|" "$out/bench_$name.err" | sed "s/^/$name: /"
  runs="${runs:+$runs,}$name=$out/$name/bench_backward.json"
done
python3 "$repo/benchmarks/bench_backward.py" --side_by_side "$runs" || status=1
echo "ab_backward: status $status"
exit $status
