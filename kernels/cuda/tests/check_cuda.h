// CHECK_CUDA for the standalone CUDA programs of this folder (the kernel check and the probes): a failed
// runtime call prints its error, the call and where it was made, and exits with status 2.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(call)                                                                          \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "CUDA error %s at %s:%d (%s): %s\n", cudaGetErrorName(e_), __FILE__,     \
                   __LINE__, #call, cudaGetErrorString(e_));                                      \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)
