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

// The entry of a family's table [begin, end) for a format and head tile, or nullptr.
inline const KernelInfo* find_kernel_in(const KernelInfo* begin, const KernelInfo* end, FormatId format,
                                        int heads_per_block) {
  for (const KernelInfo* k = begin; k != end; ++k) {
    if (k->format == format && k->heads_per_block == heads_per_block) return k;
  }
  return nullptr;
}

}  // namespace jsmla::cuda
