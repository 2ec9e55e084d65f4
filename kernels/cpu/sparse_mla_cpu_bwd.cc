// The C++ CPU backward kernel. Nothing of the forward is kept but its lse: the attention weights are
// recomputed from it (as FlashAttention does). For a row (token t, head h) with a finite lse, its valid
// candidates j (main and extra lists, exactly the forward's) and the cotangents dO = d_out[t, h],
// dl = d_lse[t, h]:
//
//   s_j = sm_scale <q, K_j>,  P_j = exp(s_j - lse),  dP_j = <dO, V_j>,  D = sum_j P_j dP_j
//   dS_j = P_j (dP_j - D + dl)                       the cotangent of the score s_j
//   d_q += sm_scale sum_j dS_j K_j
//   d_K(slot_j) += sm_scale dS_j q,  d_V(slot_j) += P_j dO     (V is the first d_v lanes of K)
//   d_sink[h] += exp(sink[h] - lse) (dl - D)
//
// D equals <dO, O> for the forward's output before its bfloat16 rounding. A row whose lse is +inf (an
// infinite sink holds all the weight) only adds dl to d_sink; a row whose lse is -inf (no candidate and no
// finite sink) and a padding row (t >= valid_tokens) add nothing; none of these rows is read.
//
// Pass 1 runs over (token, head block) work items: each writes its own d_q rows, D and sink terms. The
// sink gradient then sums the terms over tokens in order. Pass 2 (the bf16 cache gradient) sorts every
// valid main candidate (t, position) by its output row (gradient group, slot) with a counting sort, in
// (t, position) order, and gives each output row to one thread, which recomputes P_j and dS_j from D and
// adds the pairs in that order. No float atomics, no result that depends on the thread count or on which
// thread ran what.
#include "sparse_mla_cpu_bwd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "../common/dequantize_row.h"
#include "../common/numeric.h"

namespace jsmla {
namespace {

constexpr int kHeadsPerWorkItem = 16;
constexpr int64_t kSlotsPerWorkItem = 16;
constexpr float kInf = std::numeric_limits<float>::infinity();

// The hot loops get an AVX2 clone on x86-64 (picked at load time). Neither clone contracts to FMA and the
// reduction order is fixed by the eight partial sums, so both give the same bits.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define JSMLA_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define JSMLA_VECTOR_CLONES
#endif

JSMLA_VECTOR_CLONES float dot_product(const float* a, const float* b, int n) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) partial[k] += a[i + k] * b[i + k];
  }
  float sum = 0.0f;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (float x : partial) sum += x;
  return sum;
}

// dot_product(a, b, n) with `a` given as bf16 bits, converted on the fly: the same products in the same
// order, so the same bits as dot_product of the converted row.
JSMLA_VECTOR_CLONES float dot_product_bf16(const uint16_t* a, const float* b, int n) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) partial[k] += bf16_to_float(a[i + k]) * b[i + k];
  }
  float sum = 0.0f;
  for (; i < n; ++i) sum += bf16_to_float(a[i]) * b[i];
  for (float x : partial) sum += x;
  return sum;
}

// acc[0, n) += weight * v[0, n)
JSMLA_VECTOR_CLONES void scaled_add(float* acc, float weight, const float* v, int n) {
  for (int d = 0; d < n; ++d) acc[d] += weight * v[d];
}

// scaled_add with `v` given as bf16 bits.
JSMLA_VECTOR_CLONES void scaled_add_bf16(float* acc, float weight, const uint16_t* v, int n) {
  for (int d = 0; d < n; ++d) acc[d] += weight * bf16_to_float(v[d]);
}

void load_bf16(const uint16_t* bits, int n, float* out) {
  for (int d = 0; d < n; ++d) out[d] = bf16_to_float(bits[d]);
}

void store_bf16(const float* x, int n, uint16_t* out) {
  for (int d = 0; d < n; ++d) out[d] = float_to_bf16(x[d]);
}

// Both passes compute the weight and the key coefficient sm_scale * dS_j through these two functions, so
// pass 2 recomputes exactly pass 1's values.
float attention_weight(float score, float lse) {
  return static_cast<float>(std::exp(static_cast<double>(score) - static_cast<double>(lse)));
}

float key_coefficient(float sm_scale, float weight, float d_weight, double d_row, float d_lse) {
  return sm_scale * static_cast<float>(weight * (static_cast<double>(d_weight) - d_row + d_lse));
}

// Runs body(item, scratch) for every item in [0, count) on up to `num_threads` threads, each thread
// with its own Scratch. Items are independent: which thread runs one never changes its result.
template <typename Scratch, typename Body>
void parallel_for(int64_t count, int num_threads, const Body& body) {
  if (count <= 0) return;
  if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  num_threads = static_cast<int>(std::min<int64_t>(num_threads, count));
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    Scratch scratch;
    for (int64_t item = next.fetch_add(1); item < count; item = next.fetch_add(1)) body(item, scratch);
  };
  std::vector<std::thread> threads;
  threads.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) threads.emplace_back(worker);
  worker();
  for (auto& thread : threads) thread.join();
}

struct Candidate {
  const CacheView* cache;
  const FormatTraits* format;  // the list's (the extra cache may have another format of the same widths)
  int64_t slot;
};

void collect_candidates(const CandidateList& list, int64_t t, std::vector<Candidate>& out) {
  if (list.topk == 0) return;
  const int32_t length = list.row_length(t);
  for (int32_t j = 0; j < length; ++j) {
    const int64_t slot = list.slot(t, j);
    if (slot >= 0) out.push_back({&list.cache, &format_traits(list.format), slot});
  }
}

struct RowScratch {
  std::vector<Candidate> candidates;
  std::vector<float> keys;          // [n, d_qk] dequantized candidate rows
  std::vector<float> queries;       // [heads, d_qk]
  std::vector<float> d_out;         // [heads, d_v]
  std::vector<float> weights;       // [heads, n] P_j
  std::vector<float> d_weights;     // [heads, n] dP_j, then sm_scale * dS_j
  std::vector<float> accumulator;   // [heads, d_qk] d_q
};

// Pass 1 for heads [h0, h1) of token t (< valid_tokens): d_q, D (`d_rows`) and the sink terms. Loops run
// candidate-major, so each dequantized row is read once per pass while the block's rows stay in cache.
void backward_rows(const FormatTraits& f, const BackwardParams& p, int64_t t, int h0, int h1, double* d_rows,
                   double* sink_terms, RowScratch& s) {
  const AttentionParams& a = p.forward;
  const int d_qk = f.d_qk;
  const int d_v = f.d_v;
  const int row_heads = h1 - h0;
  const int64_t row0 = t * a.num_heads + h0;  // flattened (t, h0)
  // The heads with weight on candidates (a finite lse), in order; an infinite sink holds all the weight of
  // a head, so d lse / d sink = 1 and nothing else depends on the head's inputs.
  int active[kHeadsPerWorkItem];
  int heads = 0;
  for (int h = 0; h < row_heads; ++h) {
    const float lse = p.lse[row0 + h];
    if (std::isfinite(lse)) active[heads++] = h;
    if (sink_terms != nullptr && lse == kInf && p.d_lse != nullptr) sink_terms[row0 + h] = p.d_lse[row0 + h];
  }
  if (p.d_q != nullptr) std::fill(p.d_q + row0 * d_qk, p.d_q + (row0 + row_heads) * d_qk, static_cast<uint16_t>(0));
  if (heads == 0) return;

  s.candidates.clear();
  collect_candidates(a.main, t, s.candidates);
  collect_candidates(a.extra, t, s.candidates);
  const int64_t n = static_cast<int64_t>(s.candidates.size());
  s.keys.resize(static_cast<size_t>(n) * d_qk);
  for (int64_t j = 0; j < n; ++j) {
    const Candidate& c = s.candidates[j];
    dequantize_key_row(*c.format, *c.cache, c.slot, s.keys.data() + j * d_qk);
  }
  s.queries.resize(static_cast<size_t>(heads) * d_qk);
  s.d_out.resize(static_cast<size_t>(heads) * d_v);
  for (int i = 0; i < heads; ++i) {
    const int64_t row = row0 + active[i];
    load_bf16(a.q + row * d_qk, d_qk, &s.queries[static_cast<size_t>(i) * d_qk]);
    if (p.d_out != nullptr) load_bf16(p.d_out + row * d_v, d_v, &s.d_out[static_cast<size_t>(i) * d_v]);
  }
  s.weights.resize(static_cast<size_t>(heads) * n);
  s.d_weights.resize(static_cast<size_t>(heads) * n);
  for (int64_t j = 0; j < n; ++j) {
    const float* key = s.keys.data() + j * d_qk;
    for (int i = 0; i < heads; ++i) {
      const float score = a.sm_scale * dot_product(&s.queries[static_cast<size_t>(i) * d_qk], key, d_qk);
      s.weights[i * n + j] = attention_weight(score, p.lse[row0 + active[i]]);
      const float* d_out = &s.d_out[static_cast<size_t>(i) * d_v];
      s.d_weights[i * n + j] = p.d_out != nullptr ? dot_product(d_out, key, d_v) : 0.0f;
    }
  }
  for (int i = 0; i < heads; ++i) {
    const int64_t row = row0 + active[i];
    const float* weights = &s.weights[i * n];
    float* coefficients = &s.d_weights[i * n];
    double d_row = 0.0;
    for (int64_t j = 0; j < n; ++j) d_row += static_cast<double>(weights[j]) * coefficients[j];
    const float d_lse = p.d_lse != nullptr ? p.d_lse[row] : 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      coefficients[j] = key_coefficient(a.sm_scale, weights[j], coefficients[j], d_row, d_lse);
    }
    d_rows[row] = d_row;
    if (sink_terms != nullptr && a.attn_sink != nullptr && a.attn_sink[h0 + active[i]] > -kInf) {
      const double sink_weight = std::exp(static_cast<double>(a.attn_sink[h0 + active[i]]) - p.lse[row]);
      sink_terms[row] = sink_weight * (d_lse - d_row);
    }
  }
  if (p.d_q == nullptr) return;
  s.accumulator.assign(static_cast<size_t>(heads) * d_qk, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const float* key = s.keys.data() + j * d_qk;
    for (int i = 0; i < heads; ++i) {
      scaled_add(&s.accumulator[static_cast<size_t>(i) * d_qk], s.d_weights[i * n + j], key, d_qk);
    }
  }
  for (int i = 0; i < heads; ++i) {
    store_bf16(&s.accumulator[static_cast<size_t>(i) * d_qk], d_qk, p.d_q + (row0 + active[i]) * d_qk);
  }
}

struct SlotScratch {
  std::vector<float> key;          // [d_qk]
  std::vector<float> accumulator;  // [d_qk]
};

// Pass 2: the gradient of the main cache's rows (a bf16 format), one output row per (gradient group, slot).
// `pair_start[row]` .. `pair_start[row + 1]` index the output row's pairs t * topk + position in `pairs`.
void cache_gradient(const FormatTraits& f, const BackwardParams& p, int64_t valid, const std::vector<double>& d_rows,
                    int num_threads) {
  const AttentionParams& a = p.forward;
  const CandidateList& main = a.main;
  const int64_t num_slots = main.cache.num_slots();
  const int64_t rows_per_group = a.num_tokens / p.gradient_groups;
  const int64_t output_rows = p.gradient_groups * num_slots;
  std::vector<int64_t> pair_start(output_rows + 1, 0);
  auto for_each_pair = [&](auto&& visit) {
    for (int64_t t = 0; t < valid; ++t) {
      const int64_t group_row = t / rows_per_group * num_slots;
      const int32_t length = main.row_length(t);
      for (int32_t j = 0; j < length; ++j) {
        const int64_t slot = main.slot(t, j);
        if (slot >= 0) visit(group_row + slot, t * main.topk + j);
      }
    }
  };
  for_each_pair([&](int64_t row, int64_t) { ++pair_start[row + 1]; });
  for (int64_t row = 0; row < output_rows; ++row) pair_start[row + 1] += pair_start[row];
  std::vector<int64_t> pairs(pair_start[output_rows]);
  std::vector<int64_t> cursor(pair_start.begin(), pair_start.end() - 1);
  for_each_pair([&](int64_t row, int64_t pair) { pairs[cursor[row]++] = pair; });

  const int d_qk = f.d_qk;
  const int d_v = f.d_v;
  const int64_t work_items = (output_rows + kSlotsPerWorkItem - 1) / kSlotsPerWorkItem;
  parallel_for<SlotScratch>(work_items, num_threads, [&](int64_t item, SlotScratch& s) {
    s.key.resize(d_qk);
    s.accumulator.resize(d_qk);
    const int64_t end = std::min(output_rows, (item + 1) * kSlotsPerWorkItem);
    for (int64_t output_row = item * kSlotsPerWorkItem; output_row < end; ++output_row) {
      uint16_t* out = p.d_kv_cache + output_row * d_qk;
      if (pair_start[output_row] == pair_start[output_row + 1]) {  // not referenced (by this group): never read
        std::fill(out, out + d_qk, static_cast<uint16_t>(0));
        continue;
      }
      dequantize_key_row(f, main.cache, output_row % num_slots, s.key.data());
      std::fill(s.accumulator.begin(), s.accumulator.end(), 0.0f);
      for (int64_t i = pair_start[output_row]; i < pair_start[output_row + 1]; ++i) {
        const int64_t t = pairs[i] / main.topk;
        for (int h = 0; h < a.num_heads; ++h) {
          const int64_t row = t * a.num_heads + h;
          const float lse = p.lse[row];
          if (!std::isfinite(lse)) continue;  // no weight on any candidate: q and d_out of the row are never read
          const uint16_t* query = a.q + row * d_qk;
          const uint16_t* d_out = p.d_out != nullptr ? p.d_out + row * d_v : nullptr;
          const float weight = attention_weight(a.sm_scale * dot_product_bf16(query, s.key.data(), d_qk), lse);
          const float d_weight = d_out != nullptr ? dot_product_bf16(d_out, s.key.data(), d_v) : 0.0f;
          const float d_lse = p.d_lse != nullptr ? p.d_lse[row] : 0.0f;
          scaled_add_bf16(s.accumulator.data(), key_coefficient(a.sm_scale, weight, d_weight, d_rows[row], d_lse),
                          query, d_qk);
          if (d_out != nullptr) scaled_add_bf16(s.accumulator.data(), weight, d_out, d_v);
        }
      }
      store_bf16(s.accumulator.data(), d_qk, out);
    }
  });
}

}  // namespace

void sparse_mla_cpu_backward(const FormatTraits& f, const BackwardParams& p, int num_threads) {
  const AttentionParams& a = p.forward;
  const int64_t rows = a.num_tokens * a.num_heads;
  const int64_t valid = std::clamp<int64_t>(a.valid_tokens != nullptr ? a.valid_tokens[0] : a.num_tokens, 0,
                                            a.num_tokens);
  if (p.d_q != nullptr) {  // padding rows
    std::fill(p.d_q + valid * a.num_heads * f.d_qk, p.d_q + rows * f.d_qk, static_cast<uint16_t>(0));
  }
  std::vector<double> d_rows(rows, 0.0);
  std::vector<double> sink_terms(p.d_attn_sink != nullptr ? rows : 0, 0.0);
  const int head_blocks = (a.num_heads + kHeadsPerWorkItem - 1) / kHeadsPerWorkItem;
  parallel_for<RowScratch>(valid * head_blocks, num_threads, [&](int64_t item, RowScratch& s) {
    const int64_t t = item / head_blocks;
    const int h0 = static_cast<int>(item % head_blocks) * kHeadsPerWorkItem;
    const int h1 = std::min(h0 + kHeadsPerWorkItem, a.num_heads);
    backward_rows(f, p, t, h0, h1, d_rows.data(), p.d_attn_sink != nullptr ? sink_terms.data() : nullptr, s);
  });
  if (p.d_attn_sink != nullptr) {
    const int64_t rows_per_group = a.num_tokens / p.gradient_groups;
    for (int64_t g = 0; g < p.gradient_groups; ++g) {
      const int64_t end = std::min(valid, (g + 1) * rows_per_group);
      for (int h = 0; h < a.num_heads; ++h) {
        double total = 0.0;
        for (int64_t t = g * rows_per_group; t < end; ++t) total += sink_terms[t * a.num_heads + h];
        p.d_attn_sink[g * a.num_heads + h] = static_cast<float>(total);
      }
    }
  }
  if (p.d_kv_cache != nullptr) cache_gradient(f, p, valid, d_rows, num_threads);
}

}  // namespace jsmla
