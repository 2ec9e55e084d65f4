// The C++ CPU backward kernel: the vector-Jacobian product of sparse MLA attention (gradients of q, of a
// bf16 main cache and of the sinks), recomputed from the forward's lse, multi-threaded, with results
// bitwise independent of the thread count.
#pragma once

#include "../common/backward_params.h"

namespace jsmla {

// Writes every wanted gradient of `p` (docs/semantics.md, differentiation). `num_threads` <= 0 picks the
// hardware concurrency.
void sparse_mla_cpu_backward(const FormatTraits& f, const BackwardParams& p, int num_threads);

}  // namespace jsmla
