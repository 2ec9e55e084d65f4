// The output side of a block, shared by both kernel families: rescaling the output accumulators when
// a running max moved, and storing a thread's two accumulator rows at the end — BF16 out and lse with
// the sink folded in (a block that covers a token's whole candidate list) or its partial state (a split
// of a decode call: BF16 partial row and FP32 lse, layout in split_workspace.h).
// Accumulators are in the m16n8 layout that mma.sync and wgmma share: acc[4j .. 4j+3] hold
// (r0, c), (r0, c + 1), (r1, c), (r1, c + 1) with c = 8j + 2 (lane % 4), where r0 = lane / 4 and
// r1 = lane / 4 + 8 are the thread's rows of a 16-row block.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/online_softmax.cuh"
#include "kernels/cuda/softmax_merge.cuh"

namespace jsmla::cuda {

// Multiplies row r of the accumulators by rescale[r].
template <int kCount>
JSMLA_DEVICE void rescale_rows(float (&acc)[kCount], const float (&rescale)[2]) {
  static_assert(kCount % 4 == 0, "accumulators come in whole m16n8 fragments");
#pragma unroll
  for (int c = 0; c < kCount; c += 4) {
    acc[c + 0] *= rescale[0];
    acc[c + 1] *= rescale[0];
    acc[c + 2] *= rescale[1];
    acc[c + 3] *= rescale[1];
  }
}

// One butterfly round of a quad's 4 x 4 word transpose (see store_row_bf16), across lane bit kMask: for
// each pair of words (j, j | kMask), the lane whose bit is set swaps its word j with its partner's word
// j | kMask. Two shuffles and six selects, every register index known at compile time.
template <int kMask>
JSMLA_DEVICE void quad_swap(uint32_t (&w)[4], bool bit, unsigned quad) {
  static_assert(kMask == 1 || kMask == 2, "a quad's lanes differ in bits 0 and 1");
  constexpr int kLo[2] = {0, kMask == 1 ? 2 : 1};  // the pairs' first words (bit kMask clear)
  uint32_t got[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) got[k] = bit ? w[kLo[k]] : w[kLo[k] | kMask];
#pragma unroll
  for (int k = 0; k < 2; ++k) got[k] = __shfl_xor_sync(quad, got[k], kMask);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    w[kLo[k]] = bit ? got[k] : w[kLo[k]];
    w[kLo[k] | kMask] = bit ? w[kLo[k] | kMask] : got[k];
  }
}

// Stores one accumulator row as BF16: `pairs[j]` is this thread's columns 8j + 2q, + 1 (q = lane % 4) of
// the row, whose fragment 0 starts at `row` (16-byte aligned). The four lanes that share the row (a
// quad; they skip rows together) transpose their pairs so that lane q holds all 8 columns of fragment
// 4g + q and stores them as one 16-byte run: each 32-byte sector of the row is then written whole by
// one instruction, not in 4-byte pieces by four (which measured 1.1-1.2x slower for the split kernel's
// partial rows at T = 1).
template <int kFragments>
JSMLA_DEVICE void store_row_bf16(uint16_t* row, const uint32_t (&pairs)[kFragments], int lane) {
  static_assert(kFragments % 4 == 0, "fragments are transposed four at a time");
  const int q = lane % 4;
  const unsigned quad = 0xfu << (lane & ~3);
  // Two butterfly rounds, every register index a constant: the 2 x 2 blocks of words across lane bit 1,
  // then the words within each block across lane bit 0.
#pragma unroll
  for (int g = 0; g < kFragments / 4; ++g) {
    // w[j]: lane q's column pair of fragment 4g + j; after the rounds, lane j's pair of fragment 4g + q
    uint32_t w[4] = {pairs[4 * g], pairs[4 * g + 1], pairs[4 * g + 2], pairs[4 * g + 3]};
    quad_swap<2>(w, (q & 2) != 0, quad);
    quad_swap<1>(w, (q & 1) != 0, quad);
    *reinterpret_cast<uint4*>(row + 8 * (4 * g + q)) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Stores the thread's rows (query heads `heads[0]`, `heads[1]`; heads past H are skipped) of output
// columns column_first + 8j, + 1 for every fragment j of `acc` (column_first = 2 (lane % 4) plus a
// multiple of 8), normalised by the softmax.
// `writes_lse`: this thread stores the rows' lse (one thread per row among those sharing it).
template <int kDv, int kCount>
JSMLA_DEVICE void store_rows(const SplitKvParams& p, int64_t token, int split, const int (&heads)[2], int column_first,
                             bool writes_lse, const RunningSoftmax& softmax, const float (&acc)[kCount]) {
  static_assert(kCount % 4 == 0, "accumulators come in whole m16n8 fragments");
  const int lane = threadIdx.x % 32;
  const int block_first = column_first - 2 * (lane % 4);  // fragment 0's first column
  const AttentionParams& a = p.attn;
  const bool write_final = p.workspace.partial_out == nullptr;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int head = heads[r];
    if (head >= a.num_heads) continue;
    const RowFinish finish = finish_row(softmax.row_max[r], softmax.row_sum[r], write_final, a.attn_sink, head);
    uint32_t pairs[kCount / 4];
#pragma unroll
    for (int j = 0; j < kCount / 4; ++j) {
      pairs[j] = pack_bf16x2(acc[4 * j + 2 * r] * finish.factor, acc[4 * j + 2 * r + 1] * finish.factor);
    }
    if (write_final) {
      store_row_bf16(a.out + (token * a.num_heads + head) * kDv + block_first, pairs, lane);
      if (writes_lse) a.lse[token * a.num_heads + head] = finish.lse;
    } else {
      const int64_t row = SplitWorkspace::row(split, token, head, a.num_tokens, a.num_heads);
      store_row_bf16(p.workspace.partial_out + row * kDv + block_first, pairs, lane);
      if (writes_lse) p.workspace.partial_lse[row] = finish.lse;
    }
  }
}

}  // namespace jsmla::cuda
