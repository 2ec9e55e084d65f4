// The CUDA backward (the vector-Jacobian product of the attention, docs/semantics.md, differentiation):
// the gradients of q, of the sinks and of a bf16 main cache, recomputed from the forward's lse as the CPU backward kernel does
// (kernels/cpu/sparse_mla_cpu_bwd.cc states the math). Host-side declarations; backward.cu holds the
// kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/backward_params.h"
#include "kernels/common/formats.h"
#include "kernels/cuda/backward_workspace.h"

namespace jsmla::cuda {

// Launches the backward of `p` on `stream` (the gradients p asks for: q, attn_sink, and a bf16 main
// cache's). `main` and `extra` are the formats of the two candidate lists (the extra list's is ignored
// without one); the workspace holds BackwardWorkspace::bytes(...) bytes (backward_workspace.h), 16-byte
// aligned. Nothing is launched for T = 0. cudaErrorInvalidValue: the workspace is too small for the
// cache gradient's sort.
cudaError_t launch_backward(const FormatTraits& main, const FormatTraits& extra, const BackwardParams& p,
                            void* workspace, int64_t workspace_bytes, cudaStream_t stream);

}  // namespace jsmla::cuda
