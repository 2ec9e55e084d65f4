// The table of launchable kernels (see registry.h): one entry per kernel_list.h instance.
#include "kernels/cuda/registry.h"

#include "kernels/cuda/launch.h"

namespace jsmla::cuda {
namespace {

#define JSMLA_PORTABLE_ENTRY(format, heads)                                              \
  {shape_of<portable::PortableConfig<FormatId::format, heads>>(Family::kPortable),       \
   &portable::launch_sparse_mla_portable<portable::PortableConfig<FormatId::format, heads>>},
#define JSMLA_HOPPER_ENTRY(format, heads)                                          \
  {shape_of<hopper::HopperConfig<FormatId::format, heads>>(Family::kHopper),       \
   &hopper::launch_sparse_mla_hopper<hopper::HopperConfig<FormatId::format, heads>>},
// In kernel_list.h order, so entry i has the shape kKernelShapes[i].
const KernelInfo kKernels[] = {JSMLA_PORTABLE_KERNELS(JSMLA_PORTABLE_ENTRY) JSMLA_HOPPER_KERNELS(JSMLA_HOPPER_ENTRY)};
#undef JSMLA_PORTABLE_ENTRY
#undef JSMLA_HOPPER_ENTRY
static_assert(sizeof(kKernels) / sizeof(kKernels[0]) == kNumKernels, "one launchable entry per kernel shape");

}  // namespace

const KernelInfo* find_kernel(Family family, FormatId format, int heads_per_block) {
  const int i = find_shape(family, format, heads_per_block);
  return i < 0 ? nullptr : &kKernels[i];
}

bool hopper_compiled() {
#if defined(JSMLA_HOPPER_SM90A)
  return true;
#else
  return false;
#endif
}

}  // namespace jsmla::cuda
