// Hopper kernel instantiation: dsv4_1, 64 heads per block.
#include "kernels/cuda/hopper/sparse_mla_kernel.cuh"

namespace jsmla::cuda::hopper {
template cudaError_t launch_sparse_mla_hopper<HopperConfig<FormatId::kDsv41>>(const SplitKvParams&, cudaStream_t);
}  // namespace jsmla::cuda::hopper
