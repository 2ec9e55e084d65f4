// The CPU kernel's data layout: one token's candidate tile (dequantized once, shared by every head)
// and the jobs the per-instruction-set kernels (tile_kernels.h) run on it.
//
// Tiles hold BF16 values packed for dot products over pairs of lanes: a 32-bit word is two BF16
// values, the even element in its low half. K rows keep the row order of the cache (pairs of
// adjacent lanes); V is stored as pairs of adjacent candidates, so that S = Q·Kᵀ and O = P·V both
// reduce over pairs.
#pragma once

#include <cstdint>

#include "../common/cache_view.h"

namespace jsmla::cpu {

// Lanes of one segment: S accumulates each segment separately and adds it to the running scores
// scaled by sm_scale, times the segment's FP32 group scale where the format has FP32 scales: those
// formats keep the exact FP8 codes in K, so scores use their scales at full precision.
inline constexpr int kSegmentLanes = 128;
// Candidate rows of a tile are padded to a multiple of this (the register blocks of every
// instruction set divide it).
inline constexpr int kRowGranule = 16;
// The widest head block a job covers (four 16-lane vectors).
inline constexpr int kMaxHeadBlock = 64;

// FP32 group scales multiply the partial dot product of their segment, so a group must be a segment;
// every other scale kind gives exact BF16 values with the quantized lanes (UE8M0 is a power of two;
// an FP4 value times an E4M3 scale has at most 6 significant bits), folded into the tile.
constexpr bool segment_scales_fit(const FormatTraits& f) {
  return f.scale_kind != ScaleKind::kFp32 || (f.group_size == kSegmentLanes && f.quant_bits == 8);
}

// Dequantization converts 32 lanes at a time, each half (16 lanes) within one scale group, and one
// of the quantized or BF16 lanes.
constexpr bool lanes_fit_conversion_chunks(const FormatTraits& f) {
  return f.d_qk % 32 == 0 && f.d_v % 32 == 0 && f.quant_dim % 32 == 0 && (f.group_size == 0 || f.group_size % 16 == 0);
}

constexpr bool every_format_fits() {
  for (const FormatTraits& f : kFormatTable) {
    if (!segment_scales_fit(f) || !lanes_fit_conversion_chunks(f)) return false;
  }
  return true;
}
static_assert(every_format_fits(), "FP32 scale groups must be score segments (their scale multiplies one segment) and "
              "every format's lanes must split into the conversion chunks of dequantization");

inline int num_segments(const FormatTraits& f) { return (f.d_qk + kSegmentLanes - 1) / kSegmentLanes; }

// Candidates per softmax tile: fixed per format (never by thread count, batch or instruction set), so
// every row's reduction order is fixed. Wide formats take half a tile so that a head block's queries,
// scores, probabilities, output accumulator and tile stay in a core's L2.
inline int candidates_per_tile(const FormatTraits& f) { return f.d_qk > 576 ? 64 : 128; }

// A candidate after compaction: a slot of the main (list 0) or extra (list 1) cache. The two lists may
// have different formats of the same widths (dual-cache formats, none with FP32 scales).
struct CandidateRef {
  int32_t slot;
  int32_t list;
};

// One token's dequantized candidates, padded with zero rows to `padded_rows` (a multiple of
// kRowGranule).
struct TokenTile {
  uint32_t* k_pairs = nullptr;  // [padded_rows][d_qk / 2]: row c holds K(c) (FP32-scale formats: the codes)
  uint32_t* v_pairs = nullptr;  // [padded_rows / 2][d_v]: word (i, d) = (V(2i)[d], V(2i+1)[d]) (values)
  float* scales = nullptr;      // FP32-scale formats: [padded_rows][num_segments] (1 past the FP8 lanes)
  int64_t padded_rows = 0;
};

// Dequantizes candidates [begin, end) of a token (begin even; end <= padded_rows, even) into `tile`;
// positions at or past `count` become zero rows.
struct DequantizeJob {
  const FormatTraits* format = nullptr;              // the main cache's format (the tile's layout)
  const FormatTraits* formats[2] = {nullptr, nullptr};  // main, extra: each list's format
  const CacheView* caches[2] = {nullptr, nullptr};      // main, extra
  const CandidateRef* candidates = nullptr;          // [count]
  int64_t count = 0;
  int64_t begin = 0;
  int64_t end = 0;
  float sm_scale = 1.0f;
  TokenTile tile;
};

// Attention of one head block of one token, one candidate tile at a time: `start` resets the
// unnormalised state (running max, running sum of exp(s - max), output accumulator) of `head_block`
// heads, `add_tile` folds in candidates [0, rows) of the tile at k_pairs/v_pairs/scales (rows <=
// candidates_per_tile; k_pairs, v_pairs and scales point at the tile's first row, laid out as in
// TokenTile, with zero rows up to the next multiple of kRowGranule).
struct AttendJob {
  const FormatTraits* format = nullptr;
  const uint32_t* q_pairs = nullptr;  // [d_qk / 2][head_block]: word (p, h) = (q[h][2p], q[h][2p+1])
  int head_block = 16;                // 16, 32 or 64 heads (lanes past the real heads hold zero queries)
  float sm_scale = 1.0f;
  const uint32_t* k_pairs = nullptr;
  const uint32_t* v_pairs = nullptr;
  const float* scales = nullptr;
  int64_t rows = 0;
  float* scores = nullptr;            // scratch [candidates_per_tile][head_block]
  uint32_t* probabilities = nullptr;  // scratch [candidates_per_tile / 2][head_block]
  float* alpha = nullptr;             // scratch [head_block]
  float* row_max = nullptr;           // state [head_block]: max of the scaled scores
  float* row_sum = nullptr;           // state [head_block]: sum of exp(s - row_max)
  float* output = nullptr;            // state [d_v][head_block]: sum of exp(s - row_max) * V
};

// One instruction set's kernels.
struct TileKernels {
  void (*dequantize)(const DequantizeJob& job);
  void (*start)(const AttendJob& job);
  void (*add_tile)(const AttendJob& job, bool first_tile);
};

}  // namespace jsmla::cpu
