// The launch templates of both kernel families. Their definitions are in the families'
// sparse_mla_kernel.cuh; each instantiation is compiled in its own generated file under instances/.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/launch_params.h"

namespace jsmla::cuda::portable {
template <class Cfg>
cudaError_t launch_sparse_mla_portable(const SplitKvParams& p, cudaStream_t stream);
}  // namespace jsmla::cuda::portable

namespace jsmla::cuda::hopper {
template <class Cfg>
cudaError_t launch_sparse_mla_hopper(const SplitKvParams& p, cudaStream_t stream);
}  // namespace jsmla::cuda::hopper
