// One compiled kernel of a family, as the FFI handler and kernel_configs() see it.
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/formats.h"
#include "kernels/cuda/launch_params.h"

namespace jsmla::cuda {

struct KernelInfo {
  FormatId format;
  int heads_per_block;
  int threads;
  int candidate_tile;
  int shared_bytes;  // dynamic shared memory per block
  cudaError_t (*launch)(const SplitKvParams&, cudaStream_t);
};

}  // namespace jsmla::cuda
