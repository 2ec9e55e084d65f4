// What the tensor-core backward kernel (mma_kernel.cuh) is launched with, and which formats it serves:
// host-side declarations shared by its configuration (mma_config.h), its instances (instances/,
// generated) and the backward's dispatcher (kernels/cuda/backward.cu). No CUDA device code.
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/backward_params.h"
#include "kernels/common/formats.h"

namespace jsmla::cuda::backward {

// One launch covers the tokens [first_token, first_token + chunk_tokens). With a bf16 main cache's
// gradient (partials != nullptr) the kernel also writes every row's P_j and c_j of the chunk's main-list
// positions (bf16 [chunk_tokens, H, position_pitch]), and the launch then runs the partials kernel:
// each position's Σ_h c_j q_h + P_j dO_h (bf16 [chunk_tokens * topk, d_qk]; backward_workspace.h).
struct BackwardMmaLaunch {
  BackwardParams p;
  const double* d_rows;  // [T, H] (workspace): D = <dO, out> of every row, 0 for an inactive row
  int64_t first_token = 0;
  int64_t chunk_tokens = 0;
  uint16_t* weights = nullptr;       // P (bf16), or nullptr without a cache gradient
  uint16_t* coefficients = nullptr;  // c (bf16)
  uint16_t* partials = nullptr;      // bf16
  int64_t position_pitch = 0;
  // The partials on wgmma (partials_wgmma.cuh): an sm_90 device and a build with sm_90a code.
  bool wgmma_partials = false;
};

// Whether the tensor-core kernel's tiling holds a format's rows: d_qk of 512 or 576 lanes (whole 64-lane
// column halves per warp), V the first 512 lanes, and scales that BF16 tiles carry exactly (arbitrary
// FP32 scales, glm_*, would need the per-group mantissa factors of the forward kernels; the SIMT kernel
// serves those and the 1088-wide dots3_swa rows).
constexpr bool mma_backward_serves(const FormatTraits& f) {
  const bool exact_scales = f.scale_kind == ScaleKind::kFp32 && !f.pow2_scales;
  return (f.d_qk == 512 || f.d_qk == 576) && f.d_v == 512 && !exact_scales;
}

// Launches the instance of format `Cfg::kFormat` over chunk_tokens × ceil(H / 64) blocks, then (with
// partials) the partials kernel (on wgmma: chunk_tokens × d_qk / 192 or / 128 blocks; otherwise
// chunk_tokens × 2); never an empty grid (chunk_tokens > 0).
template <class Cfg>
cudaError_t launch_backward_mma(const BackwardMmaLaunch& launch, cudaStream_t stream);

}  // namespace jsmla::cuda::backward
