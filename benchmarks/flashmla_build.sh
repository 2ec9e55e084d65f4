# FlashMLA beside our kernels (its public sources, not a dependency), for the GPU scripts that compare
# against it: `source` this file with $repo and $out set. FlashMLA's sources are in $JSMLA_FLASHMLA_SRC
# (default .anchors/flashmla, a folder the checkout ignores) with the trimmed SM90 build recipe.
flashmla_src=${JSMLA_FLASHMLA_SRC:-$repo/.anchors/flashmla}
flashmla_pid=""

# Starts FlashMLA's build in the background (log: $out/flashmla_build.log) when its sources are there.
start_flashmla_build() {
  if [ -f "$flashmla_src/setup_sm90.py" ] && [ ! -f "$flashmla_src/csrc/flashmla_stubs.cpp" ]; then
    # The trimmed recipe compiles csrc/flashmla_stubs.cpp (the entry points it leaves out); without it
    # the build fails after a minute with a ninja error that does not name the cause.
    echo "FlashMLA: $flashmla_src/csrc/flashmla_stubs.cpp is missing (the recipe's stubs go into csrc/)" \
      | tee "$out/flashmla_build.log"
    return
  fi
  if [ -f "$flashmla_src/setup_sm90.py" ]; then
    # CUDA 13 keeps the CCCL headers (cuda/std/...) under include/cccl, where nvcc finds them and the
    # host compiler of FlashMLA's C++ sources does not.
    local cccl
    cccl=$(dirname "$(dirname "$(command -v nvcc)")")/include/cccl
    (cd "$flashmla_src" && CPLUS_INCLUDE_PATH="$cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" MAX_JOBS=8 NVCC_THREADS=1 TORCH_CUDA_ARCH_LIST=9.0a \
       python3 setup_sm90.py build_ext --inplace > "$out/flashmla_build.log" 2>&1) &
    flashmla_pid=$!
  fi
}

# Waits for that build; true when FlashMLA's extension is there to import (PYTHONPATH=$flashmla_src).
flashmla_ready() {
  [ -z "$flashmla_pid" ] || wait "$flashmla_pid"
  [ -d "$flashmla_src/flash_mla" ] && ls "$flashmla_src"/flash_mla/cuda*.so > /dev/null 2>&1
}
