// The kernel tables of both CUDA families as host constexpr data (no CUDA headers): every instance of
// kernel_list.h with its launch shape, the split granule, the architectures, the workspace size and the
// choice of family for a plan. The CUDA handler and registry use it; so does the always-built CPU
// extension, which hands it to the planner (jax_sparse_mla/kernel_tables.py) — planning for CUDA needs
// no GPU, and no table is typed twice.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernels/common/formats.h"
#include "kernels/cuda/hopper/config.h"
#include "kernels/cuda/kernel_list.h"
#include "kernels/cuda/portable/config.h"
#include "kernels/cuda/split_workspace.h"

namespace jsmla::cuda {

enum class Family : int32_t { kPortable = 0, kHopper = 1 };

// One instance as the planner and the handler see it.
struct KernelShape {
  Family family;
  FormatId format;
  int32_t heads_per_block;
  int32_t threads;
  int32_t candidate_tile;
  int32_t shared_bytes;  // dynamic shared memory per block
  int32_t min_split_size;  // the shortest split the family takes this instance for (choose_family)
  int32_t cluster_blocks;  // blocks per (token, head tile, split): 2 for the lane-sliced Hopper tile
};

template <class Cfg>
constexpr KernelShape shape_of(Family family) {
  return {family,           Cfg::kF.id,        Cfg::kHeadTile,         Cfg::kThreads, Cfg::kCandidateTile,
          Cfg::kSharedBytes, Cfg::kMinSplitSize, Cfg::kLaneSlices};
}

#define JSMLA_PORTABLE_SHAPE(format, heads) shape_of<portable::PortableConfig<FormatId::format, heads>>(Family::kPortable),
#define JSMLA_HOPPER_SHAPE(format, heads) shape_of<hopper::HopperConfig<FormatId::format, heads>>(Family::kHopper),
inline constexpr KernelShape kKernelShapes[] = {JSMLA_PORTABLE_KERNELS(JSMLA_PORTABLE_SHAPE)
                                                    JSMLA_HOPPER_KERNELS(JSMLA_HOPPER_SHAPE)};
#undef JSMLA_PORTABLE_SHAPE
#undef JSMLA_HOPPER_SHAPE
inline constexpr int kNumKernels = sizeof(kKernelShapes) / sizeof(kKernelShapes[0]);

// Decode split sizes are positive multiples of this (every candidate tile divides it).
inline constexpr int32_t kSplitGranule = portable::kSplitGranule;

// Candidate positions a decode plan's splits must cover (num_splits * split_size at least this): the
// main list cut at the format's window (`window` > 0: positions past it are never read), or, with an
// extra list, the whole main list and the extra list (the extra list's positions start after the
// main list's full width).
constexpr int64_t decode_positions(int64_t main_topk, int32_t window, int64_t extra_topk) {
  if (extra_topk > 0 || window <= 0) return main_topk + extra_topk;
  return main_topk < window ? main_topk : window;
}

// Oldest compute capability (major * 10 + minor) with a kernel: SASS for sm_80/90a/120a, PTX for sm_80.
inline constexpr int32_t kMinComputeCapability = 80;
// The Hopper family's sm_90a code runs on compute capability 9.0 only.
inline constexpr int32_t kHopperComputeCapability = 90;

// The index of an instance in kKernelShapes, or -1.
constexpr int find_shape(Family family, FormatId format, int heads_per_block) {
  for (int i = 0; i < kNumKernels; ++i) {
    const KernelShape& k = kKernelShapes[i];
    if (k.family == family && k.format == format && k.heads_per_block == heads_per_block) return i;
  }
  return -1;
}

// A Hopper instance with no portable instance of its (format, head tile): plans take its head tile only
// where the Hopper family runs (the lane-sliced tile of dots3_swa, whose 64 heads no portable block holds).
constexpr bool hopper_only(FormatId format, int heads_per_block) {
  return find_shape(Family::kHopper, format, heads_per_block) >= 0 &&
         find_shape(Family::kPortable, format, heads_per_block) < 0;
}

constexpr bool tables_consistent() {
  for (const KernelShape& k : kKernelShapes) {
    // The handler swaps a Hopper kernel in for the portable one of a plan (same splits): its tile is
    // the twin's or a multiple of it (a split that is not whole tiles ends on a short one). A Hopper-only
    // instance takes every split (its tile divides the split granule); only it runs clusters.
    if (k.family == Family::kHopper) {
      const int twin = find_shape(Family::kPortable, k.format, k.heads_per_block);
      if (twin < 0 ? kSplitGranule % k.candidate_tile != 0 || k.min_split_size != 0
                   : k.candidate_tile % kKernelShapes[twin].candidate_tile != 0 || k.cluster_blocks != 1) {
        return false;
      }
    } else if (kSplitGranule % k.candidate_tile != 0 || k.cluster_blocks != 1) {
      return false;
    }
  }
  return true;
}
static_assert(tables_consistent(),
              "every Hopper instance needs a portable twin whose candidate tile divides its own (or, Hopper-only, "
              "a tile dividing the split granule and every split), and every portable candidate tile must divide "
              "the split granule");

// The family that runs a plan's (format, head tile, split size) on a device: the Hopper kernel when it
// exists and takes splits of that size, the device is sm_90 with enough shared memory, the build
// carries sm_90a code and JSMLA_CUDA_FAMILY does not ask for the portable family; the portable kernel
// otherwise (none for a Hopper-only head tile: the handler refuses such a plan, the planner does not
// make one). `split_size`: candidate positions per split of a decode plan (a prefill plan's one split
// covers the whole list).
constexpr Family choose_family(FormatId format, int heads_per_block, int64_t split_size, int capability,
                               int max_shared_bytes, bool hopper_compiled, bool hopper_allowed) {
  const int hopper = find_shape(Family::kHopper, format, heads_per_block);
  return hopper >= 0 && hopper_compiled && hopper_allowed && capability == kHopperComputeCapability &&
                 kKernelShapes[hopper].shared_bytes <= max_shared_bytes &&
                 split_size >= kKernelShapes[hopper].min_split_size
             ? Family::kHopper
             : Family::kPortable;
}

// JSMLA_CUDA_FAMILY=portable keeps sm_90 GPUs on the portable kernels (for comparisons); unset or
// any other value lets them run the Hopper kernels.
inline bool hopper_allowed_by_environment() {
  const char* value = std::getenv("JSMLA_CUDA_FAMILY");
  return value == nullptr || std::strcmp(value, "portable") != 0;
}

}  // namespace jsmla::cuda
