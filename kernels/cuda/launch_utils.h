// Host-side launch helpers shared by the CUDA kernels.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "kernels/cuda/launch_params.h"

namespace jsmla::cuda {

// Runs a per-device setup step (e.g. raising a kernel's shared-memory limit, which is a property of
// the function on the current device) once for each of the first 64 devices, and every time beyond.
class DeviceOnce {
 public:
  template <class Step>
  cudaError_t run(Step step) {
    int device = 0;
    if (const cudaError_t error = cudaGetDevice(&device); error != cudaSuccess) return error;
    const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
    if (bit != 0 && (done_.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
    const cudaError_t error = step();
    if (error == cudaSuccess && bit != 0) done_.fetch_or(bit, std::memory_order_acq_rel);
    return error;
  }

 private:
  std::atomic<uint64_t> done_{0};
};

// Launches a kernel of any family over its (token, head tile, split) grid on `stream`, first raising the
// kernel's dynamic shared-memory limit (once per device, through `raised`) when it needs more than the
// default 48 KB. `cluster_blocks` > 1: each (token, head tile, split) is a cluster of that many
// consecutive blocks. The caller has checked the plan and the buffers; the grid is never empty (T > 0).
template <class Kernel>
cudaError_t launch_split_kv_grid(Kernel* kernel, int threads, int shared_bytes, DeviceOnce& raised,
                                 const SplitKvParams& p, cudaStream_t stream, int cluster_blocks = 1) {
  if (shared_bytes > 48 * 1024) {
    const cudaError_t error = raised.run(
        [&] { return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes); });
    if (error != cudaSuccess) return error;
  }
  const int64_t blocks = p.attn.num_tokens * p.num_head_tiles * p.num_splits;
  if (cluster_blocks == 1) {
    kernel<<<static_cast<unsigned>(blocks), threads, shared_bytes, stream>>>(p);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks * cluster_blocks));
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster_blocks;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, p);
}

}  // namespace jsmla::cuda
