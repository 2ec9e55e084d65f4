// Dequantization of one cache row into float lanes on the host: the K row of a slot as docs/formats.md
// defines it (V is its first d_v lanes).
#pragma once

#include <cstdint>

#include "cache_view.h"
#include "numeric.h"

namespace jsmla {

// Writes the K row of `slot` (a valid slot of `cache`) to `out[0, f.d_qk)`.
inline void dequantize_key_row(const FormatTraits& f, const CacheView& cache, int64_t slot, float* out) {
  const uint8_t* row = cache.data_row(slot);
  if (f.quant_dim > 0) {
    const uint8_t* scales = cache.scales(f, slot);
    for (int g = 0; g < f.num_groups; ++g) {
      const float scale = group_scale(f, scales, g);
      for (int i = g * f.group_size; i < (g + 1) * f.group_size; ++i) out[i] = quantized_lane(f, row, i) * scale;
    }
  }
  const uint8_t* bf16 = row + f.bf16_offset;
  for (int i = 0; i < f.bf16_dim; ++i) out[f.quant_dim + i] = bf16_to_float(load_u16_le(bf16 + 2 * i));
}

}  // namespace jsmla
