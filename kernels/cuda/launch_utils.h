// Host-side launch helpers shared by the CUDA kernels.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

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

}  // namespace jsmla::cuda
