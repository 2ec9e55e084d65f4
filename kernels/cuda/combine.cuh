// Merging the split-K partial states of a decode call (layout: split_workspace.h) into out/lse.
// A block merges a slice of 4 * kLanes output columns of one (token, head) row with kLanes * kGroups
// threads. Its threads first read the row's per-split log-sum-exp values in parallel (one split per
// thread) and reduce them in a fixed tree order, while each thread's first partial loads are already
// in flight (the merge is latency-bound); then each thread adds its 4 columns of every split's partial
// row (BF16 values, summed in FP32).
//
// One summation order for every shape: the splits form kMergeGroups merge groups (split s in group
// s % kMergeGroups); a group's splits are added in order into a sum started at zero (one fused
// multiply-add each), and the group sums are added in group order. The narrow shape gives each of its
// kMergeGroups thread groups one merge group (sums through shared memory) and splits a row over
// d_v / (4 kNarrowCombineLanes) blocks, so few rows — a T = 1 call — still spread over many SMs; the
// wide shape walks all merge groups in one thread, one block per row; the warp shape (at most
// kMergeGroups splits) gives a row to one warp, with no block barrier. All produce the same bits, so
// combine.cu picks the shape (combine_shape.h; and the loads in flight) from the row and split counts without
// changing any result: bitwise reproducible, no atomics, and a batch-invariant plan gives every row the
// same bits at every T. The kernel is launched as the programmatic dependent of the split kernel and waits for it
// before it reads the workspace. Shared by every kernel family.
#pragma once

#include <cuda_runtime.h>

#include <climits>

#include "kernels/common/numeric.h"
#include "kernels/cuda/combine_shape.h"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/softmax_merge.cuh"

namespace jsmla::cuda {

// max (kMax) or sum of one value per thread of the block, the same in every thread, in a fixed order:
// warp trees, then the warps' results in index order.
template <bool kMax, int kThreads>
JSMLA_DEVICE float block_reduce(float value, float* scratch) {
  static_assert(kThreads % 32 == 0 && kThreads / 32 <= 32, "one partial per warp in one warp");
  value = kMax ? warp_max(value) : warp_sum(value);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  float total = scratch[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) total = kMax ? fmaxf(total, scratch[w]) : total + scratch[w];
  __syncthreads();  // scratch is reused by the next reduction
  return total;
}

// A thread's place in the summation order (split = merge_group + kMergeGroups * k). A narrow thread
// walks the splits group, group + kMergeGroups, ...; a wide thread walks every merge group in turn.
// Advancing is increments only (no division in the merge loop).
struct MergeCursor {
  int merge_group;
  int k;
  // The split at the cursor; >= num_splits past the thread's last split.
  JSMLA_DEVICE int split() const { return merge_group < kMergeGroups ? merge_group + kMergeGroups * k : INT_MAX; }
  template <int kGroups>
  JSMLA_DEVICE void advance(int num_splits) {
    static_assert(kGroups == 1 || kGroups == kMergeGroups, "a thread walks one merge group or all of them");
    if (kGroups == kMergeGroups || split() + kMergeGroups < num_splits) {
      ++k;
    } else {
      ++merge_group;
      k = 0;
    }
  }
};

// The 4 BF16 partial values at `partial` (8-byte aligned), as loaded: kept packed until they are
// added (unpacked where they are loaded, the unpacking would wait for the loads there, before the lse
// reductions they are meant to overlap).
JSMLA_DEVICE uint2 load_partial4(const uint16_t* partial) { return *reinterpret_cast<const uint2*>(partial); }
// The 4 BF16 values of load_partial4 as floats.
JSMLA_DEVICE float4 unpack_partial4(uint2 bits) {
  return make_float4(bf16_low_to_float(bits.x), bf16_high_to_float(bits.x), bf16_low_to_float(bits.y),
                     bf16_high_to_float(bits.y));
}
// The same, zeros for a split of weight 0 (its row is never used).
JSMLA_DEVICE float4 partial_values(uint2 bits, float weight) {
  return weight == 0.0f ? make_float4(0.0f, 0.0f, 0.0f, 0.0f) : unpack_partial4(bits);
}

JSMLA_DEVICE void add_float4(float4& sum, const float4& value) {
  sum.x += value.x;
  sum.y += value.y;
  sum.z += value.z;
  sum.w += value.w;
}

// Threads one SM holds on the architecture this pass compiles for (sm_86, sm_87, sm_89 and sm_120 hold
// 1536, the others we build for 2048): an instantiation's blocks per SM are capped to fit.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890 || \
                               (__CUDA_ARCH__ >= 1200 && __CUDA_ARCH__ < 1300))
inline constexpr int kSmThreads = 1536;
#else
inline constexpr int kSmThreads = 2048;
#endif
constexpr int fitting_blocks_per_sm(int blocks, int threads) {
  return blocks * threads <= kSmThreads ? blocks : kSmThreads / threads;
}

// kSplitsInFlight: a thread's partial loads in flight together; kBlocksPerSm: the blocks per SM the
// instantiation is compiled for (its register budget, 65536 / (blocks × threads)); kFewSplits: the
// caller guarantees num_splits <= kMergeGroups, so a wide thread's merge groups hold one split each (the
// same order with less bookkeeping).
template <int kDv, int kLanes, int kGroups, int kSplitsInFlight, int kBlocksPerSm, bool kFewSplits>
__global__ void __launch_bounds__(kLanes * kGroups, fitting_blocks_per_sm(kBlocksPerSm, kLanes * kGroups))
    combine_splits_kernel(const __grid_constant__ CombineParams p) {
  constexpr int kThreads = kLanes * kGroups;
  constexpr bool kOneSplitPerGroup = kGroups == 1 && kFewSplits;
  constexpr int kColumns = 4 * kLanes;
  static_assert(kDv % kColumns == 0, "the row splits into whole column slices");
  static_assert(kThreads <= 1024 && kThreads % 32 == 0, "a block is whole warps");
  extern __shared__ float split_weight[];  // [num_splits], padded (combine.cu)
  __shared__ float scratch[kThreads / 32];
  __shared__ float4 group_sum[kGroups > 1 ? kGroups : 1][kGroups > 1 ? kLanes : 1];  // one group needs none
  const int64_t row = blockIdx.x;  // token * H + head
  const int64_t token = row / p.num_heads;
  const int head = static_cast<int>(row % p.num_heads);
  const int lane = threadIdx.x % kLanes;
  const int group = threadIdx.x / kLanes;
  const int column = blockIdx.y * kColumns + 4 * lane;  // this thread's float4 of the slice
  uint2* const out = reinterpret_cast<uint2*>(p.out + row * kDv + column);

  // A padding row depends on nothing the split kernel writes (valid_tokens is an input, and decode
  // splits never write out/lse): it is written before waiting for the split kernel's results.
  if (token >= valid_token_count(p.valid_tokens, p.num_tokens)) {
    if (group == 0) *out = make_uint2(0, 0);
    if (blockIdx.y == 0 && threadIdx.x == 0) p.lse[row] = -INFINITY;
    return;
  }
  wait_for_prerequisite_grid();

  // The thread's splits in summation order, kSplitsInFlight at a time. The first batch is loaded
  // before the weights are known (the loads overlap the lse reduction below): every split writes its
  // partial row of a valid token (zeros when it saw no candidate), and a split of weight 0 adds exactly
  // 0 (its loaded value is replaced, never multiplied).
  const int count = kGroups == 1 ? p.num_splits : (p.num_splits - group + kMergeGroups - 1) / kMergeGroups;
  const uint16_t* const partial_column = p.workspace.partial_out + column;
  uint2 part[kSplitsInFlight];
  MergeCursor load_cursor{kGroups == 1 ? 0 : group, 0};
  auto load_batch = [&](int first) {
#pragma unroll
    for (int u = 0; u < kSplitsInFlight; ++u) {
      const int s = kOneSplitPerGroup ? first + u : load_cursor.split();
      part[u] = s < p.num_splits
                    ? load_partial4(partial_column + SplitWorkspace::row(s, token, head, p.num_tokens, p.num_heads) * kDv)
                    : make_uint2(0u, 0u);
      if constexpr (!kOneSplitPerGroup) load_cursor.template advance<kGroups>(p.num_splits);
    }
  };
  load_batch(0);

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
  // An empty split (or a +inf sink) gets weight 0: its loaded row is replaced by zeros.
  for (int s = threadIdx.x; s < p.num_splits; s += kThreads) split_weight[s] = state_weight(split_weight[s], lse);
  __syncthreads();

  // Summation (above): `acc` is the open merge group's sum; `total` the closed groups' sum in order.
  float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if constexpr (kOneSplitPerGroup) {
    for (int first = 0; first < p.num_splits; first += kSplitsInFlight) {
      if (first != 0) load_batch(first);
#pragma unroll
      for (int u = 0; u < kSplitsInFlight; ++u) {
        const int s = first + u;
        if (s >= p.num_splits) break;
        const float weight = split_weight[s];
        const float4 value = partial_values(part[u], weight);
        const float4 group_total = make_float4(fmaf(weight, value.x, 0.0f), fmaf(weight, value.y, 0.0f),
                                               fmaf(weight, value.z, 0.0f), fmaf(weight, value.w, 0.0f));
        if (s == 0) {
          total = group_total;
        } else {
          add_float4(total, group_total);
        }
      }
    }
    for (int g = p.num_splits; g < kMergeGroups; ++g) add_float4(total, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
  } else {
  const int first_group = kGroups == 1 ? 0 : group;
  const int last_group = kGroups == 1 ? kMergeGroups - 1 : group;
  int open_group = first_group;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  MergeCursor cursor{first_group, 0};
  auto close_group = [&]() {
    if (open_group == first_group) {
      total = acc;
    } else {
      add_float4(total, acc);
    }
    acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    ++open_group;
  };
  for (int first = 0; first < count; first += kSplitsInFlight) {
    if (first != 0) load_batch(first);
#pragma unroll
    for (int u = 0; u < kSplitsInFlight; ++u) {
      const int split = cursor.split();
      if (split >= p.num_splits) break;
      while (open_group < cursor.merge_group) close_group();
      cursor.advance<kGroups>(p.num_splits);
      const float weight = split_weight[split];
      const float4 value = partial_values(part[u], weight);
      acc.x = fmaf(weight, value.x, acc.x);
      acc.y = fmaf(weight, value.y, acc.y);
      acc.z = fmaf(weight, value.z, acc.z);
      acc.w = fmaf(weight, value.w, acc.w);
    }
  }
  while (open_group <= last_group) close_group();  // empty merge groups add +0 in both shapes
  }
  if constexpr (kGroups > 1) {
    group_sum[group][lane] = total;
    __syncthreads();
  }
  if (group == 0) {
#pragma unroll
    for (int g = 1; g < kGroups; ++g) add_float4(total, group_sum[g][lane]);
    *out = make_uint2(pack_bf16x2(total.x, total.y), pack_bf16x2(total.z, total.w));
    if (blockIdx.y == 0 && threadIdx.x == 0) p.lse[row] = lse;
  }
}

// The warp shape, for plans of at most kMergeGroups splits (so every merge group holds at most one
// split): one warp per (token, head) row, kWarps rows a block, no shared memory and no block barrier.
// It adds in the order of combine_splits_kernel's few-splits path and reduces the splits' lse values
// as its block_reduce does (lane s holds split s; the block's other warps would add +0), so the bits
// are the same. A lane holds the 4 columns from 4 (lane + 32 j) of every split, all loads in flight before
// the lse reduction.
template <int kDv, int kWarps, int kMaxSplits>
__global__ void __launch_bounds__(32 * kWarps) combine_rows_by_warp_kernel(const __grid_constant__ CombineParams p) {
  static_assert(kMaxSplits <= kMergeGroups && kMaxSplits <= 32, "one split per merge group and per lane");
  static_assert(kDv % 128 == 0, "a warp covers a row in whole float4 runs");
  constexpr int kRuns = kDv / 128;  // runs of 4 columns per lane
  static_assert(kMaxSplits * kRuns <= 32, "a lane's partial loads (2 registers each) stay in flight in its registers");
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;  // token * H + head
  if (row >= p.num_tokens * p.num_heads) return;  // whole warps
  const int64_t token = row / p.num_heads;
  const int head = static_cast<int>(row % p.num_heads);
  uint2* const out = reinterpret_cast<uint2*>(p.out + row * kDv);
  // Padding rows first, before waiting for the split kernel (as combine_splits_kernel).
  if (token >= valid_token_count(p.valid_tokens, p.num_tokens)) {
#pragma unroll
    for (int j = 0; j < kRuns; ++j) out[lane + 32 * j] = make_uint2(0, 0);
    if (lane == 0) p.lse[row] = -INFINITY;
    return;
  }
  wait_for_prerequisite_grid();

  uint2 part[kMaxSplits][kRuns];
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) {
    const uint16_t* const partial =
        p.workspace.partial_out + SplitWorkspace::row(s, token, head, p.num_tokens, p.num_heads) * kDv;
#pragma unroll
    for (int j = 0; j < kRuns; ++j) {
      part[s][j] = s < p.num_splits ? load_partial4(partial + 4 * (lane + 32 * j)) : make_uint2(0u, 0u);
    }
  }
  const float split_lse = lane < p.num_splits
                              ? p.workspace.partial_lse[SplitWorkspace::row(lane, token, head, p.num_tokens, p.num_heads)]
                              : -INFINITY;
  const float max_lse = warp_max(split_lse);
  const float sum = warp_sum((max_lse != -INFINITY && lane < p.num_splits) ? expf(split_lse - max_lse) : 0.0f);
  const float splits_lse = max_lse == -INFINITY ? -INFINITY : max_lse + logf(sum);
  const float lse = lse_with_sink(splits_lse, p.attn_sink != nullptr ? p.attn_sink[head] : -INFINITY);
  const float own_weight = state_weight(split_lse, lse);

  float4 total[kRuns];
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) {
    const float weight = __shfl_sync(0xffffffffu, own_weight, s);
    if (s >= p.num_splits) break;
#pragma unroll
    for (int j = 0; j < kRuns; ++j) {
      const float4 value = partial_values(part[s][j], weight);
      const float4 group_total = make_float4(fmaf(weight, value.x, 0.0f), fmaf(weight, value.y, 0.0f),
                                             fmaf(weight, value.z, 0.0f), fmaf(weight, value.w, 0.0f));
      if (s == 0) {
        total[j] = group_total;
      } else {
        add_float4(total[j], group_total);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kRuns; ++j) {
    for (int g = p.num_splits; g < kMergeGroups; ++g) add_float4(total[j], make_float4(0.0f, 0.0f, 0.0f, 0.0f));
    out[lane + 32 * j] = make_uint2(pack_bf16x2(total[j].x, total[j].y), pack_bf16x2(total[j].z, total[j].w));
  }
  if (lane == 0) p.lse[row] = lse;
}

}  // namespace jsmla::cuda
