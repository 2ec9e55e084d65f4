// Portable kernel instantiation: dsv3_2, 64 heads per block.
#include "kernels/cuda/portable/sparse_mla_kernel.cuh"

namespace jsmla::cuda::portable {
template cudaError_t launch_sparse_mla_portable<PortableConfig<FormatId::kDsv32, 64>>(const SplitKvParams&,
                                                                                       cudaStream_t);
}  // namespace jsmla::cuda::portable
