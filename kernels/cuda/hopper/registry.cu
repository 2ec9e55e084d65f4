#include "kernels/cuda/hopper/registry.h"

#include <iterator>

#include "kernels/cuda/hopper/config.cuh"
#include "kernels/cuda/hopper/launch.h"

namespace jsmla::cuda::hopper {
namespace {

template <FormatId kFormat>
constexpr KernelInfo info() {
  using Cfg = HopperConfig<kFormat>;
  return {kFormat, Cfg::kHeadTile, Cfg::kThreads, Cfg::kCandidateTile, Cfg::kSharedBytes,
          &launch_sparse_mla_hopper<Cfg>};
}

// One entry per file under instances/.
const KernelInfo kKernels[] = {
    info<FormatId::kDsv32>(), info<FormatId::kDsv4>(),     info<FormatId::kDsv41>(),
    info<FormatId::kBf16_576>(), info<FormatId::kBf16_512>(),
};

}  // namespace

const KernelInfo* kernels_begin() { return std::begin(kKernels); }
const KernelInfo* kernels_end() { return std::end(kKernels); }

const KernelInfo* find_kernel(FormatId format, int heads_per_block) {
  return find_kernel_in(kernels_begin(), kernels_end(), format, heads_per_block);
}

bool compiled() {
#if defined(JSMLA_HOPPER_SM90A)
  return true;
#else
  return false;
#endif
}

}  // namespace jsmla::cuda::hopper
