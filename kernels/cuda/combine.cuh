// Merging the split-K partial states of a decode call (layout: split_workspace.h) into out/lse.
// One block per (token, head): every thread owns float4 chunks of the row and walks the splits in
// index order, several splits' loads in flight at once (a T=1 decode has one row per head and up to
// dozens of splits, so the merge is latency-bound). Reductions use a fixed order, so the result is
// bitwise reproducible (no atomics). Shared by every kernel family.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/softmax_merge.cuh"

namespace jsmla::cuda {

inline constexpr int kCombineThreads = 128;
inline constexpr int kCombineSplitsInFlight = 8;  // splits whose partial rows are loaded together

template <int kDv>
__global__ void __launch_bounds__(kCombineThreads) combine_splits_kernel(const __grid_constant__ CombineParams p) {
  static_assert(kDv % (4 * kCombineThreads) == 0, "each thread merges whole float4 chunks of the row");
  constexpr int kChunks = kDv / (4 * kCombineThreads);
  const int64_t row = blockIdx.x;  // token * H + head
  const int64_t token = row / p.num_heads;
  const int head = static_cast<int>(row % p.num_heads);
  uint2* out = reinterpret_cast<uint2*>(p.out + row * kDv);

  if (token >= valid_token_count(p.valid_tokens, p.num_tokens)) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) out[c * kCombineThreads + threadIdx.x] = make_uint2(0, 0);
    if (threadIdx.x == 0) p.lse[row] = -INFINITY;
    return;
  }

  // Every thread computes the same log-sum-exp from the (L1-cached) split values, in split order.
  auto lse_of = [&](int split) {
    return p.workspace.partial_lse[SplitWorkspace::row(split, token, head, p.num_tokens, p.num_heads)];
  };
  float max_lse = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) max_lse = fmaxf(max_lse, lse_of(s));
  float sum = 0.0f;
  if (max_lse != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) sum += expf(lse_of(s) - max_lse);
  }
  const float splits_lse = max_lse == -INFINITY ? -INFINITY : max_lse + logf(sum);
  const float lse = lse_with_sink(splits_lse, p.attn_sink != nullptr ? p.attn_sink[head] : -INFINITY);

  float4 acc[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) acc[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int first = 0; first < p.num_splits; first += kCombineSplitsInFlight) {
    float weight[kCombineSplitsInFlight];
    float4 part[kCombineSplitsInFlight][kChunks];
#pragma unroll
    for (int u = 0; u < kCombineSplitsInFlight; ++u) {
      const int s = first + u;
      // An empty split (or a +inf sink) has weight 0 and its row is never read.
      weight[u] = s < p.num_splits ? state_weight(lse_of(s), lse) : 0.0f;
      const float4* source = reinterpret_cast<const float4*>(
          p.workspace.partial_out + SplitWorkspace::row(s, token, head, p.num_tokens, p.num_heads) * kDv);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        part[u][c] = weight[u] != 0.0f ? source[c * kCombineThreads + threadIdx.x] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
#pragma unroll
    for (int u = 0; u < kCombineSplitsInFlight; ++u) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        acc[c].x += weight[u] * part[u][c].x;
        acc[c].y += weight[u] * part[u][c].y;
        acc[c].z += weight[u] * part[u][c].z;
        acc[c].w += weight[u] * part[u][c].w;
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    out[c * kCombineThreads + threadIdx.x] =
        make_uint2(pack_bf16x2(acc[c].x, acc[c].y), pack_bf16x2(acc[c].z, acc[c].w));
  }
  if (threadIdx.x == 0) p.lse[row] = lse;
}

}  // namespace jsmla::cuda
