// Portable kernel instantiation: dots3_swa, 32 heads per block.
#include "kernels/cuda/portable/sparse_mla_kernel.cuh"

namespace jsmla::cuda::portable {
template cudaError_t launch_sparse_mla_portable<PortableConfig<FormatId::kDots3Swa, 32>>(const SplitKvParams&,
                                                                                       cudaStream_t);
}  // namespace jsmla::cuda::portable
