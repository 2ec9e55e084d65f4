# The standalone kernel check of a source tree (kernels/cuda/tests/portable_check.cu, linked against
# CMake's jsmla_cuda library, sm_90a), for the GPU scripts that build trees side by side: `source` this
# file, then `build_check_tree <tree> <build folder> <log>` (0 when $build/portable_check was built).
build_check_tree() {
  local tree=$1 build=$2 log=$3
  (cd "$tree" && cmake -S . -B "$build" -G Ninja -DJSMLA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real \
      -DPython_EXECUTABLE="$(command -v python3)" && cmake --build "$build" -j"$(nproc)" --target jsmla_cuda &&
    nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I. -gencode=arch=compute_90a,code=sm_90a \
      kernels/cuda/tests/portable_check.cu kernels/cpu/sparse_mla_cpu.cc "$build/libjsmla_cuda.a" -o "$build/portable_check") \
    > "$log" 2>&1
}
