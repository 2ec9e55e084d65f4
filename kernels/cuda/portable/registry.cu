#include "kernels/cuda/portable/registry.h"

#include <iterator>

#include "kernels/cuda/portable/config.cuh"
#include "kernels/cuda/portable/launch.h"

namespace jsmla::cuda::portable {
namespace {

template <FormatId kFormat, int kWhich>
constexpr KernelInfo info() {
  using Cfg = PortableConfig<kFormat, head_tile_choice(kFormat, kWhich)>;
  return {kFormat, Cfg::kHeadTile, Cfg::kThreads, Cfg::kCandidateTile, Cfg::kSharedBytes,
          &launch_sparse_mla_portable<Cfg>};
}

template <FormatId kFormat>
constexpr KernelInfo small_tile() { return info<kFormat, 0>(); }
template <FormatId kFormat>
constexpr KernelInfo large_tile() { return info<kFormat, 1>(); }

// One entry per file under instances/.
const KernelInfo kKernels[] = {
    small_tile<FormatId::kDsv32>(),     large_tile<FormatId::kDsv32>(),
    small_tile<FormatId::kGlmNsa>(),    large_tile<FormatId::kGlmNsa>(),
    small_tile<FormatId::kGlm53Nope>(), large_tile<FormatId::kGlm53Nope>(),
    small_tile<FormatId::kDsv4>(),      large_tile<FormatId::kDsv4>(),
    small_tile<FormatId::kDsv41>(),     large_tile<FormatId::kDsv41>(),
    small_tile<FormatId::kDots3Swa>(),  large_tile<FormatId::kDots3Swa>(),
    small_tile<FormatId::kBf16_576>(),  large_tile<FormatId::kBf16_576>(),
    small_tile<FormatId::kBf16_512>(),  large_tile<FormatId::kBf16_512>(),
};
static_assert(std::size(kKernels) == kNumFormats * kNumHeadTilesPerFormat, "every format has both head tiles");

}  // namespace

const KernelInfo* kernels_begin() { return std::begin(kKernels); }
const KernelInfo* kernels_end() { return std::end(kKernels); }

const KernelInfo* find_kernel(FormatId format, int heads_per_block) {
  return find_kernel_in(kernels_begin(), kernels_end(), format, heads_per_block);
}

int split_granule() { return kSplitGranule; }

}  // namespace jsmla::cuda::portable
