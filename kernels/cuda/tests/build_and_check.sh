#!/usr/bin/env bash
# Builds the CUDA extension (CMake, not pip) and the standalone kernel check on a GPU machine, then runs
# the FFI check, the kernel check (correctness + timing) and compute-sanitizer on small cases.
# Usage, from the repository root: kernels/cuda/tests/build_and_check.sh [--quick]
# Logs go to $OUT (default /tmp/jsmla_check); ARCHS / NVCC_ARCH pick the targets (default sm_90a);
# CHECK_TIMEOUT bounds the kernel check (seconds), SKIP_SANITIZE=1 skips compute-sanitizer.
set -uo pipefail
OUT=${OUT:-/tmp/jsmla_check}
BUILD=${BUILD:-/tmp/jsmla_build}
ARCHS=${ARCHS:-90a-real}
NVCC_ARCH=${NVCC_ARCH:--gencode=arch=compute_90a,code=sm_90a}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
start=$(date +%s)
if ! { cmake -S . -B "$BUILD" -G Ninja -DJSMLA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" \
         -DPython_EXECUTABLE="$(command -v python3)" && cmake --build "$BUILD" -j"$(nproc)"; } >"$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40
  exit 1
fi
if ! nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I. $NVCC_ARCH kernels/cuda/tests/portable_check.cu \
       kernels/cpu/sparse_mla_cpu.cc "$BUILD/libjsmla_cuda.a" -o "$BUILD/portable_check" >>"$OUT/build.log" 2>&1; then
  grep -E "error" "$OUT/build.log" | head -40
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
for f in "$BUILD"/CMakeFiles/jsmla_cuda.dir/kernels/cuda/hopper/instances/dsv3_2.cu.o \
         "$BUILD"/CMakeFiles/jsmla_cuda.dir/kernels/cuda/portable/instances/dsv3_2_h64.cu.o \
         "$BUILD"/CMakeFiles/jsmla_cuda.dir/kernels/cuda/portable/instances/bf16_576_h64.cu.o; do
  echo "== $(basename "$f")"
  cuobjdump --dump-sass "$f" | grep -oE "HGMMA[.A-Z0-9_]*|WARPGROUP[.A-Z]*|HMMA[.A-Z0-9]*|LDSM[.A-Z0-9]*|LDGSTS[.A-Z0-9]*|LDL|STL|MUFU.EX2|F2FP[.A-Z0-9]*|PRMT|HFMA2[.A-Z0-9_]*|BAR[.A-Z]*" | sort | uniq -c
done >"$OUT/sass_summary.txt" 2>&1
timeout 120 python3 kernels/cuda/tests/ffi_check.py "$BUILD" 2>&1 | grep -v "^WARNING" | tee "$OUT/ffi.log"
timeout "${CHECK_TIMEOUT:-300}" "$BUILD/portable_check" "$@" 2>&1 | tee "$OUT/check.log"
status=${PIPESTATUS[0]}
if [ -z "${SKIP_SANITIZE:-}" ] && command -v compute-sanitizer >/dev/null; then
  timeout 60 compute-sanitizer --tool memcheck --print-limit 5 "$BUILD/portable_check" --sanitize >"$OUT/memcheck.log" 2>&1
  echo "memcheck: exit $? :: $(grep -E "ERROR SUMMARY|CHECKS" "$OUT/memcheck.log" | tr '\n' ' ')"
  timeout 75 compute-sanitizer --tool racecheck --print-limit 5 "$BUILD/portable_check" --sanitize >"$OUT/racecheck.log" 2>&1
  echo "racecheck: exit $? :: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|CHECKS" "$OUT/racecheck.log" | tr '\n' ' ')"
fi
sed -n "/^case /,\$p" "$OUT/check.log"
exit "$status"
