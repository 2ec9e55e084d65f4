// The instantiated kernels of the Hopper family (sm_90a), for the FFI handler and kernel_configs().
// They serve the same plans as the portable kernels with 64 heads per block: the same variants,
// split sizes and workspace, so the handler may run either family for a plan.
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/formats.h"
#include "kernels/cuda/kernel_info.h"

namespace jsmla::cuda::hopper {

// Every instantiation, in FormatId order.
const KernelInfo* kernels_begin();
const KernelInfo* kernels_end();

// The kernel for a format and head tile, or nullptr when the family has none.
const KernelInfo* find_kernel(FormatId format, int heads_per_block);

// Whether this build carries sm_90a code for the family (the CUDA architectures included 90a).
bool compiled();

// Compute capability (major * 10 + minor) the family runs on: exactly sm_90 (sm_90a code).
inline constexpr int kComputeCapability = 90;

}  // namespace jsmla::cuda::hopper
