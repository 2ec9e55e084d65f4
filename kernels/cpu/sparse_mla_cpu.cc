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

// Eight independent partial sums let the compiler vectorise the reduction.
float dot_product(const float* a, const float* b, int n) {
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

struct Candidate {
  const CacheView* cache;
  int64_t slot;
};

void collect_candidates(const CandidateList& list, int64_t t, std::vector<Candidate>& out) {
  if (list.topk == 0) return;
  const int32_t length = list.row_length(t);
  for (int32_t j = 0; j < length; ++j) {
    const int64_t slot = list.slot(t, j);
    if (slot >= 0) out.push_back({&list.cache, slot});
  }
}

void write_empty(const FormatTraits& f, const AttentionParams& p, int64_t t, int h, float lse) {
  uint16_t* out = p.out + (t * p.num_heads + h) * static_cast<int64_t>(f.d_v);
  std::fill(out, out + f.d_v, static_cast<uint16_t>(0));
  p.lse[t * p.num_heads + h] = lse;
}

// One work item: heads [h0, h1) of token t.
void attend(const FormatTraits& f, const AttentionParams& p, int64_t t, int h0, int h1,
            std::vector<Candidate>& candidates, std::vector<float>& keys, std::vector<float>& scores,
            std::vector<float>& query, std::vector<float>& accumulator) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  candidates.clear();
  collect_candidates(p.main, t, candidates);
  collect_candidates(p.extra, t, candidates);
  const int64_t n = static_cast<int64_t>(candidates.size());
  const int d_qk = f.d_qk;
  const int d_v = f.d_v;
  keys.resize(static_cast<size_t>(n) * d_qk);
  for (int64_t j = 0; j < n; ++j) {
    dequantize_row(f, *candidates[j].cache, candidates[j].slot, keys.data() + j * d_qk);
  }
  scores.resize(static_cast<size_t>(n));
  query.resize(d_qk);
  accumulator.resize(d_v);

  for (int h = h0; h < h1; ++h) {
    const float sink = p.attn_sink != nullptr ? p.attn_sink[h] : -kInf;
    if (sink == kInf) {
      write_empty(f, p, t, h, kInf);
      continue;
    }
    const uint16_t* q = p.q + (t * p.num_heads + h) * static_cast<int64_t>(d_qk);
    for (int d = 0; d < d_qk; ++d) query[d] = bf16_to_float(q[d]);
    float max_score = sink;
    for (int64_t j = 0; j < n; ++j) {
      const float* k = keys.data() + j * d_qk;
      scores[j] = p.sm_scale * dot_product(query.data(), k, d_qk);
      max_score = std::max(max_score, scores[j]);
    }
    if (max_score == -kInf) {  // no valid candidate and no sink
      write_empty(f, p, t, h, -kInf);
      continue;
    }
    double total = sink == -kInf ? 0.0 : std::exp(static_cast<double>(sink) - max_score);
    for (int64_t j = 0; j < n; ++j) total += std::exp(static_cast<double>(scores[j]) - max_score);
    const double lse = max_score + std::log(total);
    std::fill(accumulator.begin(), accumulator.end(), 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const float weight = static_cast<float>(std::exp(static_cast<double>(scores[j]) - lse));
      const float* v = keys.data() + j * d_qk;
      for (int d = 0; d < d_v; ++d) accumulator[d] += weight * v[d];
    }
    uint16_t* out = p.out + (t * p.num_heads + h) * static_cast<int64_t>(d_v);
    for (int d = 0; d < d_v; ++d) out[d] = float_to_bf16(accumulator[d]);
    p.lse[t * p.num_heads + h] = static_cast<float>(lse);
  }
}

}  // namespace

void dequantize_row(const FormatTraits& f, const CacheView& cache, int64_t slot, float* out) {
  const uint8_t* row = cache.data_row(slot);
  if (f.fp8_dim > 0) {
    const uint8_t* scales = cache.scales(f, slot);
    for (int g = 0; g < f.num_groups; ++g) {
      const float scale = group_scale(f, scales, g);
      for (int i = g * f.group_size; i < (g + 1) * f.group_size; ++i) {
        out[i] = fp8_e4m3_to_float(row[i]) * scale;
      }
    }
  }
  const uint8_t* bf16 = row + f.bf16_offset;
  for (int i = 0; i < f.bf16_dim; ++i) out[f.fp8_dim + i] = bf16_to_float(load_u16_le(bf16 + 2 * i));
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
    std::vector<Candidate> candidates;
    std::vector<float> keys, scores, query;
    std::vector<float> accumulator;
    for (int64_t item = next.fetch_add(1); item < work_items; item = next.fetch_add(1)) {
      const int64_t t = item / head_blocks;
      const int h0 = static_cast<int>(item % head_blocks) * kHeadsPerWorkItem;
      const int h1 = std::min(h0 + kHeadsPerWorkItem, p.num_heads);
      attend(f, p, t, h0, h1, candidates, keys, scores, query, accumulator);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) threads.emplace_back(worker);
  worker();
  for (auto& thread : threads) thread.join();
}

}  // namespace jsmla
