#include "sparse_mla_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "../common/numeric.h"

namespace jsmla {
namespace {

constexpr int kHeadsPerWorkItem = 16;

// The two hot loops get an AVX2 clone on x86-64 (picked at load time). Neither clone contracts to FMA
// and the reduction order is fixed by the eight partial sums, so every clone gives the same bits.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define JSMLA_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define JSMLA_VECTOR_CLONES
#endif

// Eight independent partial sums let the compiler vectorise the reduction.
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

// acc[0, n) += weight * v[0, n)
JSMLA_VECTOR_CLONES void scaled_add(float* acc, float weight, const float* v, int n) {
  for (int d = 0; d < n; ++d) acc[d] += weight * v[d];
}

struct Candidate {
  const CacheView* cache;
  const FormatTraits* format;
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

void write_empty(const FormatTraits& f, const AttentionParams& p, int64_t t, int h, float lse) {
  uint16_t* out = p.out + (t * p.num_heads + h) * static_cast<int64_t>(f.d_v);
  std::fill(out, out + f.d_v, static_cast<uint16_t>(0));
  p.lse[t * p.num_heads + h] = lse;
}

// Per-thread scratch, reused across work items.
struct Scratch {
  std::vector<Candidate> candidates;
  std::vector<float> keys;         // [n, d_qk] dequantized candidate rows
  std::vector<float> queries;      // [heads, d_qk]
  std::vector<float> scores;       // [heads, n], then softmax weights
  std::vector<float> accumulator;  // [heads, d_v]
};

// One work item: heads [h0, h1) of token t. Loops run candidate-major so each dequantized row is read
// once per pass while the block's queries and accumulators stay in cache.
void attend(const FormatTraits& f, const AttentionParams& p, int64_t t, int h0, int h1, Scratch& s) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  s.candidates.clear();
  collect_candidates(p.main, t, s.candidates);
  collect_candidates(p.extra, t, s.candidates);
  const int64_t n = static_cast<int64_t>(s.candidates.size());
  const int d_qk = f.d_qk;
  const int d_v = f.d_v;
  const int heads = h1 - h0;
  s.keys.resize(static_cast<size_t>(n) * d_qk);
  for (int64_t j = 0; j < n; ++j) {
    const Candidate& c = s.candidates[j];
    dequantize_row(*c.format, *c.cache, c.slot, s.keys.data() + j * d_qk);
  }
  s.queries.resize(static_cast<size_t>(heads) * d_qk);
  for (int h = 0; h < heads; ++h) {
    const uint16_t* q = p.q + (t * p.num_heads + h0 + h) * static_cast<int64_t>(d_qk);
    for (int d = 0; d < d_qk; ++d) s.queries[h * d_qk + d] = bf16_to_float(q[d]);
  }
  s.scores.resize(static_cast<size_t>(heads) * n);
  for (int64_t j = 0; j < n; ++j) {
    const float* k = s.keys.data() + j * d_qk;
    for (int h = 0; h < heads; ++h) s.scores[h * n + j] = p.sm_scale * dot_product(&s.queries[h * d_qk], k, d_qk);
  }

  // Softmax per head (lse includes the sink); scores become weights exp(s - lse).
  float lse[kHeadsPerWorkItem];
  bool empty[kHeadsPerWorkItem];
  for (int h = 0; h < heads; ++h) {
    const float sink = p.attn_sink != nullptr ? p.attn_sink[h0 + h] : -kInf;
    float* row = &s.scores[h * n];
    float max_score = sink;
    for (int64_t j = 0; j < n; ++j) max_score = std::max(max_score, row[j]);
    empty[h] = sink == kInf || max_score == -kInf;
    if (empty[h]) {  // an infinite sink, or no valid candidate and no sink
      lse[h] = sink == kInf ? kInf : -kInf;
      continue;
    }
    double total = sink == -kInf ? 0.0 : std::exp(static_cast<double>(sink) - max_score);
    for (int64_t j = 0; j < n; ++j) total += std::exp(static_cast<double>(row[j]) - max_score);
    const double row_lse = max_score + std::log(total);
    for (int64_t j = 0; j < n; ++j) row[j] = static_cast<float>(std::exp(static_cast<double>(row[j]) - row_lse));
    lse[h] = static_cast<float>(row_lse);
  }

  s.accumulator.assign(static_cast<size_t>(heads) * d_v, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const float* v = s.keys.data() + j * d_qk;
    for (int h = 0; h < heads; ++h) {
      if (empty[h]) continue;
      scaled_add(&s.accumulator[h * d_v], s.scores[h * n + j], v, d_v);
    }
  }
  for (int h = 0; h < heads; ++h) {
    if (empty[h]) {
      write_empty(f, p, t, h0 + h, lse[h]);
      continue;
    }
    uint16_t* out = p.out + (t * p.num_heads + h0 + h) * static_cast<int64_t>(d_v);
    for (int d = 0; d < d_v; ++d) out[d] = float_to_bf16(s.accumulator[h * d_v + d]);
    p.lse[t * p.num_heads + h0 + h] = lse[h];
  }
}

}  // namespace

void dequantize_row(const FormatTraits& f, const CacheView& cache, int64_t slot, float* out) {
  const uint8_t* row = cache.data_row(slot);
  if (f.quant_dim > 0) {
    const uint8_t* scales = cache.scales(f, slot);
    for (int g = 0; g < f.num_groups; ++g) {
      const float scale = group_scale(f, scales, g);
      for (int i = g * f.group_size; i < (g + 1) * f.group_size; ++i) {
        out[i] = quantized_lane(f, row, i) * scale;
      }
    }
  }
  const uint8_t* bf16 = row + f.bf16_offset;
  for (int i = 0; i < f.bf16_dim; ++i) out[f.quant_dim + i] = bf16_to_float(load_u16_le(bf16 + 2 * i));
}

void sparse_mla_cpu(const FormatTraits& f, const AttentionParams& p, int num_threads) {
  if (p.num_tokens == 0 || p.num_heads == 0) return;
  int64_t valid = p.num_tokens;
  if (p.valid_tokens != nullptr) valid = std::clamp<int64_t>(p.valid_tokens[0], 0, p.num_tokens);
  for (int64_t t = valid; t < p.num_tokens; ++t) {
    for (int h = 0; h < p.num_heads; ++h) {
      write_empty(f, p, t, h, -std::numeric_limits<float>::infinity());
    }
  }
  const int head_blocks = (p.num_heads + kHeadsPerWorkItem - 1) / kHeadsPerWorkItem;
  const int64_t work_items = valid * head_blocks;
  if (work_items == 0) return;
  if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  num_threads = static_cast<int>(std::min<int64_t>(num_threads, work_items));

  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    Scratch scratch;
    for (int64_t item = next.fetch_add(1); item < work_items; item = next.fetch_add(1)) {
      const int64_t t = item / head_blocks;
      const int h0 = static_cast<int>(item % head_blocks) * kHeadsPerWorkItem;
      const int h1 = std::min(h0 + kHeadsPerWorkItem, p.num_heads);
      attend(f, p, t, h0, h1, scratch);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) threads.emplace_back(worker);
  worker();
  for (auto& thread : threads) thread.join();
}

}  // namespace jsmla
