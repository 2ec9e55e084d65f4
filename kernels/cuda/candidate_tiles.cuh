// Which candidate positions a block visits and how its loader threads read them: shared by every
// CUDA kernel family (the portable mma.sync kernels and the Hopper wgmma kernels).
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/params.h"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/launch_params.h"

namespace jsmla::cuda {

// The candidate positions one block visits: split ∩ ([0, main_len) ∪ [main_topk, main_topk + extra_len)),
// cut into tiles that never straddle the main/extra boundary. Positions past a row's length are never
// visited; masked positions inside the range are zero-filled and get -inf scores.
template <int kCandidateTile>
struct CandidateTiles {
  int32_t first_begin, first_end, second_begin, second_end;
  int32_t first_count, count;

  JSMLA_DEVICE CandidateTiles(const AttentionParams& a, int64_t token, int64_t split_begin, int64_t split_end) {
    const int64_t main_topk = a.main.topk;
    const int64_t main_length = a.main.row_length(token);
    const int64_t extra_length = a.extra.topk > 0 ? a.extra.row_length(token) : 0;
    first_begin = static_cast<int32_t>(split_begin);
    first_end = static_cast<int32_t>(max(split_begin, min(split_end, main_length)));
    second_begin = static_cast<int32_t>(max(split_begin, main_topk));
    second_end = static_cast<int32_t>(max(static_cast<int64_t>(second_begin), min(split_end, main_topk + extra_length)));
    first_count = (first_end - first_begin + kCandidateTile - 1) / kCandidateTile;
    count = first_count + (second_end - second_begin + kCandidateTile - 1) / kCandidateTile;
  }
  JSMLA_DEVICE int32_t begin(int tile) const {
    return tile < first_count ? first_begin + tile * kCandidateTile : second_begin + (tile - first_count) * kCandidateTile;
  }
  JSMLA_DEVICE int32_t end(int tile) const {
    return tile < first_count ? min(begin(tile) + kCandidateTile, first_end) : min(begin(tile) + kCandidateTile, second_end);
  }
};

// The candidate one loader thread gathers for a tile row: its list and raw index, read early so that
// the index load is in flight across the MMAs of the current tile.
struct PendingRow {
  bool in_range = false;  // false: past the end of the tile or of the block's range
  bool in_extra = false;  // which list the position belongs to
  int32_t index = -1;
};

// Reads the index of row `row` of tile `tile_index` (nothing when the tile or row is out of range).
// kDualCache: the format may carry an extra cache (FormatTraits::dual_cache); without one, positions
// past the main list are out of range and every access below is to `a.main` (no run-time choice of
// parameters).
template <bool kDualCache, int kCandidateTile>
JSMLA_DEVICE PendingRow read_pending_row(const AttentionParams& a, const CandidateTiles<kCandidateTile>& tiles,
                                         int64_t token, int tile_index, int row) {
  PendingRow pending;
  if (tile_index < tiles.count) {
    const int32_t position = tiles.begin(tile_index) + row;
    if (position < tiles.end(tile_index) && (kDualCache || position < a.main.topk)) {
      pending.in_range = true;
      pending.in_extra = kDualCache && position >= a.main.topk;
      const CandidateList& list = pending.in_extra ? a.extra : a.main;
      const int32_t j = pending.in_extra ? position - a.main.topk : position;
      pending.index = load_global_nc(list.indices + token * list.topk + j);
    }
  }
  return pending;
}

// The cache a pending row gathers from, and whether its slot is valid (a masked row is never read).
template <bool kDualCache>
JSMLA_DEVICE const CacheView& pending_cache(const AttentionParams& a, const PendingRow& row) {
  if constexpr (kDualCache) return row.in_extra ? a.extra.cache : a.main.cache;
  return a.main.cache;
}
template <bool kDualCache>
JSMLA_DEVICE bool pending_valid(const AttentionParams& a, const PendingRow& row) {
  return row.in_range && pending_cache<kDualCache>(a, row).contains(row.index);
}

// The (token, head tile, split) of a block; blocks are split-major within a head tile, token-major overall.
struct BlockCoordinates {
  int split;
  int head_tile;
  int64_t token;
  JSMLA_DEVICE explicit BlockCoordinates(const SplitKvParams& p) : BlockCoordinates(p, blockIdx.x) {}
  // Of the block's cluster `block` (the lane-sliced Hopper tile: the blocks of a cluster share them).
  JSMLA_DEVICE BlockCoordinates(const SplitKvParams& p, int64_t block) {
    // A block index is below 2^31 (the grid's x dimension), so 32-bit unsigned divisions give the same
    // values as the 64-bit ones, in a few instructions each rather than a 64-bit division routine.
    const uint32_t index = static_cast<uint32_t>(block);
    const uint32_t splits = static_cast<uint32_t>(p.num_splits);
    const uint32_t head_tiles = static_cast<uint32_t>(p.num_head_tiles);
    const uint32_t split_major = index / splits;
    split = static_cast<int>(index - split_major * splits);
    head_tile = static_cast<int>(split_major % head_tiles);
    token = static_cast<int64_t>(split_major / head_tiles);
  }
};

// The candidate tiles of a block's split: positions [split * split_size, (split + 1) * split_size) of
// the token's main-then-extra list, cut at the list's end.
template <int kCandidateTile>
JSMLA_DEVICE CandidateTiles<kCandidateTile> split_tiles(const SplitKvParams& p, const BlockCoordinates& block) {
  const int64_t total_positions = static_cast<int64_t>(p.attn.main.topk) + p.attn.extra.topk;
  const int64_t split_begin = static_cast<int64_t>(block.split) * p.split_size;
  const int64_t split_end = min(split_begin + p.split_size, total_positions);
  return CandidateTiles<kCandidateTile>(p.attn, block.token, min(split_begin, split_end), split_end);
}

// A row's index read before the block knows its tiles: at the position tile `tile_index` of the block's
// split holds row `row` when the row's main-list length reaches it. The indices array holds every
// position below main.topk of every token, so the read is in bounds whatever the lengths and the
// valid-token count turn out to be; its value is used only where pending_row_from confirms the position.
struct EarlyIndex {
  int32_t position = -1;  // -1: nothing read (the position is past the main list)
  int32_t index = -1;
};

template <int kCandidateTile>
JSMLA_DEVICE EarlyIndex read_early_index(const SplitKvParams& p, const BlockCoordinates& block, int tile_index, int row) {
  EarlyIndex early;
  const int64_t position =
      static_cast<int64_t>(block.split) * p.split_size + static_cast<int64_t>(tile_index) * kCandidateTile + row;
  if (position < p.attn.main.topk) {
    early.position = static_cast<int32_t>(position);
    early.index = load_global_nc(p.attn.main.indices + block.token * p.attn.main.topk + position);
  }
  return early;
}

// The early reads of loader row `row` of the first two tiles (the tiles the producers gather first).
template <int kCandidateTile>
JSMLA_DEVICE void read_first_indices(const SplitKvParams& p, const BlockCoordinates& block, int row,
                                     EarlyIndex (&early)[2]) {
  early[0] = read_early_index<kCandidateTile>(p, block, 0, row);
  early[1] = read_early_index<kCandidateTile>(p, block, 1, row);
}

// read_pending_row, taking the early read's index where the tile holds the row at the position it was
// read for (a tile of the main list: positions split_begin + tile_index * kCandidateTile + row), and
// reading the index now otherwise.
template <bool kDualCache, int kCandidateTile>
JSMLA_DEVICE PendingRow pending_row_from(const AttentionParams& a, const CandidateTiles<kCandidateTile>& tiles,
                                         int64_t token, int tile_index, int row, const EarlyIndex& early) {
  if (tile_index < tiles.first_count && early.position >= 0 && early.position == tiles.begin(tile_index) + row) {
    PendingRow pending;
    pending.in_range = early.position < tiles.end(tile_index);
    if (pending.in_range) pending.index = early.index;
    return pending;
  }
  return read_pending_row<kDualCache>(a, tiles, token, tile_index, row);
}

// A padding row (token >= valid_tokens): decode leaves it to the combine kernel; prefill writes the
// empty state (zero output, lse = -inf) for the block's heads. All threads of the block call it.
template <int kDv>
JSMLA_DEVICE void write_padding_rows(const SplitKvParams& p, int64_t token, int head_begin, int head_tile_size,
                                     int thread, int thread_count) {
  if (p.workspace.partial_out != nullptr) return;
  const AttentionParams& a = p.attn;
  const int heads = min(head_tile_size, a.num_heads - head_begin);
  uint4* out = reinterpret_cast<uint4*>(a.out + (token * a.num_heads + head_begin) * kDv);
  for (int i = thread; i < heads * kDv / 8; i += thread_count) out[i] = make_uint4(0, 0, 0, 0);
  for (int h = thread; h < heads; h += thread_count) a.lse[token * a.num_heads + head_begin + h] = -INFINITY;
}

}  // namespace jsmla::cuda
