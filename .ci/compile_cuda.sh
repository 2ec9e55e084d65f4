#!/usr/bin/env bash
# Compiles the CUDA sources without a GPU: the whole CUDA extension for sm_90a, plus one instantiation
# of every kernel family for sm_80 and sm_120a (the portable family must keep compiling there; the
# Hopper family compiles to a trap there and is never launched).
# Usage: .ci/compile_cuda.sh BUILD_DIR   (needs nvcc, jaxlib and nanobind in the active Python)
set -euo pipefail
build=${1:?build directory}
cd "$(dirname "$0")/.."
python=$(command -v python3)
cmake -S . -B "$build" -G Ninja -DJSMLA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real -DPython_EXECUTABLE="$python"
cmake --build "$build" -j"$(nproc)"
ffi_include=$("$python" -c "import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))")
family_sources=(
  kernels/cuda/portable/instances/dsv3_2_h64.cu  # portable family (mma.sync)
  kernels/cuda/portable/instances/dsv4_h16.cu
  kernels/cuda/portable/instances/glm_nsa_h64.cu # its exact arbitrary-FP32-scale path
  kernels/cuda/hopper/instances/dsv3_2_h64.cu   # Hopper family (wgmma; a trap off sm_90a)
  kernels/cuda/combine.cu                         # split-K combine
)
for arch in 80 120a; do
  for source in "${family_sources[@]}"; do
    echo "nvcc sm_$arch $source"
    nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I. -I"$ffi_include" \
      -gencode=arch=compute_$arch,code=sm_$arch -c "$source" -o "$build/$(basename "$source").sm_$arch.o"
  done
done
echo "CUDA compile check passed"
