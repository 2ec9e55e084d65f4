// The launchable CUDA kernels: every instance of kernel_table.h with its launch function, for the FFI
// handler and the standalone kernel check.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/kernel_table.h"
#include "kernels/cuda/launch_params.h"

namespace jsmla::cuda {

struct KernelInfo {
  KernelShape shape;
  cudaError_t (*launch)(const SplitKvParams&, cudaStream_t);
};

// The instance of a family for a format and head tile, or nullptr when there is none.
const KernelInfo* find_kernel(Family family, FormatId format, int heads_per_block);

// Whether this build carries the Hopper family's sm_90a code (the CUDA architectures included 90a);
// without it the Hopper entries compile to a trap and are never launched.
bool hopper_compiled();

}  // namespace jsmla::cuda
