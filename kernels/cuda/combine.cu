#include "kernels/cuda/combine.h"

#include "kernels/cuda/combine.cuh"

namespace jsmla::cuda {

cudaError_t launch_combine(const CombineParams& p, int d_v, cudaStream_t stream) {
  const int64_t rows = p.num_tokens * p.num_heads;
  if (rows == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(rows);
  switch (d_v) {
    case 512: combine_splits_kernel<512><<<blocks, kCombineThreads, 0, stream>>>(p); break;
    case 1024: combine_splits_kernel<1024><<<blocks, kCombineThreads, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace jsmla::cuda
