// Declaration of the Hopper family's launch template; its definition is in sparse_mla_kernel.cuh and
// each instantiation is compiled in its own file under instances/.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/launch_params.h"

namespace jsmla::cuda::hopper {

template <class Cfg>
cudaError_t launch_sparse_mla_hopper(const SplitKvParams& p, cudaStream_t stream);

}  // namespace jsmla::cuda::hopper
