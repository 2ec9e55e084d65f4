#!/usr/bin/env bash
# One GPU session in one command: build the CUDA extension, run a test tier, optionally benchmark.
#
#   bash benchmarks/gpu_session.sh smoke          # build + GPU smoke tier + smoke benchmark
#   bash benchmarks/gpu_session.sh full           # build + full GPU matrix
#   bash benchmarks/gpu_session.sh sanitize       # build + compute-sanitizer memcheck, racecheck and
#                                                 # synccheck on the tests named *sanitize* (JSMLA_SANITIZE_
#                                                 # MEMCHECK / _FILTER narrow them), and racecheck
#                                                 # on kernels/cuda/tests/racecheck_probe.cu's hand-overs
#   bash benchmarks/gpu_session.sh soak           # build + tests/gpu/soak.py (20 000 random launches
#                                                 # under a watchdog, every 100th checked on the CPU)
#   bash benchmarks/gpu_session.sh bench          # build + GPU smoke tier + the full benchmark grid
#   bash benchmarks/gpu_session.sh release        # build + benchmark grid + full tier + planner sweep
#   bash benchmarks/gpu_session.sh sweep          # build + calibrate + planner sweep(s) (JSMLA_SWEEP_SPECS:
#                                                 # ";"-separated planner_sweep.py arguments, one sweep each;
#                                                 # JSMLA_SWEEP_SMOKE=1: the smoke tier first)
#   bash benchmarks/gpu_session.sh multi          # build + the multi-GPU sharding tests + bench_sharded.py
#   JSMLA_WHEEL=dist/<wheel> bash benchmarks/gpu_session.sh wheel
#                                                 # no build: the given wheel installed with nvcc off PATH,
#                                                 # the GPU smoke tier, the example's decode-step benchmark
#                                                 # (its pure-Python needs from $JSMLA_EXTRA_WHEELS, if set)
#   bash benchmarks/gpu_session.sh compare        # build (+ FlashMLA) + smoke tier + standalone check + the
#                                                 # benchmark cases of JSMLA_BENCH_ARGS (default: bench.py's
#                                                 # --grid compare on dsv3_2) with a FlashMLA column
#                                                 # (JSMLA_COMPARE_TESTS=0 / JSMLA_COMPARE_CHECK=0 skip the
#                                                 # tier / the check)
#   bash benchmarks/gpu_session.sh backward       # build + the backward's GPU tests + memcheck, racecheck and
#                                                 # synccheck over their sanitize tests (the tools of
#                                                 # JSMLA_BACKWARD_SANITIZERS) + bench_backward.py's H200 rows
#                                                 # (JSMLA_BACKWARD_TESTS=0: the rows only, of the formats
#                                                 # JSMLA_BACKWARD_FORMATS and the T of JSMLA_BACKWARD_TOKENS;
#                                                 # XLA timed up to JSMLA_BACKWARD_XLA_MAX_TOKENS, 1024)
#   bash benchmarks/gpu_session.sh backward_profile
#                                                 # build + ncu per-kernel times of one jitted jax.grad step
#                                                 # (bf16_576 T=1024 H=128: q, q + cache; dsv3_2: q;
#                                                 # JSMLA_BACKWARD_PROFILES="bf16_576:cache" picks some)
#   JSMLA_TEST_ARGS='-m gpu -k backward' bash benchmarks/gpu_session.sh tests
#                                                 # build + the pytest selection JSMLA_TEST_ARGS (test paths,
#                                                 # e.g. tests/gpu/test_cuda.py, relative to the repository)
#
# JSMLA_SESSION_TREE=<dir> builds, installs and tests another copy of the repository instead of this
# one (e.g. a branch exported with `git archive <branch> | tar x -C .ab/<name>`, carried with .ab).
#
# FlashMLA (for the comparison columns): its public sources with the trimmed SM90 build recipe in
# $JSMLA_FLASHMLA_SRC (default .anchors/flashmla, a folder the checkout ignores); built in the
# background while the tests run, then put on PYTHONPATH. Without it the columns are skipped.
#
# Logs and results go to $OUT (default /tmp/jsmla_out); a short table is printed last.
set -uo pipefail
mode=${1:-smoke}
repo=$(cd "${JSMLA_SESSION_TREE:-$(dirname "$0")/..}" && pwd)
out=${OUT:-/tmp/jsmla_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# Several JAX processes share the GPU here (the replay test starts one; release runs two tiers at once).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
archs=${JSMLA_SESSION_ARCHS:-90a-real}

start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
# JSMLA_SESSION_SKIP_BUILD=1: a second mode in the same machine session reuses the installed build.
if [ "$mode" = wheel ]; then
  # The wheel must load without a CUDA toolkit: nvcc is taken off PATH before it is installed and used.
  kept=""
  IFS=: read -ra path_dirs <<< "$PATH"
  for d in "${path_dirs[@]}"; do [ -x "$d/nvcc" ] || kept="${kept:+$kept:}$d"; done
  export PATH="$kept" CUDACXX=/nonexistent
  if command -v nvcc > /dev/null; then echo "nvcc still on PATH: $(command -v nvcc)"; exit 1; fi
  python3 -m pip install --no-deps --force-reinstall "$repo/${JSMLA_WHEEL:?JSMLA_WHEEL names the wheel}" \
    > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; echo "WHEEL INSTALL FAILED"; exit 1; }
  if [ -n "${JSMLA_EXTRA_WHEELS:-}" ]; then
    python3 -m pip install --no-deps --no-index "$repo/$JSMLA_EXTRA_WHEELS"/*.whl >> "$out/build.log" 2>&1 || true
  fi
  tail -1 "$out/build.log"
elif [ "${JSMLA_SESSION_SKIP_BUILD:-0}" != 1 ] && \
   ! JSMLA_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-build-isolation --no-deps -v \
    "$repo" -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$archs" > "$out/build.log" 2>&1; then
  tail -60 "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
grep -E "registers|spill|smem" "$out/build.log" | sort -u | head -40 > "$out/ptxas.txt" || true

source "$repo/benchmarks/flashmla_build.sh"
[ "$mode" = compare ] && start_flashmla_build

cd /tmp  # import the installed package, not the source tree
python3 -c "import jax, jax_sparse_mla as j; print('jax', jax.__version__, jax.devices(), 'cuda ext:', j.cuda_available())"

status=0
# Runs pytest on the repository's tests, or on the test paths among the arguments (relative to the
# repository root: tests run from /tmp, so that the installed package is imported, not the tree).
run_tests() {
  local args=() paths=0 a
  for a in "$@"; do
    if [[ "$a" == tests/* || "$a" == tests ]]; then args+=("$repo/$a"); paths=1; else args+=("$a"); fi
  done
  [ "$paths" = 1 ] || args+=("$repo/tests")
  python3 -m pytest -q -rs -p no:cacheprovider --continue-on-collection-errors "${args[@]}" 2>&1 | tee -a "$out/tests.log" | tail -25
  return "${PIPESTATUS[0]}"
}
case "$mode" in
  smoke)
    run_tests -m "gpu and not gpu_full" || status=1
    python3 "$repo/benchmarks/bench.py" --grid smoke --out_dir "$out" --tag smoke > "$out/bench_smoke.log" 2>&1 || status=1
    tail -12 "$out/bench_smoke.log"
    ;;
  full)
    run_tests -m "gpu or gpu_full" || status=1
    ;;
  tests)
    # shellcheck disable=SC2086  # JSMLA_TEST_ARGS is a list of pytest arguments
    eval "run_tests ${JSMLA_TEST_ARGS:?JSMLA_TEST_ARGS names the pytest selection}" || status=1
    ;;
  backward)
    if [ "${JSMLA_BACKWARD_TESTS:-1}" = 1 ]; then  # 0: the benchmark rows only
      run_tests -m gpu -k "backward or grad" || status=1
      # memcheck, racecheck and synccheck over the backward's sanitize tests (JSMLA_BACKWARD_SANITIZERS
      # picks some; racecheck and synccheck track every shared-memory access and barrier: slower).
      for tool in ${JSMLA_BACKWARD_SANITIZERS:-memcheck racecheck synccheck}; do
        extra=""
        [ "$tool" = memcheck ] && extra="--leak-check no"
        # racecheck prints its first JSMLA_RACECHECK_PRINT_LIMIT reports (the tool's default is 100, too few
      # to tell whether every report is at one site); racecheck_summary.py groups them below.
      [ "$tool" = racecheck ] && extra="--racecheck-report all --print-limit ${JSMLA_RACECHECK_PRINT_LIMIT:-5000}"
        # shellcheck disable=SC2086  # $extra is a list of sanitizer flags
        JSMLA_SANITIZE=1 timeout "${JSMLA_SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool $tool $extra \
          --error-exitcode 9 --target-processes all python3 -m pytest -q -p no:cacheprovider -m gpu -k sanitize \
          "$repo/tests/gpu/test_backward_cuda.py" > "$out/sanitizer_${tool}_backward.log" 2>&1 || status=1
        echo "$tool (backward): $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitizer_${tool}_backward.log" | sort | uniq -c | tr '\n' ' ')"
        grep -E "passed|failed" "$out/sanitizer_${tool}_backward.log" | tail -1
      done
    fi
    # Each row compiles XLA's reference twice (13-20 s a jit at T = 1024): the rows go out on stderr and
    # into the results files as they complete, so a run cut short by the timeout keeps the rows it
    # finished. XLA's autodiff of the reference is timed up to JSMLA_BACKWARD_XLA_MAX_TOKENS tokens (1024;
    # 0: every row): above that it needs more than an H200's memory, which takes minutes to find out.
    if [ "${JSMLA_BACKWARD_ROWS:-1}" = 1 ]; then  # 0: the tests only
      timeout "${JSMLA_BENCH_TIMEOUT:-420}" python3 "$repo/benchmarks/bench_backward.py" \
        --formats "${JSMLA_BACKWARD_FORMATS:-bf16_576,dsv3_2}" --tokens "${JSMLA_BACKWARD_TOKENS:-1024,4096}" \
        --heads 128 --topk 2048 --cache_tokens 65536 --cache_gradient both --repeats 3 \
        --check_tokens 128 --xla_max_tokens "${JSMLA_BACKWARD_XLA_MAX_TOKENS:-1024}" \
        --out_dir "$out" > "$out/bench_backward.log" 2> "$out/bench_backward.err" || status=1
      grep -E "^\|" "$out/bench_backward.err" | tail -12
    fi
    ;;
  backward_profile)
    for profile in ${JSMLA_BACKWARD_PROFILES:-bf16_576:q bf16_576:cache dsv3_2:q}; do
      format=${profile%:*} gradient=${profile#*:}
      ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
        python3 "$repo/benchmarks/step_profile.py" --format "$format" --tokens 1024 --heads 128 \
        --gradient "$gradient" --steps 1 --once > "$out/backward_${format}_$gradient.csv" 2> "$out/backward_${format}_$gradient.err" ||
        status=1
      echo "== jax.grad step, $format T=1024 H=128, gradient of $gradient"
      python3 "$repo/benchmarks/step_profile.py" --summarize "$out/backward_${format}_$gradient.csv" --steps 1 | tail -14
    done
    ;;
  sanitize)
    # memcheck over every *sanitize* test (JSMLA_SANITIZE_MEMCHECK: another pytest -k selection); racecheck
    # and synccheck (slower: every shared-memory access and barrier is tracked) over those of
    # JSMLA_SANITIZE_FILTER (default: one FP8, one FP4 and one BF16 format, each on the 16-head portable
    # kernels and on the 128-head Hopper tiles, and dots3_swa's cluster tile).
    export JSMLA_SANITIZE=1
    filter=${JSMLA_SANITIZE_FILTER:-sanitize and (dsv3_2 or dsv4_nvfp4 or bf16_576 or dots3)}
    # JSMLA_SANITIZE_TOOLS: some of the three tools (the racecheck probe below runs with racecheck).
    for tool in ${JSMLA_SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
      selection="${JSMLA_SANITIZE_MEMCHECK:-sanitize}"
      [ "$tool" = memcheck ] || selection="$filter"
      extra=""
      [ "$tool" = memcheck ] && extra="--leak-check no"
      # racecheck prints its first JSMLA_RACECHECK_PRINT_LIMIT reports (the tool's default is 100, too few
      # to tell whether every report is at one site); racecheck_summary.py groups them below. With 0 it
      # prints every report (no host backtraces), streamed into racecheck_summary.py: the log is then the
      # grouped count of all of them, the raw reports (hundreds of MB) are not kept.
      limit=${JSMLA_RACECHECK_PRINT_LIMIT:-5000}
      stream=0
      [ "$tool" = racecheck ] && extra="--racecheck-report all --print-limit $limit"
      [ "$tool" = racecheck ] && [ "$limit" = 0 ] && stream=1 && extra="$extra --show-backtrace no"
      # shellcheck disable=SC2086  # $extra is a list of sanitizer flags
      command=(timeout "${JSMLA_SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" $extra --error-exitcode 9
               --target-processes all python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors
               -m gpu -k "$selection" "$repo/tests")
      if [ "$stream" = 1 ]; then
        "${command[@]}" 2>&1 | python3 "$repo/kernels/cuda/tests/racecheck_summary.py" - 3 > "$out/sanitizer_$tool.log"
        rc=${PIPESTATUS[0]}
      else
        "${command[@]}" > "$out/sanitizer_$tool.log" 2>&1
        rc=$?
      fi
      [ $rc -eq 0 ] || status=1
      echo "$tool: exit $rc; $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitizer_$tool.log" | sort | uniq -c | tr '\n' ' ')"
      grep -E "passed|failed" "$out/sanitizer_$tool.log" | tail -1
      if [ "$tool" = racecheck ]; then  # the reports by kernel, hazard and site pair
        if [ "$stream" = 1 ]; then
          grep -E "^ +[0-9]+  |^reports read" "$out/sanitizer_$tool.log" | head -12
        else
          python3 "$repo/kernels/cuda/tests/racecheck_summary.py" "$out/sanitizer_$tool.log" 0 | head -12
        fi
      fi
    done
    # What racecheck makes of a correct hand-over through counted named barriers (the kernels': two-sided
    # syncs, alone and inside a full/empty arrive cycle, and arrive/sync pairs), beside a block-wide one
    # (must be silent) and none at all (must be reported): kernels/cuda/tests/racecheck_probe.cu.
    if (cd "$repo" && nvcc -std=c++17 -O3 -arch=sm_90a -I. kernels/cuda/tests/racecheck_probe.cu -o "$out/racecheck_probe") \
        > "$out/racecheck_probe_build.log" 2>&1; then
      for probe in counted pipeline aligned arrive block none cluster exchange; do
        compute-sanitizer --tool racecheck --racecheck-report all "$out/racecheck_probe" $probe > "$out/racecheck_probe_$probe.log" 2>&1
        echo "racecheck probe $probe: exit $?; $(grep -E "^racecheck_probe |RACECHECK SUMMARY" "$out/racecheck_probe_$probe.log" | tr '\n' ' ')"
      done
    else
      echo "racecheck probe: BUILD FAILED"; status=1
    fi
    ;;
  soak)
    timeout "${JSMLA_SOAK_TIMEOUT:-420}" python3 "$repo/tests/gpu/soak.py" --launches "${JSMLA_SOAK_LAUNCHES:-20000}" \
      --out "$out/soak.json" > "$out/soak.log" 2>&1 || status=1
    tail -6 "$out/soak.log"
    ;;
  bench)
    run_tests -m "gpu and not gpu_full" || status=1
    python3 "$repo/benchmarks/bench.py" --grid full --out_dir "$out" > "$out/bench.log" 2>&1 || status=1
    tail -40 "$out/bench.log"
    ;;
  release)
    # Benchmark grid first (alone on the GPU), then the full tier, then the planner sweep; logs are
    # packed into one archive so every result file comes back.
    timeout 330 python3 "$repo/benchmarks/bench.py" --grid full --repeats 8 --out_dir "$out" > "$out/bench.log" 2>&1 || status=1
    tail -42 "$out/bench.log"
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu_full ${JSMLA_FULL_FILTER:+-k "$JSMLA_FULL_FILTER"} \
      "$repo/tests" > "$out/tests_full.log" 2>&1 || status=1
    tail -3 "$out/tests_full.log"
    timeout 400 python3 "$repo/benchmarks/planner_sweep.py" --out_dir "$out" > "$out/sweep.log" 2>&1 || status=1
    tail -16 "$out/sweep.log"
    (cd "$out" && tar czf logs.tgz --remove-files ./*.log ./*.txt 2>/dev/null)
    ;;
  bench-cases)
    # A chosen subset of the grid: JSMLA_BENCH_ARGS, e.g. "--cases dsv3_2:128:128 --prefill_tokens 4096".
    timeout "${JSMLA_BENCH_TIMEOUT:-400}" python3 "$repo/benchmarks/bench.py" ${JSMLA_BENCH_ARGS:-} --out_dir "$out" \
      > "$out/bench.log" 2>&1 || status=1
    tail -20 "$out/bench.log"
    ;;
  sweep)
    # JSMLA_SWEEP_SPECS: sweeps separated by ";", each a planner_sweep.py argument list (default: the
    # dsv3_2 grid); sweep i writes $out/sweep<i>/ and $out/sweep<i>.log. JSMLA_SWEEP_SMOKE=1: the smoke
    # tier first.
    if [ "${JSMLA_SWEEP_SMOKE:-0}" = 1 ]; then run_tests -m "gpu and not gpu_full" || status=1; fi
    IFS=';' read -ra sweep_specs <<< "${JSMLA_SWEEP_SPECS:-}"
    [ ${#sweep_specs[@]} = 0 ] && sweep_specs=("")
    for i in "${!sweep_specs[@]}"; do
      # shellcheck disable=SC2086  # a spec is a list of arguments
      timeout "${JSMLA_SWEEP_TIMEOUT:-300}" python3 "$repo/benchmarks/planner_sweep.py" --out_dir "$out/sweep$i" \
        ${sweep_specs[$i]} > "$out/sweep$i.log" 2>&1 || status=1
      echo "sweep $i (${sweep_specs[$i]:-dsv3_2 grid}):"
      grep -E "^calibrated:" "$out/sweep$i.log"
      tail -14 "$out/sweep$i.log"
    done
    ;;
  compare)
    if [ "${JSMLA_COMPARE_TESTS:-1}" = 1 ]; then  # the smoke tier (0: skip it, for a benchmark-only call)
      run_tests -m "gpu and not gpu_full" || status=1
    fi
    if [ "${JSMLA_COMPARE_CHECK:-1}" = 1 ]; then  # the standalone check (0: skip it)
      (cd "$repo" && SKIP_SANITIZE=1 OUT="$out/check" CHECK_TIMEOUT="${JSMLA_CHECK_TIMEOUT:-200}" \
         bash kernels/cuda/tests/build_and_check.sh > "$out/check.log" 2>&1) || status=1
      grep -E "^(device|case|.*(PASS|FAIL))" "$out/check.log" | tail -32
    fi
    if [ -n "$flashmla_pid" ]; then
      wait "$flashmla_pid" && export PYTHONPATH="$flashmla_src${PYTHONPATH:+:$PYTHONPATH}" \
        || { echo "FlashMLA build failed:"; tail -5 "$out/flashmla_build.log"; }
    fi
    compare_args="--grid compare --formats dsv3_2 --prefill_formats dsv3_2,bf16_576 --flashmla on"
    # shellcheck disable=SC2086  # a list of bench.py arguments
    timeout "${JSMLA_BENCH_TIMEOUT:-300}" python3 "$repo/benchmarks/bench.py" ${JSMLA_BENCH_ARGS:-$compare_args} \
      --out_dir "$out" > "$out/bench.log" 2>&1 || status=1
    tail -30 "$out/bench.log"
    ;;
  wheel)
    run_tests -m "gpu and not gpu_full" || status=1
    timeout "${JSMLA_BENCH_TIMEOUT:-300}" python3 "$repo/examples/deepseek_v32/bench_decode.py" ${JSMLA_EXAMPLE_ARGS:-} \
      --json "$out/example_decode.json" > "$out/example_decode.log" 2>&1 || status=1
    tail -12 "$out/example_decode.log"
    ;;
  multi)
    python3 -m pytest -q -p no:cacheprovider "$repo/tests/gpu/test_multi_gpu.py" 2>&1 | tee "$out/multi.log" | tail -8
    status=${PIPESTATUS[0]}
    timeout "${JSMLA_BENCH_TIMEOUT:-400}" python3 "$repo/benchmarks/bench_sharded.py" --out_dir "$out" \
      > "$out/bench_sharded.log" 2>&1 || status=1
    tail -16 "$out/bench_sharded.log"
    ;;
  *)
    echo "unknown mode $mode"; exit 2 ;;
esac
echo "session $mode: status $status, $(( $(date +%s) - start )) s"
# Logs in one archive (a device call returns few files); results (json, md, png) stay beside it.
(cd "$out" && find . -type f ! -name '*.json' ! -name '*.md' ! -name '*.png' ! -name '*.tgz' -print0 \
   | tar czf logs.tgz --null -T - --remove-files 2>/dev/null)
exit $status
