// Host entry of the split-K combine kernel (combine.cuh).
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/launch_params.h"

namespace jsmla::cuda {

// Merges p.num_splits partial states into out/lse on `stream`. d_v must be 512 or 1024 and num_splits at
// most combine_max_splits(). `sm_count`: the device's SMs (the block shape depends on how many rows
// fill it). `dependent`: launch it as the programmatic dependent of the kernel queued before it (sm_90
// and newer), so its blocks start while that kernel finishes.
cudaError_t launch_combine(const CombineParams& p, int d_v, int sm_count, bool dependent, cudaStream_t stream);

// Splits one combine reads at most.
int combine_max_splits();

}  // namespace jsmla::cuda
