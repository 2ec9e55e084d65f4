// Merging the split-K partial states of a decode call (layout: split_workspace.h) into out/lse.
// A block merges a slice of 4 * kLanes output columns of one (token, head) row with kLanes * kGroups
// threads. Its threads first read the row's per-split log-sum-exp values in parallel (one split per
// thread) and reduce them in a fixed tree order; then each of the kGroups thread groups owns every
// kGroups-th split, each thread a float4 of the slice, with a group's loads in flight together (the
// merge is latency-bound); the groups' sums are added in group order through shared memory. Two shapes
// (combine.cu picks one from the row count): few rows — a T=1 call — split each row over several
// blocks of 8 groups, so the merge spreads over many SMs and a thread walks few splits; many rows take
// one block of one group per row. Every order is fixed by num_splits and the shape alone, so the
// result is bitwise reproducible (no atomics). The kernel is launched as the programmatic dependent of
// the split kernel and waits for it before it reads the workspace. Shared by every kernel family.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/softmax_merge.cuh"

namespace jsmla::cuda {

// Splits one merge reads (its shared memory holds a weight per split); the handler checks plans against it.
inline constexpr int kCombineMaxSplits = 4096;

// The two block shapes: (float4 lanes of a row slice, split groups).
inline constexpr int kNarrowCombineLanes = 32;
inline constexpr int kNarrowCombineGroups = 8;
template <int kDv>
inline constexpr int kWideCombineLanes = kDv / 4;

// max (kMax) or sum of one value per thread of the block, the same in every thread, in a fixed order:
// warp trees, then the warps' results in index order.
template <bool kMax, int kThreads>
JSMLA_DEVICE float block_reduce(float value, float* scratch) {
  static_assert(kThreads % 32 == 0 && kThreads / 32 <= 32, "one partial per warp in one warp");
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = kMax ? fmaxf(value, other) : value + other;
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  float total = scratch[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) total = kMax ? fmaxf(total, scratch[w]) : total + scratch[w];
  __syncthreads();  // scratch is reused by the next reduction
  return total;
}

template <int kDv, int kLanes, int kGroups>
__global__ void __launch_bounds__(kLanes * kGroups) combine_splits_kernel(const __grid_constant__ CombineParams p) {
  constexpr int kThreads = kLanes * kGroups;
  constexpr int kColumns = 4 * kLanes;
  // A thread's splits whose partial loads are in flight together.
  constexpr int kSplitsInFlight = kGroups == 1 ? 16 : 8;
  static_assert(kDv % kColumns == 0, "the row splits into whole column slices");
  static_assert(kThreads <= 1024 && kThreads % 32 == 0, "a block is whole warps");
  extern __shared__ float split_weight[];  // [num_splits]
  __shared__ float scratch[kThreads / 32];
  __shared__ float4 group_sum[kGroups > 1 ? kGroups : 1][kGroups > 1 ? kLanes : 1];  // one group needs none
  const int64_t row = blockIdx.x;  // token * H + head
  const int64_t token = row / p.num_heads;
  const int head = static_cast<int>(row % p.num_heads);
  const int lane = threadIdx.x % kLanes;
  const int group = threadIdx.x / kLanes;
  const int column = blockIdx.y * kColumns + 4 * lane;  // this thread's float4 of the slice
  uint2* const out = reinterpret_cast<uint2*>(p.out + row * kDv + column);

  wait_for_prerequisite_grid();
  if (token >= valid_token_count(p.valid_tokens, p.num_tokens)) {
    if (group == 0) *out = make_uint2(0, 0);
    if (blockIdx.y == 0 && threadIdx.x == 0) p.lse[row] = -INFINITY;
    return;
  }

  // The splits' lse values (thread t holds splits t, t + kThreads, ...), their max and sum.
  float own_max = -INFINITY;
  for (int s = threadIdx.x; s < p.num_splits; s += kThreads) {
    const float split_lse = p.workspace.partial_lse[SplitWorkspace::row(s, token, head, p.num_tokens, p.num_heads)];
    split_weight[s] = split_lse;
    own_max = fmaxf(own_max, split_lse);
  }
  const float max_lse = block_reduce<true, kThreads>(own_max, scratch);
  float own_sum = 0.0f;
  if (max_lse != -INFINITY) {
    for (int s = threadIdx.x; s < p.num_splits; s += kThreads) own_sum += expf(split_weight[s] - max_lse);
  }
  const float sum = block_reduce<false, kThreads>(own_sum, scratch);
  const float splits_lse = max_lse == -INFINITY ? -INFINITY : max_lse + logf(sum);
  const float lse = lse_with_sink(splits_lse, p.attn_sink != nullptr ? p.attn_sink[head] : -INFINITY);
  // An empty split (or a +inf sink) gets weight 0 and its row is never read.
  for (int s = threadIdx.x; s < p.num_splits; s += kThreads) split_weight[s] = state_weight(split_weight[s], lse);
  __syncthreads();

  // This group's splits group, group + kGroups, ..., in order.
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int first = group; first < p.num_splits; first += kGroups * kSplitsInFlight) {
    float weight[kSplitsInFlight];
    float4 part[kSplitsInFlight];
#pragma unroll
    for (int u = 0; u < kSplitsInFlight; ++u) {
      const int s = first + u * kGroups;
      weight[u] = s < p.num_splits ? split_weight[s] : 0.0f;
      const float4* source = reinterpret_cast<const float4*>(
          p.workspace.partial_out + SplitWorkspace::row(s, token, head, p.num_tokens, p.num_heads) * kDv + column);
      part[u] = weight[u] != 0.0f ? *source : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kSplitsInFlight; ++u) {
      acc.x += weight[u] * part[u].x;
      acc.y += weight[u] * part[u].y;
      acc.z += weight[u] * part[u].z;
      acc.w += weight[u] * part[u].w;
    }
  }
  if constexpr (kGroups > 1) {
    group_sum[group][lane] = acc;
    __syncthreads();
  }
  if (group == 0) {
#pragma unroll
    for (int g = 1; g < kGroups; ++g) {
      const float4 other = group_sum[g][lane];
      acc.x += other.x;
      acc.y += other.y;
      acc.z += other.z;
      acc.w += other.w;
    }
    *out = make_uint2(pack_bf16x2(acc.x, acc.y), pack_bf16x2(acc.z, acc.w));
    if (blockIdx.y == 0 && threadIdx.x == 0) p.lse[row] = lse;
  }
}

}  // namespace jsmla::cuda
