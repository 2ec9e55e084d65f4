// The instantiated kernels of the portable family, for the FFI handler and kernel_configs().
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/formats.h"
#include "kernels/cuda/kernel_info.h"
#include "kernels/cuda/launch_params.h"

namespace jsmla::cuda::portable {

using cuda::KernelInfo;

// Every instantiation, format-major, head tiles ascending.
const KernelInfo* kernels_begin();
const KernelInfo* kernels_end();

// The kernel for a format and head tile, or nullptr when that pair is not instantiated.
const KernelInfo* find_kernel(FormatId format, int heads_per_block);

// Split sizes of the decode variant must be positive multiples of this (for every format).
int split_granule();

// Values of the `variant` plan attribute this family serves (0, the reference, is CPU-only).
inline constexpr int kVariantDecode = 1;   // split-K over candidates + combine, through the workspace
inline constexpr int kVariantPrefill = 2;  // one pass per (token, head tile), no workspace

// Oldest compute capability (major * 10 + minor) the family runs on.
inline constexpr int kMinComputeCapability = 80;

}  // namespace jsmla::cuda::portable
