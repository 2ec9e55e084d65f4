// The reference C++ kernel: full sparse-MLA semantics on the CPU, multi-threaded over (token, head
// block) work items. Simple by design; it shares addressing and masking with the CUDA kernels.
#pragma once

#include "../common/params.h"

namespace jsmla {

// Dequantizes the K row of `slot` (a valid slot of `cache`) into `out[0, f.d_qk)` as float.
void dequantize_row(const FormatTraits& f, const CacheView& cache, int64_t slot, float* out);

// Computes out/lse for every row of `p`. `num_threads` <= 0 picks the hardware concurrency.
void sparse_mla_cpu(const FormatTraits& f, const AttentionParams& p, int num_threads);

}  // namespace jsmla
