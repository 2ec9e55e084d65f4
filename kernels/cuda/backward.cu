// The CUDA backward kernels (declarations and contract: backward.h) and their dispatch. The gradient of q
// of the formats backward/mma_launch.h lists comes from the tensor-core kernel (backward/mma_kernel.cuh)
// after a row-terms pass (one warp per (token, head): D = <dO, out> and the sink term); the other
// formats' (glm_*, dots3_swa) from the SIMT row kernel below, which recomputes D by a first sweep. The
// rest is SIMT code, one warp per (token, head) or per cache row.
//
// SIMT row kernel, block = (token, kHeadsPerBlock heads), a warp per head, the candidates in the forward's
// order (main list, then extra), dequantized kChunk rows at a time into shared memory as FP32:
//   sweep 1: s_j = sm_scale <q, K_j>, P_j = exp(s_j - lse), dP_j = <dO, V_j>, D = Σ_j P_j dP_j
//   sweep 2: the same P_j, dP_j again; c_j = sm_scale P_j (dP_j - D + dl); d_q = Σ_j c_j K_j
// and the row's sink term exp(sink - lse)(dl - D) into the workspace. Every dot product is a lane-strided
// partial sum reduced by one fixed butterfly; every sum over j runs in candidate order: the same inputs
// give the same bits. Sink kernel: one thread per (gradient group, head) adds the group's rows' terms in
// token order. A padding row (t >= valid_tokens) and a row whose lse is -inf give a zero d_q and no sink
// term; a row whose lse is +inf (an infinite sink holds all the weight) gives a zero d_q and the term dl.
//
// The gradient of a bf16 main cache (pass 2, as the CPU kernel's): every candidate position p = t·topk + j
// gets the key (gradient group, slot), or none when masked or a padding row's; a stable radix sort of the
// positions by key lists each output row's pairs in (t, j) order; one warp per output row recomputes
// each pair's P_j and c_j from the row's D and adds c_j·q + P_j·dO over the heads in that order. An output
// row no valid candidate references is written as zeros.
#include "kernels/cuda/backward.h"

#include <cub/device/device_radix_sort.cuh>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/common/cache_view.h"
#include "kernels/common/numeric.h"
#include "kernels/common/params.h"
#include "kernels/cuda/backward/mma_config.h"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/kernel_list.h"
#include "kernels/cuda/kernel_table.h"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/registry.h"

namespace jsmla::cuda {
namespace {

constexpr int kHeadsPerBlock = 4;                 // one warp each
constexpr int kThreads = 32 * kHeadsPerBlock;
constexpr int kChunk = 8;                         // candidate rows dequantized per step
constexpr int kMaxDqk = 1088;                     // the widest format (dots3_swa)
constexpr int kLanesPerThread = kMaxDqk / 32;     // q, d_q lanes a thread keeps in registers
constexpr int kSinkThreads = 128;

static_assert(kMaxDqk % 32 == 0, "a warp's lanes stride d_qk evenly at the widest format");

constexpr uint64_t kNoKey = ~uint64_t{0};           // a masked position's sort key (sorts last)
constexpr int kRowWarps = 4;                          // output rows per block of the cache gradient

struct BackwardLaunch {
  BackwardParams p;
  FormatTraits main_format;
  FormatTraits extra_format;
  double* sink_terms;  // [T, H] (workspace)
  double* d_rows;      // [T, H] (workspace): D, for the cache gradient
};

// The cache gradient's part of the workspace (backward_workspace.h).
struct CacheGradientLaunch {
  BackwardParams p;
  FormatTraits format;
  const double* d_rows;     // [T, H]
  uint64_t* keys;           // [n]
  int32_t* pairs;           // [n]
  const uint64_t* sorted_keys;
  const int32_t* sorted_pairs;
  int32_t* row_first;       // [G * slots]
  int32_t* row_last;        // [G * slots]
  int64_t num_slots;
  int64_t positions;        // n = T * topk
};

// K lane d of a (valid) slot of `cache` in format `f`, as docs/formats.md defines it.
__device__ float key_lane(const FormatTraits& f, const CacheView& cache, int64_t slot, int d) {
  const uint8_t* row = cache.data_row(slot);
  if (d < f.quant_dim) return quantized_lane(f, row, d) * group_scale(f, cache.scales(f, slot), d / f.group_size);
  return bf16_to_float(load_u16_le(row + f.bf16_offset + 2 * (d - f.quant_dim)));
}

__device__ float attention_weight(float score, float lse) {
  return static_cast<float>(exp(static_cast<double>(score) - static_cast<double>(lse)));
}

// Position `position` of token t's main-then-extra candidate list: its slot, or -1 (masked).
__device__ int64_t candidate_slot(const AttentionParams& a, int64_t t, int32_t main_length, int32_t position) {
  if (position < main_length) return a.main.slot(t, position);
  return a.extra.slot(t, position - main_length);
}

// Row (t, h)'s term of d_attn_sink[h]: exp(sink - lse)(dl - D) for a row with weight on candidates; dl
// for a (non-padding) row whose lse is +inf (an infinite sink holds all the weight); 0 otherwise.
__device__ double sink_term(const AttentionParams& a, int h, bool padding, bool active, float lse, float d_lse,
                            double d_row) {
  if (!padding && lse == INFINITY) return d_lse;
  if (active && a.attn_sink != nullptr && a.attn_sink[h] > -INFINITY) {
    return exp(static_cast<double>(a.attn_sink[h]) - lse) * (d_lse - d_row);
  }
  return 0.0;
}

__global__ void __launch_bounds__(kThreads) backward_rows_kernel(const __grid_constant__ BackwardLaunch launch) {
  const BackwardParams& p = launch.p;
  const AttentionParams& a = p.forward;
  __shared__ float keys[kChunk][kMaxDqk];
  __shared__ int64_t slots[kChunk];
  __shared__ int32_t from_extra[kChunk];

  const int head_blocks = (a.num_heads + kHeadsPerBlock - 1) / kHeadsPerBlock;
  const int64_t t = blockIdx.x / head_blocks;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int h = static_cast<int>(blockIdx.x % head_blocks) * kHeadsPerBlock + warp;
  const bool head_exists = h < a.num_heads;
  const int64_t row = t * a.num_heads + h;
  const FormatTraits& f = launch.main_format;
  const int d_qk = f.d_qk;
  const int d_v = f.d_v;
  const int64_t valid_rows = valid_token_count(a.valid_tokens, a.num_tokens);

  const float lse = head_exists ? p.lse[row] : -INFINITY;
  const bool padding = t >= valid_rows;
  const bool active = head_exists && !padding && isfinite(lse);  // weight on candidates
  const float d_lse = head_exists && p.d_lse != nullptr ? p.d_lse[row] : 0.0f;

  float q[kLanesPerThread];
  float d_out[kLanesPerThread];
  float d_q[kLanesPerThread];
#pragma unroll
  for (int i = 0; i < kLanesPerThread; ++i) {
    const int d = lane + 32 * i;
    q[i] = active && d < d_qk ? bf16_to_float(a.q[row * d_qk + d]) : 0.0f;
    d_out[i] = active && d < d_v && p.d_out != nullptr ? bf16_to_float(p.d_out[row * d_v + d]) : 0.0f;
    d_q[i] = 0.0f;
  }

  // The block's candidate positions (the same for its heads): none for a padding row.
  const int32_t main_length = padding ? 0 : a.main.row_length(t);
  const int32_t extra_length = padding || a.extra.topk == 0 ? 0 : a.extra.row_length(t);
  const int32_t positions = main_length + extra_length;
  const bool any_active = __syncthreads_or(active);

  double d_row = 0.0;  // D
  for (int sweep = 0; sweep < 2 && any_active; ++sweep) {
    for (int32_t first = 0; first < positions; first += kChunk) {
      __syncthreads();  // the previous chunk's rows are no longer read
      if (threadIdx.x < kChunk) {
        const int32_t position = first + threadIdx.x;
        slots[threadIdx.x] = position < positions ? candidate_slot(a, t, main_length, position) : -1;
        from_extra[threadIdx.x] = position >= main_length;
      }
      __syncthreads();
      for (int i = threadIdx.x; i < kChunk * d_qk; i += kThreads) {
        const int r = i / d_qk;
        const int d = i % d_qk;
        const int64_t slot = slots[r];
        if (slot >= 0) {  // a masked candidate's bytes are never read
          keys[r][d] = from_extra[r] ? key_lane(launch.extra_format, a.extra.cache, slot, d)
                                     : key_lane(f, a.main.cache, slot, d);
        }
      }
      __syncthreads();
      if (!active) continue;
      for (int r = 0; r < kChunk; ++r) {
        if (slots[r] < 0) continue;  // masked, or past the list
        float score_part = 0.0f, d_weight_part = 0.0f;
#pragma unroll
        for (int i = 0; i < kLanesPerThread; ++i) {
          const int d = lane + 32 * i;
          if (d < d_qk) score_part += q[i] * keys[r][d];
          if (d < d_v) d_weight_part += d_out[i] * keys[r][d];
        }
        const float weight = attention_weight(a.sm_scale * warp_sum(score_part), lse);
        const float d_weight = warp_sum(d_weight_part);
        if (sweep == 0) {
          d_row += static_cast<double>(weight) * d_weight;
        } else {
          const float coefficient =
              a.sm_scale * static_cast<float>(weight * (static_cast<double>(d_weight) - d_row + d_lse));
#pragma unroll
          for (int i = 0; i < kLanesPerThread; ++i) {
            const int d = lane + 32 * i;
            if (d < d_qk) d_q[i] += coefficient * keys[r][d];
          }
        }
      }
    }
  }

  if (!head_exists) return;
  if (p.d_q != nullptr) {
#pragma unroll
    for (int i = 0; i < kLanesPerThread; ++i) {
      const int d = lane + 32 * i;
      if (d < d_qk) p.d_q[row * d_qk + d] = float_to_bf16(d_q[i]);  // zero for every inactive row
    }
  }
  if (launch.d_rows != nullptr && lane == 0) launch.d_rows[row] = d_row;  // D (0 for an inactive row)
  if (launch.sink_terms != nullptr && lane == 0) launch.sink_terms[row] = sink_term(a, h, padding, active, lse, d_lse, d_row);
}

// The tensor-core path's first pass, one warp per (token, head) row: D = <dO, out> (0 for a row without
// weight on candidates) into d_rows and the row's sink term, as the SIMT row kernel gives them.
__global__ void __launch_bounds__(kThreads) backward_row_terms_kernel(const __grid_constant__ BackwardLaunch launch) {
  const BackwardParams& p = launch.p;
  const AttentionParams& a = p.forward;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kHeadsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.num_tokens * a.num_heads) return;
  const int64_t t = row / a.num_heads;
  const int h = static_cast<int>(row % a.num_heads);
  const int d_v = launch.main_format.d_v;
  const int64_t valid_rows = valid_token_count(a.valid_tokens, a.num_tokens);
  const float lse = p.lse[row];
  const bool padding = t >= valid_rows;
  const bool active = !padding && isfinite(lse);
  const float d_lse = p.d_lse != nullptr ? p.d_lse[row] : 0.0f;
  float part = 0.0f;
  if (active && p.d_out != nullptr) {
    for (int d = lane; d < d_v; d += 32) part += bf16_to_float(p.d_out[row * d_v + d]) * bf16_to_float(p.out[row * d_v + d]);
  }
  const double d_row = static_cast<double>(warp_sum(part));
  if (lane != 0) return;
  launch.d_rows[row] = d_row;
  if (launch.sink_terms != nullptr) launch.sink_terms[row] = sink_term(a, h, padding, active, lse, d_lse, d_row);
}

// d_attn_sink[g, h] = Σ over the group's valid rows t, in order, of the sink terms.
__global__ void __launch_bounds__(kSinkThreads) backward_sink_kernel(const __grid_constant__ BackwardLaunch launch) {
  const BackwardParams& p = launch.p;
  const AttentionParams& a = p.forward;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kSinkThreads + threadIdx.x;
  if (item >= p.gradient_groups * a.num_heads) return;
  const int64_t g = item / a.num_heads;
  const int h = static_cast<int>(item % a.num_heads);
  const int64_t rows_per_group = a.num_tokens / p.gradient_groups;
  const int64_t valid_rows = valid_token_count(a.valid_tokens, a.num_tokens);
  const int64_t end = (g + 1) * rows_per_group < valid_rows ? (g + 1) * rows_per_group : valid_rows;
  double total = 0.0;
  for (int64_t t = g * rows_per_group; t < end; ++t) total += launch.sink_terms[t * a.num_heads + h];
  p.d_attn_sink[item] = static_cast<float>(total);
}

// Each candidate position's sort key and pair index.
__global__ void __launch_bounds__(256) cache_keys_kernel(const __grid_constant__ CacheGradientLaunch launch) {
  const AttentionParams& a = launch.p.forward;
  const int64_t p = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (p >= launch.positions) return;
  const int64_t t = p / a.main.topk;
  const int32_t j = static_cast<int32_t>(p % a.main.topk);
  const int64_t valid_rows = valid_token_count(a.valid_tokens, a.num_tokens);
  uint64_t key = kNoKey;
  if (t < valid_rows && j < a.main.row_length(t)) {
    const int64_t slot = a.main.slot(t, j);
    if (slot >= 0) {
      const int64_t group = t / (a.num_tokens / launch.p.gradient_groups);
      key = static_cast<uint64_t>(group * launch.num_slots + slot);
    }
  }
  launch.keys[p] = key;
  launch.pairs[p] = static_cast<int32_t>(p);
}

// The [first, last) run of each key in the sorted keys (the rows no key names stay [0, 0)).
__global__ void __launch_bounds__(256) cache_ranges_kernel(const __grid_constant__ CacheGradientLaunch launch) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (i >= launch.positions) return;
  const uint64_t key = launch.sorted_keys[i];
  if (key == kNoKey) return;
  if (i == 0 || launch.sorted_keys[i - 1] != key) launch.row_first[key] = static_cast<int32_t>(i);
  if (i + 1 == launch.positions || launch.sorted_keys[i + 1] != key) launch.row_last[key] = static_cast<int32_t>(i + 1);
}

// One warp per output row (gradient group, slot): Σ over its pairs in order, over the heads in order,
// of c_j·q + P_j·dO, rounded once to bf16.
__global__ void __launch_bounds__(32 * kRowWarps) cache_rows_kernel(const __grid_constant__ CacheGradientLaunch launch) {
  const BackwardParams& p = launch.p;
  const AttentionParams& a = p.forward;
  const FormatTraits& f = launch.format;
  const int64_t output_row = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (output_row >= p.gradient_groups * launch.num_slots) return;
  const int d_qk = f.d_qk;
  const int d_v = f.d_v;
  const int32_t first = launch.row_first[output_row];
  const int32_t last = launch.row_last[output_row];
  float key[kLanesPerThread];
  float acc[kLanesPerThread];
  const int64_t slot = output_row % launch.num_slots;
#pragma unroll
  for (int i = 0; i < kLanesPerThread; ++i) {
    const int d = lane + 32 * i;
    key[i] = first < last && d < d_qk ? key_lane(f, a.main.cache, slot, d) : 0.0f;  // an unreferenced row: never read
    acc[i] = 0.0f;
  }
  for (int32_t k = first; k < last; ++k) {
    const int64_t t = launch.sorted_pairs[k] / a.main.topk;
    for (int h = 0; h < a.num_heads; ++h) {
      const int64_t row = t * a.num_heads + h;
      const float lse = p.lse[row];
      if (!isfinite(lse)) continue;  // no weight on any candidate: q and d_out of the row are never read
      float q[kLanesPerThread];
      float d_out[kLanesPerThread];
      float score_part = 0.0f, d_weight_part = 0.0f;
#pragma unroll
      for (int i = 0; i < kLanesPerThread; ++i) {
        const int d = lane + 32 * i;
        q[i] = d < d_qk ? bf16_to_float(a.q[row * d_qk + d]) : 0.0f;
        d_out[i] = d < d_v && p.d_out != nullptr ? bf16_to_float(p.d_out[row * d_v + d]) : 0.0f;
        score_part += q[i] * key[i];
        d_weight_part += d_out[i] * key[i];
      }
      const float weight = attention_weight(a.sm_scale * warp_sum(score_part), lse);
      const float d_weight = warp_sum(d_weight_part);
      const float d_lse = p.d_lse != nullptr ? p.d_lse[row] : 0.0f;
      const float coefficient =
          a.sm_scale * static_cast<float>(weight * (static_cast<double>(d_weight) - launch.d_rows[row] + d_lse));
#pragma unroll
      for (int i = 0; i < kLanesPerThread; ++i) {
        acc[i] += coefficient * q[i];
        acc[i] += weight * d_out[i];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kLanesPerThread; ++i) {
    const int d = lane + 32 * i;
    if (d < d_qk) p.d_kv_cache[output_row * d_qk + d] = float_to_bf16(acc[i]);
  }
}

// The tensor-core kernel of the call's format, or nullptr where the SIMT kernels serve it: a format
// without an instance (kernel_list.h), an extra list in another format, a device that allows a block
// less shared memory than the instance needs (sm_80, sm_86/89/120), or JSMLA_CUDA_FAMILY=portable (read
// once per process: the kernels every GPU runs, for comparisons).
using MmaLauncher = cudaError_t (*)(const backward::BackwardMmaLaunch&, cudaStream_t);
MmaLauncher mma_launcher(const FormatTraits& main, const FormatTraits& extra, const AttentionParams& a) {
  static const bool allowed = hopper_allowed_by_environment();
  if (!allowed || (a.extra.topk > 0 && extra.id != main.id)) return nullptr;
  int device = 0, shared_bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&shared_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    return nullptr;
  }
  switch (main.id) {
#define JSMLA_BACKWARD_CASE(format, heads)                                                    \
  case FormatId::format:                                                                     \
    using Cfg##format = backward::BackwardMmaConfig<FormatId::format>;                        \
    return Cfg##format::kSharedBytes <= shared_bytes ? &backward::launch_backward_mma<Cfg##format> : nullptr;
    JSMLA_BACKWARD_KERNELS(JSMLA_BACKWARD_CASE)
#undef JSMLA_BACKWARD_CASE
    default:
      return nullptr;
  }
}

// The tensor-core path's sums of one chunk of tokens [first_token, end_token).
struct CacheSumLaunch {
  CacheGradientLaunch cache;
  const uint16_t* partials;  // bf16 [chunk tokens * topk, d_qk]
  float* accumulator;        // [G * slots, d_qk] (used only with more than one chunk)
  int64_t first_token, end_token;
  bool first_chunk, last_chunk;
};

constexpr int kSumMaxDqk = 576;              // the tensor-core path's widest rows (mma_backward_serves)
constexpr int kSumWords = kSumMaxDqk / 64;   // bf16 pairs of a row a lane adds
constexpr int kSumBatch = 4;                 // partial rows a warp has in flight at once
static_assert(kSumMaxDqk % 64 == 0, "a warp's lanes take whole bf16 pairs of every row");

// One warp per output row (gradient group, slot): adds the partial rows of its pairs whose token is in the
// chunk, in the sorted (token, candidate) order, to the row's running sum (kept in `accumulator` between
// chunks, advancing row_first past the pairs taken), and after the last chunk writes it rounded once to
// bf16 (zeros for a row no valid candidate references). The loads of kSumBatch rows are in flight
// together; they are added one after another in the sorted order.
__global__ void __launch_bounds__(32 * kRowWarps) cache_sum_kernel(const __grid_constant__ CacheSumLaunch launch) {
  const CacheGradientLaunch& cache = launch.cache;
  const AttentionParams& a = cache.p.forward;
  const int64_t output_row = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (output_row >= cache.p.gradient_groups * cache.num_slots) return;
  const int d_qk = cache.format.d_qk;
  const int words = d_qk / 2;
  float acc[kSumWords][2];
#pragma unroll
  for (int i = 0; i < kSumWords; ++i) {
    const int d = 2 * (lane + 32 * i);
    const bool kept = !launch.first_chunk && d < d_qk;
    acc[i][0] = kept ? launch.accumulator[output_row * d_qk + d] : 0.0f;
    acc[i][1] = kept ? launch.accumulator[output_row * d_qk + d + 1] : 0.0f;
  }
  int32_t k = cache.row_first[output_row];
  const int32_t last = cache.row_last[output_row];
  for (;;) {
    // The next kSumBatch pairs of the run whose token is in the chunk (tokens rise along a run).
    uint32_t rows[kSumBatch][kSumWords];
    int taken = 0;
#pragma unroll
    for (int u = 0; u < kSumBatch; ++u) {
      if (taken != u || k + u >= last) continue;
      const int32_t position = cache.sorted_pairs[k + u];
      const int64_t t = position / a.main.topk;
      if (t >= launch.end_token) continue;
      taken = u + 1;
      const uint32_t* partial = reinterpret_cast<const uint32_t*>(
          launch.partials + ((t - launch.first_token) * a.main.topk + position % a.main.topk) * d_qk);
#pragma unroll
      for (int i = 0; i < kSumWords; ++i) {
        const int w = lane + 32 * i;
        rows[u][i] = w < words ? partial[w] : 0u;
      }
    }
#pragma unroll
    for (int u = 0; u < kSumBatch; ++u) {
      if (u >= taken) break;
#pragma unroll
      for (int i = 0; i < kSumWords; ++i) {
        acc[i][0] += bf16_low_to_float(rows[u][i]);
        acc[i][1] += bf16_high_to_float(rows[u][i]);
      }
    }
    k += taken;
    if (taken < kSumBatch) break;
  }
  __syncwarp();  // every lane has read row_first before lane 0 moves it
  if (lane == 0) cache.row_first[output_row] = k;
#pragma unroll
  for (int i = 0; i < kSumWords; ++i) {
    const int d = 2 * (lane + 32 * i);
    if (d >= d_qk) continue;
    if (launch.last_chunk) {
      *reinterpret_cast<uint32_t*>(cache.p.d_kv_cache + output_row * d_qk + d) =
          static_cast<uint32_t>(float_to_bf16(acc[i][0])) | static_cast<uint32_t>(float_to_bf16(acc[i][1])) << 16;
    } else {
      launch.accumulator[output_row * d_qk + d] = acc[i][0];
      launch.accumulator[output_row * d_qk + d + 1] = acc[i][1];
    }
  }
}

// Whether the cache gradient's partial rows come from the wgmma kernel (partials_wgmma.cuh) instead of
// the mma.sync one: above 64 heads (it takes k = 2 · 128 rows whatever H) on an sm_90 device with a build
// that carries sm_90a code. JSMLA_BACKWARD_PARTIALS=mma in the environment (read once per process) keeps
// the mma.sync kernel there, for comparisons (any other value: the default).
bool use_wgmma_partials(const AttentionParams& a) {
  static const bool mma_requested = [] {
    const char* value = std::getenv("JSMLA_BACKWARD_PARTIALS");
    return value != nullptr && std::strcmp(value, "mma") == 0;
  }();
  if (mma_requested || a.num_heads <= 64 || !hopper_compiled()) return false;
  int device = 0, major = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major == 9;
}

int key_bits(uint64_t largest_key) {
  int bits = 1;
  while (bits < 64 && (largest_key >> bits) != 0) ++bits;
  return bits;
}

}  // namespace

cudaError_t launch_backward(const FormatTraits& main, const FormatTraits& extra, const BackwardParams& p,
                            void* workspace, int64_t workspace_bytes, cudaStream_t stream) {
  const AttentionParams& a = p.forward;
  if (a.num_tokens == 0 || a.num_heads == 0) return cudaSuccess;  // never a zero-size grid
  auto* base = static_cast<uint8_t*>(workspace);
  const int64_t num_slots = a.main.cache.num_slots();
  const BackwardWorkspace::Layout parts = BackwardWorkspace::layout(
      a.num_tokens, a.num_heads, a.main.topk, p.gradient_groups, num_slots, p.d_kv_cache != nullptr, main.d_qk,
      p.chunk_tokens);
  auto at = [base](int64_t offset) { return static_cast<void*>(base + offset); };
  BackwardLaunch launch{p, main, extra, static_cast<double*>(at(parts.sink_terms)), static_cast<double*>(at(parts.d_rows))};
  if (p.d_attn_sink == nullptr) launch.sink_terms = nullptr;
  const int64_t head_blocks = (a.num_heads + kHeadsPerBlock - 1) / kHeadsPerBlock;
  const MmaLauncher mma = p.d_q != nullptr || p.d_kv_cache != nullptr ? mma_launcher(main, extra, a) : nullptr;
  const bool mma_cache_gradient = mma != nullptr && p.d_kv_cache != nullptr;
  if (p.d_q == nullptr || mma != nullptr) {
    // D from out: the row terms, then the tensor-core kernel (here for q alone; with a cache gradient
    // chunk by chunk below).
    backward_row_terms_kernel<<<static_cast<unsigned>(a.num_tokens * head_blocks), kThreads, 0, stream>>>(launch);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    if (mma != nullptr && !mma_cache_gradient) {
      backward::BackwardMmaLaunch whole{p, launch.d_rows};
      whole.chunk_tokens = a.num_tokens;
      if (cudaError_t e = mma(whole, stream); e != cudaSuccess) return e;
    }
  } else {
    backward_rows_kernel<<<static_cast<unsigned>(a.num_tokens * head_blocks), kThreads, 0, stream>>>(launch);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (p.d_attn_sink != nullptr) {
    const int64_t items = p.gradient_groups * a.num_heads;
    backward_sink_kernel<<<static_cast<unsigned>((items + kSinkThreads - 1) / kSinkThreads), kSinkThreads, 0,
                           stream>>>(launch);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (p.d_kv_cache == nullptr) return cudaSuccess;

  // The bf16 main cache's gradient: the positions sorted by (gradient group, slot), each output row's run.
  const int64_t n = a.num_tokens * a.main.topk;
  const int64_t output_rows = p.gradient_groups * num_slots;
  if (output_rows == 0) return cudaSuccess;
  auto* keys0 = static_cast<uint64_t*>(at(parts.keys0));
  auto* pairs0 = static_cast<int32_t*>(at(parts.pairs0));
  auto* row_first = static_cast<int32_t*>(at(parts.row_first));
  auto* row_last = static_cast<int32_t*>(at(parts.row_last));
  CacheGradientLaunch cache{p, main, launch.d_rows, keys0, pairs0, nullptr, nullptr, row_first, row_last, num_slots, n};
  if (n > 0) {
    cache_keys_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(cache);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    cub::DoubleBuffer<uint64_t> sort_keys(keys0, static_cast<uint64_t*>(at(parts.keys1)));
    cub::DoubleBuffer<int32_t> sort_pairs(pairs0, static_cast<int32_t*>(at(parts.pairs1)));
    const int end_bit = key_bits(static_cast<uint64_t>(output_rows));  // keys < output_rows; kNoKey's high bits ignored
    size_t temp_bytes = 0;
    if (cudaError_t e = cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, sort_keys, sort_pairs, n, 0, end_bit, stream);
        e != cudaSuccess) {
      return e;
    }
    if (static_cast<int64_t>(temp_bytes) > workspace_bytes - parts.sort_temp) return cudaErrorInvalidValue;  // the bound is wrong
    if (cudaError_t e = cub::DeviceRadixSort::SortPairs(at(parts.sort_temp), temp_bytes, sort_keys, sort_pairs, n, 0,
                                                        end_bit, stream);
        e != cudaSuccess) {
      return e;
    }
    cache.sorted_keys = sort_keys.Current();
    cache.sorted_pairs = sort_pairs.Current();
  }
  if (cudaError_t e = cudaMemsetAsync(row_first, 0, output_rows * 4, stream); e != cudaSuccess) return e;
  if (cudaError_t e = cudaMemsetAsync(row_last, 0, output_rows * 4, stream); e != cudaSuccess) return e;
  if (n > 0) {
    cache_ranges_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(cache);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  const unsigned row_blocks = static_cast<unsigned>((output_rows + kRowWarps - 1) / kRowWarps);
  if (!mma_cache_gradient) {
    cache_rows_kernel<<<row_blocks, 32 * kRowWarps, 0, stream>>>(cache);
    return cudaGetLastError();
  }

  if (cache.format.d_qk > kSumMaxDqk || cache.format.d_qk % 2 != 0) return cudaErrorInvalidValue;  // mma_backward_serves
  // Tensor-core path, chunk by chunk of tokens: q's gradient with every position's P and c, the
  // positions' partial rows, then each output row adds the chunk's run of its pairs.
  backward::BackwardMmaLaunch chunk{p, launch.d_rows};
  chunk.weights = static_cast<uint16_t*>(at(parts.weights));
  chunk.coefficients = static_cast<uint16_t*>(at(parts.coefficients));
  chunk.partials = static_cast<uint16_t*>(at(parts.partials));
  chunk.position_pitch = BackwardWorkspace::position_pitch(a.main.topk);
  chunk.wgmma_partials = use_wgmma_partials(a);
  CacheSumLaunch sum{cache, chunk.partials, static_cast<float*>(at(parts.accumulator)), 0, 0, true, false};
  for (int64_t first = 0; first < a.num_tokens; first += parts.chunk_tokens) {
    chunk.first_token = first;
    chunk.chunk_tokens = min(parts.chunk_tokens, a.num_tokens - first);
    if (cudaError_t e = mma(chunk, stream); e != cudaSuccess) return e;
    sum.first_token = first;
    sum.end_token = first + chunk.chunk_tokens;
    sum.last_chunk = sum.end_token == a.num_tokens;
    cache_sum_kernel<<<row_blocks, 32 * kRowWarps, 0, stream>>>(sum);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    sum.first_chunk = false;
  }
  return cudaSuccess;
}

}  // namespace jsmla::cuda
