// Standalone correctness + timing check of the portable CUDA kernels, without JAX.
//
// Builds caches on the host (quantized exactly as docs/formats.md describes), runs decode (split-K + combine)
// and prefill through the same registry the FFI handler uses, and compares with a float64 reference
// on the dequantized cache (kernels/cpu's dequantize_row, so addressing is shared with the CPU path).
// Outputs are poisoned with NaN before every run. Timing uses CUDA events over batches of calls that
// rotate between index sets, on caches larger than L2.
//
// Build (not part of the CMake targets; see build_and_check.sh):
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I. -gencode=arch=compute_90a,code=sm_90a \
//        kernels/cuda/tests/portable_check.cu kernels/cpu/sparse_mla_cpu.cc <libjsmla_cuda.a> -o portable_check
// Run: ./portable_check [--quick | --sanitize | --headline | --ablate | --h16 | --dots3 | --scales | --profile |
//      --profile-small [h16|h64 [heads [tokens [splits [reps [flags...]]]]]] | --profile-bf16]
//      (exit code 0 only when every check passes)
//   --quick: correctness only; --sanitize: a few small cases, for compute-sanitizer memcheck/racecheck;
//   --headline: the headline shapes on the Hopper family, checked and timed; --ablate: only the
//   dsv3_2 H=128 rows of --headline (decode and prefill variant at T=128, prefill T=4096), for builds
//   that leave a stage of the kernel out to see what it costs; --h16: the 16-head tiles (portable, and
//   the Hopper family's where it exists) at tensor-parallel shard shapes (T=1..128, H=16/32) over
//   several split counts; --dots3: dots3_swa's window at T=128 and T=1 (H=128) on the portable 32-head
//   tile and the Hopper-only 64-head cluster tile, beside dsv3_2 over as many candidates (time per
//   FLOP); --scales: the formats with UE8M0, E4M3 and arbitrary FP32 scales (dsv4, dsv4_1, dots3_swa,
//   dsv4_nvfp4, dsv4_1_fp4, glm_nsa) beside dsv3_2 on the Hopper family at T=128 H=128; --profile: see
//   below. Every 16-head plan runs on both families' tiles.
// JSMLA_CHECK_SERIAL_COMBINE=1 launches every combine after its split kernel completes (no programmatic
// dependent launch), e.g. to tell a sanitizer report about the dependent launch from one about the kernel.
// JSMLA_CHECK_COLD_L2=1 times every call alone, after a write of four times the L2's size that evicts
// the kernels' code and rows from it (outside the timed span), as in a model's step where other kernels
// run between two attention calls; by default calls run back to back, their code and rows left in L2.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/common/dequantize_row.h"
#include "kernels/common/numeric.h"
#include "kernels/cpu/sparse_mla_cpu.h"
#include "kernels/cuda/combine.h"
#include "kernels/cuda/load_tile.cuh"
#include "kernels/cuda/phase_clock.cuh"
#include "kernels/cuda/registry.h"
#include "kernels/cuda/tests/check_cuda.h"

namespace {

using namespace jsmla;

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------- host quantization (docs/formats.md)
struct Fp8Table {
  std::vector<float> values;  // codes 0..126 (non-negative finite e4m3)
  Fp8Table() {
    for (int c = 0; c < 127; ++c) values.push_back(fp8_e4m3_to_float(static_cast<uint8_t>(c)));
  }
  // Saturating round-to-nearest-even.
  uint8_t encode(float x) const {
    const float a = std::min(std::fabs(x), 448.0f);
    const auto it = std::lower_bound(values.begin(), values.end(), a);
    int code = static_cast<int>(it - values.begin());
    if (code > 126) code = 126;
    if (code > 0) {
      const float hi = values[code], lo = values[code - 1];
      if (a - lo < hi - a || (a - lo == hi - a && (code - 1) % 2 == 0)) code -= 1;
    }
    return static_cast<uint8_t>(code | (x < 0 && code != 0 ? 0x80 : 0));
  }
};

float pow2_ceil(float v) { return std::ldexp(1.0f, static_cast<int>(std::ceil(std::log2(v)))); }

struct HostCache {
  std::vector<uint8_t> bytes;
  CacheView view;  // base points into `bytes`
  uint8_t* device = nullptr;
  CacheView device_view() const {
    CacheView v = view;
    v.base = device;
    return v;
  }
};

// A cache of `num_pages` pages of `page_size` tokens; row_stride / page_stride may add padding,
// which is filled with 0xff (NaN as FP8 and BF16) so that a read of it would show. With
// `wide_scales`, a third of the rows get their group scales times 2^16 (FP8 codes near the bottom of
// the range, subnormals included; scales above 2^7 take the loader's FP32 path) and another third
// times 2^-16 (saturated codes, tiny values).
HostCache build_cache(const FormatTraits& f, int64_t num_pages, int64_t page_size, int64_t row_stride,
                      int64_t page_stride, uint64_t seed, const Fp8Table& fp8, bool wide_scales = false) {
  HostCache c;
  c.bytes.assign(static_cast<size_t>(num_pages * page_stride), 0xff);
  c.view.base = c.bytes.data();
  c.view.num_pages = num_pages;
  c.view.page_size = page_size;
  c.view.page_stride = page_stride;
  c.view.row_stride = row_stride;
  const int64_t slots = num_pages * page_size;
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&, w] {
      std::mt19937_64 rng(seed * 1000 + w);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> x(f.d_qk);
      for (int64_t slot = w; slot < slots; slot += threads) {
        for (auto& v : x) v = normal(rng);
        uint8_t* row = const_cast<uint8_t*>(c.view.data_row(slot));
        if (f.quant_bits == 4) {  // random E2M1 codes and E4M3 scales 2^-1 .. 2^1 (the reference dequantizes them)
          uint8_t* scales = const_cast<uint8_t*>(c.view.scales(f, slot));
          std::memset(scales, 0, f.scale_row_bytes);
          for (int g = 0; g < f.num_groups; ++g) scales[g] = static_cast<uint8_t>(0x30 + rng() % 17);
          for (int i = 0; i < f.quant_dim / 2; ++i) row[i] = static_cast<uint8_t>(rng());
        } else if (f.quant_dim > 0) {
          uint8_t* scales = const_cast<uint8_t*>(c.view.scales(f, slot));
          if (f.layout == Layout::kFooter) std::memset(scales, 0, f.scale_row_bytes);
          for (int g = 0; g < f.num_groups; ++g) {
            float amax = 1e-4f;
            for (int i = g * f.group_size; i < (g + 1) * f.group_size; ++i) amax = std::max(amax, std::fabs(x[i]));
            float scale = (f.pow2_scales || f.scale_kind == ScaleKind::kUe8m0) ? pow2_ceil(amax / 448.0f)
                                                                             : amax / 448.0f;
            if (wide_scales) scale *= slot % 3 == 1 ? 65536.0f : slot % 3 == 2 ? 1.0f / 65536.0f : 1.0f;
            if (f.scale_kind == ScaleKind::kFp32) {
              std::memcpy(scales + 4 * g, &scale, 4);
            } else {
              scales[g] = static_cast<uint8_t>(127 + std::ilogb(scale));
            }
            for (int i = g * f.group_size; i < (g + 1) * f.group_size; ++i) row[i] = fp8.encode(x[i] / scale);
          }
        }
        uint8_t* bf16 = row + f.bf16_offset;
        for (int i = 0; i < f.bf16_dim; ++i) {
          const uint16_t b = float_to_bf16(x[f.quant_dim + i]);
          bf16[2 * i] = static_cast<uint8_t>(b & 0xff);
          bf16[2 * i + 1] = static_cast<uint8_t>(b >> 8);
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  CHECK_CUDA(cudaMalloc(&c.device, c.bytes.size()));
  CHECK_CUDA(cudaMemcpy(c.device, c.bytes.data(), c.bytes.size(), cudaMemcpyHostToDevice));
  return c;
}

// ---------------------------------------------------------------- problem
struct Problem {
  std::string name;
  FormatId format;
  int64_t num_tokens;
  int num_heads;
  int topk;
  int extra_topk = 0;
  float sm_scale;
  bool with_topk_length = false;
  bool with_sink = false;
  int valid_tokens = -1;       // -1: all
  double invalid_fraction = 0.02;
  int index_sets = 1;          // rotated between timed calls
};

struct DeviceProblem {
  Problem pr;
  const FormatTraits* f;
  HostCache* main;
  HostCache* extra;  // may be null
  std::vector<std::vector<int32_t>> indices, extra_indices;  // per index set, [T, topk]
  std::vector<int32_t> topk_length, extra_topk_length;
  std::vector<float> sink;
  std::vector<uint16_t> q;
  int32_t valid_tokens;
  // device
  std::vector<int32_t*> d_indices, d_extra_indices;
  int32_t *d_topk_length = nullptr, *d_extra_topk_length = nullptr, *d_valid = nullptr;
  float* d_sink = nullptr;
  uint16_t* d_q = nullptr;
  uint16_t* d_out = nullptr;
  float* d_lse = nullptr;
  void* d_workspace = nullptr;
  size_t workspace_bytes = 0;
};

template <class T>
T* to_device(const std::vector<T>& v) {
  if (v.empty()) return nullptr;
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, v.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

std::vector<int32_t> random_indices(int64_t rows, int width, int64_t num_slots, double invalid_fraction,
                                    std::mt19937_64& rng) {
  std::vector<int32_t> v(static_cast<size_t>(rows * width));
  std::uniform_int_distribution<int64_t> slot(0, num_slots - 1);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const int32_t bad[] = {-1, -7, static_cast<int32_t>(num_slots), static_cast<int32_t>(num_slots + 12345),
                         std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
  for (auto& x : v) {
    x = u(rng) < invalid_fraction ? bad[static_cast<int>(u(rng) * 6) % 6] : static_cast<int32_t>(slot(rng));
  }
  return v;
}

DeviceProblem make_problem(const Problem& pr, HostCache* main, HostCache* extra, uint64_t seed) {
  DeviceProblem d;
  d.pr = pr;
  d.f = &format_traits(pr.format);
  d.main = main;
  d.extra = extra;
  std::mt19937_64 rng(seed);
  for (int s = 0; s < pr.index_sets; ++s) {
    d.indices.push_back(random_indices(pr.num_tokens, pr.topk, main->view.num_slots(), pr.invalid_fraction, rng));
    if (pr.extra_topk > 0) {
      d.extra_indices.push_back(
          random_indices(pr.num_tokens, pr.extra_topk, extra->view.num_slots(), pr.invalid_fraction, rng));
    }
  }
  std::uniform_int_distribution<int> len(0, pr.topk + 3);
  if (pr.with_topk_length) {
    for (int64_t t = 0; t < pr.num_tokens; ++t) d.topk_length.push_back(t == 0 ? pr.topk : (t == 1 ? 0 : len(rng) - 2));
    if (pr.extra_topk > 0) {
      std::uniform_int_distribution<int> elen(-1, pr.extra_topk + 2);
      for (int64_t t = 0; t < pr.num_tokens; ++t) d.extra_topk_length.push_back(t == 1 ? 0 : elen(rng));
    }
  }
  if (pr.with_sink) {
    std::normal_distribution<float> normal(1.0f, 2.0f);
    for (int h = 0; h < pr.num_heads; ++h) d.sink.push_back(normal(rng));
    d.sink[0] = std::numeric_limits<float>::infinity();
    if (pr.num_heads > 1) d.sink[1] = -std::numeric_limits<float>::infinity();
  }
  d.q.resize(static_cast<size_t>(pr.num_tokens * pr.num_heads * d.f->d_qk));
  {
    const int threads = std::max(1u, std::thread::hardware_concurrency());
    std::vector<std::thread> pool;
    for (int w = 0; w < threads; ++w) {
      pool.emplace_back([&, w] {
        std::mt19937_64 local(seed * 7919 + w);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (size_t i = w; i < d.q.size(); i += threads) d.q[i] = float_to_bf16(normal(local));
      });
    }
    for (auto& t : pool) t.join();
  }
  d.valid_tokens = pr.valid_tokens < 0 ? static_cast<int32_t>(pr.num_tokens) : pr.valid_tokens;

  for (auto& v : d.indices) d.d_indices.push_back(to_device(v));
  for (auto& v : d.extra_indices) d.d_extra_indices.push_back(to_device(v));
  d.d_topk_length = to_device(d.topk_length);
  d.d_extra_topk_length = to_device(d.extra_topk_length);
  d.d_valid = to_device(std::vector<int32_t>{d.valid_tokens});
  d.d_sink = to_device(d.sink);
  d.d_q = to_device(d.q);
  CHECK_CUDA(cudaMalloc(&d.d_out, pr.num_tokens * pr.num_heads * d.f->d_v * 2));
  CHECK_CUDA(cudaMalloc(&d.d_lse, pr.num_tokens * pr.num_heads * 4));
  return d;
}

AttentionParams attention_params(const DeviceProblem& d, int set) {
  AttentionParams a;
  a.q = d.d_q;
  a.num_tokens = d.pr.num_tokens;
  a.num_heads = d.pr.num_heads;
  a.main.cache = d.main->device_view();
  a.main.indices = d.d_indices[set];
  a.main.topk = d.pr.topk;
  a.main.topk_length = d.d_topk_length;
  a.main.max_candidates = d.f->max_candidates;
  if (d.pr.extra_topk > 0) {
    a.extra.cache = d.extra->device_view();
    a.extra.indices = d.d_extra_indices[set];
    a.extra.topk = d.pr.extra_topk;
    a.extra.topk_length = d.d_extra_topk_length;
    a.extra.max_candidates = d.f->max_candidates;
  }
  a.attn_sink = d.d_sink;
  a.valid_tokens = d.pr.valid_tokens < 0 ? nullptr : d.d_valid;  // none given: as the op, no count
  a.sm_scale = d.pr.sm_scale;
  a.out = d.d_out;
  a.lse = d.d_lse;
  return a;
}

struct Plan {
  int variant;  // 1 decode, 2 prefill
  int heads_per_block;
  int num_splits = 1;
  int split_size = 0;
  bool hopper = false;  // run the Hopper family's kernel instead of the portable one
  bool dependent_combine = true;  // on sm_90+, the combine as the split kernel's programmatic dependent
  std::string text() const {
    return std::string(hopper ? "H " : "") + (variant == 1 ? "decode hpb=" : "prefill hpb=") +
           std::to_string(heads_per_block) +
           (variant == 1 ? " splits=" + std::to_string(num_splits) + "x" + std::to_string(split_size) : "") +
           (dependent_combine ? "" : " serial");
  }
};

bool g_hopper_device = false;  // sm_90 GPU and a build with the Hopper family's sm_90a code
bool g_dependent_combine = false;  // sm_90 or newer: the combine is the split kernel's programmatic dependent
int g_sm_count = 0;
#if JSMLA_PHASE_CLOCKS
// The last launch's phase records (phase_clock.cuh): [block][role][PhaseClock::kRecord], -1 where unwritten.
// Every launch of such a build copies them back and waits for it: its timings are not the kernels'
// (--profile-small is the mode it serves).
std::vector<long long> g_phase_clocks;
long long* g_phase_clocks_device = nullptr;
#endif

Plan on_hopper(Plan plan) {
  plan.hopper = true;
  return plan;
}

Plan serial_combine(Plan plan) {
  plan.dependent_combine = false;
  return plan;
}

// Mirrors ffi/cuda_handlers.cu (after its checks).
void launch(DeviceProblem& d, const Plan& plan, int set, cudaStream_t stream) {
  const cuda::KernelInfo* kernel = cuda::find_kernel(plan.hopper ? cuda::Family::kHopper : cuda::Family::kPortable,
                                                     d.pr.format, plan.heads_per_block);
  if (kernel == nullptr) {
    std::fprintf(stderr, "no kernel for %s hpb=%d\n", d.pr.name.c_str(), plan.heads_per_block);
    std::exit(2);
  }
  cuda::SplitKvParams p;
  p.attn = attention_params(d, set);
  p.num_head_tiles = (d.pr.num_heads + plan.heads_per_block - 1) / plan.heads_per_block;
  const bool decode = plan.variant == 1;
  p.num_splits = decode ? plan.num_splits : 1;
  p.split_size = decode ? plan.split_size : d.pr.topk + d.pr.extra_topk;
  if (decode) {
    const size_t bytes = cuda::SplitWorkspace::bytes(plan.num_splits, d.pr.num_tokens, d.pr.num_heads, d.f->d_v);
    if (bytes > d.workspace_bytes) {
      if (d.d_workspace) CHECK_CUDA(cudaFree(d.d_workspace));
      CHECK_CUDA(cudaMalloc(&d.d_workspace, bytes));
      // Poison: a read of an unwritten partial would show as NaN.
      CHECK_CUDA(cudaMemset(d.d_workspace, 0xff, bytes));
      d.workspace_bytes = bytes;
    }
    p.workspace = cuda::SplitWorkspace::carve(d.d_workspace, plan.num_splits, d.pr.num_tokens, d.pr.num_heads, d.f->d_v);
  }
#if JSMLA_PHASE_CLOCKS
  const size_t records = static_cast<size_t>(d.pr.num_tokens * p.num_head_tiles * p.num_splits) *
                         kernel->shape.cluster_blocks * cuda::PhaseClock::kRoles * cuda::PhaseClock::kRecord;
  if (g_phase_clocks.size() != records) {
    if (g_phase_clocks_device) CHECK_CUDA(cudaFree(g_phase_clocks_device));
    CHECK_CUDA(cudaMalloc(&g_phase_clocks_device, records * sizeof(long long)));
    g_phase_clocks.assign(records, -1);
  }
  CHECK_CUDA(cudaMemsetAsync(g_phase_clocks_device, 0xff, records * sizeof(long long), stream));
  p.phase_clocks = g_phase_clocks_device;
  // JSMLA_PHASE_BACK_TO_BACK=1: the split kernel twice in a row (the records are the second launch's),
  // to tell a block's first-time costs that survive a launch from those another kernel brings back.
  if (std::getenv("JSMLA_PHASE_BACK_TO_BACK") != nullptr) CHECK_CUDA(kernel->launch(p, stream));
#endif
  CHECK_CUDA(kernel->launch(p, stream));
#if JSMLA_PHASE_CLOCKS
  CHECK_CUDA(cudaMemcpyAsync(g_phase_clocks.data(), g_phase_clocks_device, records * sizeof(long long),
                             cudaMemcpyDeviceToHost, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
#endif
  if (decode) {
    cuda::CombineParams c;
    c.workspace = p.workspace;
    c.num_splits = plan.num_splits;
    c.num_tokens = d.pr.num_tokens;
    c.num_heads = d.pr.num_heads;
    c.attn_sink = p.attn.attn_sink;
    c.valid_tokens = p.attn.valid_tokens;
    c.out = p.attn.out;
    c.lse = p.attn.lse;
    CHECK_CUDA(cuda::launch_combine(c, d.f->d_v, g_sm_count, g_dependent_combine && plan.dependent_combine, stream));
  }
}

// ---------------------------------------------------------------- float64 reference
struct Errors {
  double max_abs = 0, max_ref = 0, sq_err = 0, sq_ref = 0, max_lse = 0;
  int64_t bad = 0;  // NaN, unwritten, ±inf mismatch, or padding rows not empty
  std::string first_bad;
  void note_bad(const std::string& what) {
    if (bad++ == 0) first_bad = what;
  }
  bool ok() const {
    const double rel_l2 = sq_ref > 0 ? std::sqrt(sq_err / sq_ref) : std::sqrt(sq_err);
    return bad == 0 && max_abs <= 2e-2 * std::max(1.0, max_ref) && rel_l2 <= 1e-2 && max_lse <= 1e-3;
  }
  double rel_l2() const { return sq_ref > 0 ? std::sqrt(sq_err / sq_ref) : std::sqrt(sq_err); }
};

void collect(const CandidateList& list, int64_t t, std::vector<std::pair<const CacheView*, int64_t>>& out) {
  if (list.topk == 0) return;
  const int32_t n = list.row_length(t);
  for (int32_t j = 0; j < n; ++j) {
    const int64_t s = list.slot(t, j);
    if (s >= 0) out.push_back({&list.cache, s});
  }
}

// Checks rows `tokens` of the device result against the float64 reference (index set `set`).
Errors check(const DeviceProblem& d, int set, const std::vector<int64_t>& tokens) {
  const Problem& pr = d.pr;
  const FormatTraits& f = *d.f;
  const int64_t T = pr.num_tokens;
  std::vector<uint16_t> out(static_cast<size_t>(T * pr.num_heads * f.d_v));
  std::vector<float> lse(static_cast<size_t>(T * pr.num_heads));
  CHECK_CUDA(cudaMemcpy(out.data(), d.d_out, out.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(lse.data(), d.d_lse, lse.size() * 4, cudaMemcpyDeviceToHost));

  CandidateList main;
  main.cache = d.main->view;
  main.indices = d.indices[set].data();
  main.topk = pr.topk;
  main.topk_length = d.topk_length.empty() ? nullptr : d.topk_length.data();
  main.max_candidates = f.max_candidates;
  CandidateList extra;
  if (pr.extra_topk > 0) {
    extra.cache = d.extra->view;
    extra.indices = d.extra_indices[set].data();
    extra.topk = pr.extra_topk;
    extra.topk_length = d.extra_topk_length.empty() ? nullptr : d.extra_topk_length.data();
    extra.max_candidates = f.max_candidates;
  }

  std::vector<Errors> per_token(tokens.size());
  std::vector<std::thread> pool;
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&, w] {
      std::vector<std::pair<const CacheView*, int64_t>> cands;
      std::vector<float> keys;
      std::vector<double> scores, acc(f.d_v);
      for (size_t ti = w; ti < tokens.size(); ti += threads) {
        const int64_t t = tokens[ti];
        Errors& e = per_token[ti];
        if (t >= d.valid_tokens) {
          for (int h = 0; h < pr.num_heads; ++h) {
            for (int i = 0; i < f.d_v; ++i) {
              if (out[(t * pr.num_heads + h) * f.d_v + i] != 0) e.note_bad("padding row out != 0");
            }
            if (lse[t * pr.num_heads + h] != -std::numeric_limits<float>::infinity()) e.note_bad("padding row lse");
          }
          continue;
        }
        cands.clear();
        collect(main, t, cands);
        collect(extra, t, cands);
        const size_t n = cands.size();
        keys.resize(n * f.d_qk);
        for (size_t j = 0; j < n; ++j) dequantize_key_row(f, *cands[j].first, cands[j].second, keys.data() + j * f.d_qk);
        scores.resize(n);
        for (int h = 0; h < pr.num_heads; ++h) {
          const uint16_t* q = d.q.data() + (t * pr.num_heads + h) * f.d_qk;
          double mx = d.sink.empty() ? -kInf : d.sink[h];
          for (size_t j = 0; j < n; ++j) {
            double s = 0;
            const float* k = keys.data() + j * f.d_qk;
            for (int i = 0; i < f.d_qk; ++i) s += static_cast<double>(bf16_to_float(q[i])) * k[i];
            scores[j] = static_cast<double>(pr.sm_scale) * s;
            mx = std::max(mx, scores[j]);
          }
          double ref_lse;
          std::fill(acc.begin(), acc.end(), 0.0);
          if (mx == -kInf) {
            ref_lse = -kInf;
          } else if (mx == kInf) {
            ref_lse = kInf;
          } else {
            double total = d.sink.empty() ? 0.0 : std::exp(static_cast<double>(d.sink[h]) - mx);
            for (size_t j = 0; j < n; ++j) total += std::exp(scores[j] - mx);
            ref_lse = mx + std::log(total);
            for (size_t j = 0; j < n; ++j) {
              const double w = std::exp(scores[j] - ref_lse);
              const float* v = keys.data() + j * f.d_qk;
              for (int i = 0; i < f.d_v; ++i) acc[i] += w * v[i];
            }
          }
          const float got_lse = lse[t * pr.num_heads + h];
          if (std::isnan(got_lse)) {
            e.note_bad("lse NaN/unwritten at t=" + std::to_string(t) + " h=" + std::to_string(h));
          } else if (std::isinf(ref_lse) || std::isinf(got_lse)) {
            if (static_cast<double>(got_lse) != ref_lse) {
              e.note_bad("lse inf mismatch at t=" + std::to_string(t) + " h=" + std::to_string(h) + " got " +
                         std::to_string(got_lse) + " ref " + std::to_string(ref_lse));
            }
          } else {
            e.max_lse = std::max(e.max_lse, std::fabs(got_lse - ref_lse));
          }
          for (int i = 0; i < f.d_v; ++i) {
            const float got = bf16_to_float(out[(t * pr.num_heads + h) * f.d_v + i]);
            if (std::isnan(got)) {
              e.note_bad("out NaN/unwritten at t=" + std::to_string(t) + " h=" + std::to_string(h));
              continue;
            }
            const double err = std::fabs(got - acc[i]);
            e.max_abs = std::max(e.max_abs, err);
            e.max_ref = std::max(e.max_ref, std::fabs(acc[i]));
            e.sq_err += err * err;
            e.sq_ref += acc[i] * acc[i];
          }
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  Errors total;
  for (const Errors& e : per_token) {
    total.max_abs = std::max(total.max_abs, e.max_abs);
    total.max_ref = std::max(total.max_ref, e.max_ref);
    total.max_lse = std::max(total.max_lse, e.max_lse);
    total.sq_err += e.sq_err;
    total.sq_ref += e.sq_ref;
    if (e.bad > 0 && total.bad == 0) total.first_bad = e.first_bad;
    total.bad += e.bad;
  }
  return total;
}

void poison(DeviceProblem& d) {
  CHECK_CUDA(cudaMemset(d.d_out, 0xff, d.pr.num_tokens * d.pr.num_heads * d.f->d_v * 2));
  CHECK_CUDA(cudaMemset(d.d_lse, 0xff, d.pr.num_tokens * d.pr.num_heads * 4));
}

std::vector<int64_t> all_tokens(int64_t T) {
  std::vector<int64_t> v(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) v[t] = t;
  return v;
}

struct Row {
  std::string name, plan;
  Errors errors;
  bool deterministic = true;
  double micros = 0;
  double tflops = 0;
};
std::vector<Row> g_rows;
bool g_failed = false;

// Runs, checks and (when reps > 0) times one plan of one problem.
void run_case(DeviceProblem& d, const Plan& plan, const std::vector<int64_t>& tokens, int reps) {
  if (plan.hopper && !g_hopper_device) return;
  Row row;
  row.name = d.pr.name;
  row.plan = plan.text();
  poison(d);
  launch(d, plan, 0, nullptr);
  CHECK_CUDA(cudaDeviceSynchronize());
  row.errors = check(d, 0, tokens);
  // Determinism: a second run must give identical bits.
  std::vector<uint16_t> first(static_cast<size_t>(d.pr.num_tokens * d.pr.num_heads * d.f->d_v));
  CHECK_CUDA(cudaMemcpy(first.data(), d.d_out, first.size() * 2, cudaMemcpyDeviceToHost));
  poison(d);
  launch(d, plan, 0, nullptr);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> second(first.size());
  CHECK_CUDA(cudaMemcpy(second.data(), d.d_out, second.size() * 2, cudaMemcpyDeviceToHost));
  row.deterministic = first == second;

  if (reps > 0) {
    constexpr int kCallsPerBatch = 8;
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    for (int w = 0; w < 3; ++w) launch(d, plan, w % d.pr.index_sets, nullptr);
    std::vector<float> times;
    // µs a call of `calls` (count calls, launched between two events).
    auto time_calls = [&](int count, auto&& calls) {
      CHECK_CUDA(cudaEventRecord(start));
      calls();
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      return ms * 1000.0f / count;
    };
    if (std::getenv("JSMLA_CHECK_COLD_L2") != nullptr) {
      static void* flush = nullptr;  // kept for the process's later cases
      static size_t flush_bytes = 0;
      if (flush == nullptr) {
        int l2_bytes = 0;
        CHECK_CUDA(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, 0));
        flush_bytes = 4 * static_cast<size_t>(l2_bytes);
        CHECK_CUDA(cudaMalloc(&flush, flush_bytes));
      }
      for (int r = 0; r < reps * kCallsPerBatch; ++r) {
        CHECK_CUDA(cudaMemsetAsync(flush, r & 0xff, flush_bytes));
        times.push_back(time_calls(1, [&] { launch(d, plan, r % d.pr.index_sets, nullptr); }));
      }
    } else {
      for (int r = 0; r < reps; ++r) {
        times.push_back(time_calls(kCallsPerBatch, [&] {
          for (int c = 0; c < kCallsPerBatch; ++c) launch(d, plan, c % d.pr.index_sets, nullptr);
        }));
      }
    }
    std::sort(times.begin(), times.end());
    row.micros = times[times.size() / 2];
    const double flops = 2.0 * d.pr.num_tokens * d.pr.num_heads * (d.pr.topk + d.pr.extra_topk) * (d.f->d_qk + d.f->d_v);
    row.tflops = flops / (row.micros * 1e-6) / 1e12;
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
  }
  const bool ok = row.errors.ok() && row.deterministic;
  g_failed |= !ok;
  std::printf("%-34s %-30s %s max_abs=%.2e (ref %.2f) relL2=%.2e lse=%.2e det=%d bad=%lld %s %s\n", row.name.c_str(),
              row.plan.c_str(), ok ? "PASS" : "FAIL", row.errors.max_abs, row.errors.max_ref, row.errors.rel_l2(),
              row.errors.max_lse, row.deterministic ? 1 : 0, static_cast<long long>(row.errors.bad),
              row.errors.first_bad.c_str(), reps > 0 ? (std::to_string(row.micros) + " us").c_str() : "");
  std::fflush(stdout);
  g_rows.push_back(row);
  // Every 16-head plan also runs on the Hopper family's 16-head tile where it exists (same checks, and
  // the same timing beside the portable tile).
  if (!plan.hopper && plan.heads_per_block == 16 && g_hopper_device &&
      cuda::find_kernel(cuda::Family::kHopper, d.pr.format, 16) != nullptr) {
    run_case(d, on_hopper(plan), tokens, reps);
  }
}

int round_up(int a, int b) { return (a + b - 1) / b * b; }

Plan decode_plan(int hpb, int candidates, int splits) {
  const int size = round_up((candidates + splits - 1) / splits, cuda::kSplitGranule);
  return Plan{1, hpb, (candidates + size - 1) / size, size};
}

// A 64-head-tile decode plan and the prefill plan, each on the portable and the Hopper family.
void run_on_both_families(DeviceProblem& d, const Plan& decode, const std::vector<int64_t>& tokens) {
  for (const Plan& plan : {decode, Plan{2, 64}}) {
    run_case(d, plan, tokens, 0);
    run_case(d, on_hopper(plan), tokens, 0);
  }
}

void release(DeviceProblem& d) {
  for (auto* p : d.d_indices) cudaFree(p);
  for (auto* p : d.d_extra_indices) cudaFree(p);
  cudaFree(d.d_topk_length);
  cudaFree(d.d_extra_topk_length);
  cudaFree(d.d_valid);
  cudaFree(d.d_sink);
  cudaFree(d.d_q);
  cudaFree(d.d_out);
  cudaFree(d.d_lse);
  cudaFree(d.d_workspace);
}

// ---------------------------------------------------------------- FP8 dequantization, exhaustively
// Every e4m3 code times scales on both sides of the loader's bit-path limit, through both of its
// conversion paths: for every scale bit_path_scale accepts, the two paths must give identical bits
// (NaN codes aside, which the bit path documents as ±480 · scale), and the FP32 path must match the
// host's rounding of the exact product.
using ProbeLoader = cuda::TileLoader<FormatId::kDsv32, 32, 128>;

__global__ void dequantize_probe_kernel(const float* scales, uint16_t* bit_path, uint16_t* fp32_path,
                                        int* accepted) {
  const float scale = scales[blockIdx.x];
  const int t = threadIdx.x;  // codes 16 t .. 16 t + 15
  uint32_t words[4];
  for (int w = 0; w < 4; ++w) {
    const uint32_t c = 16 * t + 4 * w;
    words[w] = c | (c + 1) << 8 | (c + 2) << 16 | (c + 3) << 24;
  }
  const uint4 fp8 = make_uint4(words[0], words[1], words[2], words[3]);
  uint16_t* const out_bits = bit_path + blockIdx.x * 256 + 16 * t;
  uint16_t* const out_fp32 = fp32_path + blockIdx.x * 256 + 16 * t;
  auto store_bits = [&](int dim, uint4 v) { *reinterpret_cast<uint4*>(out_bits + dim) = v; };
  auto store_fp32 = [&](int dim, uint4 v) { *reinterpret_cast<uint4*>(out_fp32 + dim) = v; };
  ProbeLoader::dequantize_fp8_unit<true>(fp8, scale, 0, store_bits);
  ProbeLoader::dequantize_fp8_unit<false>(fp8, scale, 0, store_fp32);
  if (t == 0) accepted[blockIdx.x] = ProbeLoader::bit_path_scale(scale) ? 1 : 0;
}

void check_dequantization() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> scales;
  for (int e = -126; e <= 7; ++e) scales.push_back(std::ldexp(1.0f, e));  // the bit path's range
  for (float s : {0.0f, -0.0f, -0.125f, -128.0f}) scales.push_back(s);    // also on it
  for (float s : {256.0f, 65536.0f, 0x1p100f, 3.0f, 0.75f, -3.0f, 0x1p-130f, nan, inf, -inf}) scales.push_back(s);
  const int n = static_cast<int>(scales.size());
  float* d_scales;
  uint16_t *d_bits, *d_fp32;
  int* d_accepted;
  CHECK_CUDA(cudaMalloc(&d_scales, n * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&d_bits, n * 256 * sizeof(uint16_t)));
  CHECK_CUDA(cudaMalloc(&d_fp32, n * 256 * sizeof(uint16_t)));
  CHECK_CUDA(cudaMalloc(&d_accepted, n * sizeof(int)));
  CHECK_CUDA(cudaMemcpy(d_scales, scales.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  dequantize_probe_kernel<<<n, 16>>>(d_scales, d_bits, d_fp32, d_accepted);
  CHECK_CUDA(cudaGetLastError());
  std::vector<uint16_t> bits(n * 256), fp32(n * 256);
  std::vector<int> accepted(n);
  CHECK_CUDA(cudaMemcpy(bits.data(), d_bits, bits.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(fp32.data(), d_fp32, fp32.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(accepted.data(), d_accepted, n * sizeof(int), cudaMemcpyDeviceToHost));
  cudaFree(d_scales);
  cudaFree(d_bits);
  cudaFree(d_fp32);
  cudaFree(d_accepted);
  int mismatches = 0, bit_path_scales = 0;
  for (int i = 0; i < n; ++i) {
    const float s = scales[i];
    int exponent = 0;
    const bool power_of_two = s == 0.0f || (std::isnormal(s) && std::fabs(std::frexp(s, &exponent)) == 0.5f);
    const bool expect_accepted = power_of_two && std::fabs(s) <= 128.0f;
    bit_path_scales += expect_accepted;
    if ((accepted[i] != 0) != expect_accepted) {
      std::printf("dequantization: scale %g classified %d\n", s, accepted[i]);
      ++mismatches;
    }
    for (int c = 0; c < 256; ++c) {
      const bool nan_code = (c & 0x7f) == 0x7f;
      const uint16_t fp32_expected = float_to_bf16(fp8_e4m3_to_float(static_cast<uint8_t>(c)) * s);
      const uint16_t got_fp32 = fp32[i * 256 + c], got_bits = bits[i * 256 + c];
      const bool fp32_ok = std::isnan(bf16_to_float(fp32_expected)) ? std::isnan(bf16_to_float(got_fp32))
                                                                     : got_fp32 == fp32_expected;
      bool bits_ok = true;
      if (expect_accepted) {
        bits_ok = nan_code ? got_bits == float_to_bf16((c & 0x80 ? -480.0f : 480.0f) * s) : got_bits == got_fp32;
      }
      if (!fp32_ok || !bits_ok) {
        if (mismatches < 10) {
          std::printf("dequantization: code 0x%02x scale %g: fp32 path %04x (want %04x), bit path %04x\n", c, s,
                      got_fp32, fp32_expected, got_bits);
        }
        ++mismatches;
      }
    }
  }
  std::printf("dequantization: 256 codes x %d scales (%d on the bit path): %s\n", n, bit_path_scales,
              mismatches == 0 ? "PASS" : "FAIL");
  g_failed |= mismatches != 0;
}

// Every UE8M0 scale byte through the loader's integer bit-path test and scale (bit_path_unit,
// bit_path_unit_scale) against bit_path_scale of the decoded scale, and the decode (device and host)
// against 2^(b-127) (255: NaN); and every E4M3 scale byte through the loader's decode (the conversion
// instruction) against the host's fp8_e4m3_to_float (NaN codes: NaN).
using Ue8m0Loader = cuda::TileLoader<FormatId::kDsv4, 32, 128>;
using E4m3Loader = cuda::TileLoader<FormatId::kDsv4Nvfp4, 32, 128>;

__global__ void ue8m0_probe_kernel(int* accepted, int* expected, uint32_t* bits, uint32_t* decoded, float* e4m3) {
  const uint8_t b = static_cast<uint8_t>(threadIdx.x);
  const float scale = ue8m0_to_float(b);
  accepted[b] = Ue8m0Loader::bit_path_unit(&b, 0) ? 1 : 0;
  expected[b] = Ue8m0Loader::bit_path_scale(scale) ? 1 : 0;
  bits[b] = __float_as_uint(Ue8m0Loader::bit_path_unit_scale(&b, 0));
  decoded[b] = __float_as_uint(scale);
  e4m3[b] = E4m3Loader::group_scale_of(&b, 0);
}

void check_ue8m0_scales() {
  int *d_accepted, *d_expected;
  uint32_t *d_bits, *d_decoded;
  float* d_e4m3;
  CHECK_CUDA(cudaMalloc(&d_e4m3, 256 * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&d_accepted, 256 * sizeof(int)));
  CHECK_CUDA(cudaMalloc(&d_expected, 256 * sizeof(int)));
  CHECK_CUDA(cudaMalloc(&d_bits, 256 * sizeof(uint32_t)));
  CHECK_CUDA(cudaMalloc(&d_decoded, 256 * sizeof(uint32_t)));
  ue8m0_probe_kernel<<<1, 256>>>(d_accepted, d_expected, d_bits, d_decoded, d_e4m3);
  CHECK_CUDA(cudaGetLastError());
  std::vector<int> accepted(256), expected(256);
  std::vector<uint32_t> bits(256), decoded(256);
  std::vector<float> e4m3(256);
  CHECK_CUDA(cudaMemcpy(e4m3.data(), d_e4m3, 256 * sizeof(float), cudaMemcpyDeviceToHost));
  cudaFree(d_e4m3);
  CHECK_CUDA(cudaMemcpy(accepted.data(), d_accepted, 256 * sizeof(int), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(expected.data(), d_expected, 256 * sizeof(int), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(bits.data(), d_bits, 256 * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(decoded.data(), d_decoded, 256 * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  cudaFree(d_accepted);
  cudaFree(d_expected);
  cudaFree(d_bits);
  cudaFree(d_decoded);
  int mismatches = 0, on_path = 0;
  for (int b = 0; b < 256; ++b) {
    const float want = b == 255 ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, b - 127);
    const float host = ue8m0_to_float(static_cast<uint8_t>(b));
    float device;
    std::memcpy(&device, &decoded[b], 4);
    const bool decode_ok = b == 255 ? std::isnan(host) && std::isnan(device) : host == want && device == want;
    const bool path_ok = accepted[b] == expected[b] && (accepted[b] == 0 || bits[b] == decoded[b]);
    on_path += accepted[b];
    if (!decode_ok || !path_ok) {
      std::printf("ue8m0: byte %d: decoded %08x, bit path %d (want %d), scale %08x\n", b, decoded[b], accepted[b],
                  expected[b], bits[b]);
      ++mismatches;
    }
  }
  for (int b = 0; b < 256; ++b) {
    const float want = fp8_e4m3_to_float(static_cast<uint8_t>(b));
    if (std::isnan(want) ? !std::isnan(e4m3[b]) : e4m3[b] != want) {
      std::printf("e4m3 scale: byte %d: %g (want %g)\n", b, e4m3[b], want);
      ++mismatches;
    }
  }
  std::printf("ue8m0 and e4m3 scales: 256 bytes each (%d UE8M0 on the bit path): %s\n", on_path,
              mismatches == 0 ? "PASS" : "FAIL");
  g_failed |= mismatches != 0;
}

// Every FP4 byte (two e2m1 values) times every E4M3 scale byte through the loader's FP4 conversion,
// against the host's product rounded to BF16 (exact in BF16; NaN scales give NaN, signed zeros kept).
__global__ void fp4_probe_kernel(uint16_t* out) {
  const uint8_t scale_codes[2] = {static_cast<uint8_t>(blockIdx.x), static_cast<uint8_t>(blockIdx.x)};
  const int t = threadIdx.x;  // bytes 16 t .. 16 t + 15, i.e. values 32 t .. 32 t + 31 (value 2 b + n: nibble n of byte b)
  uint32_t words[4];
  for (int w = 0; w < 4; ++w) {
    const uint32_t c = 16 * t + 4 * w;
    words[w] = c | (c + 1) << 8 | (c + 2) << 16 | (c + 3) << 24;
  }
  uint16_t* const values = out + blockIdx.x * 512 + 32 * t;
  auto store = [&](int dim, uint4 v) { *reinterpret_cast<uint4*>(values + dim) = v; };
  E4m3Loader::dequantize_fp4_unit(make_uint4(words[0], words[1], words[2], words[3]), scale_codes, 0, store);
}

void check_fp4_dequantization() {
  uint16_t* d_out;
  CHECK_CUDA(cudaMalloc(&d_out, 256 * 512 * sizeof(uint16_t)));
  fp4_probe_kernel<<<256, 16>>>(d_out);
  CHECK_CUDA(cudaGetLastError());
  std::vector<uint16_t> got(256 * 512);
  CHECK_CUDA(cudaMemcpy(got.data(), d_out, got.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  cudaFree(d_out);
  int mismatches = 0;
  for (int s = 0; s < 256; ++s) {
    const float scale = fp8_e4m3_to_float(static_cast<uint8_t>(s));
    for (int v = 0; v < 512; ++v) {
      const int code = ((v / 2) >> (4 * (v % 2))) & 0xf;
      const uint16_t want = float_to_bf16(fp4_e2m1_to_float(static_cast<uint8_t>(code)) * scale);
      const uint16_t have = got[s * 512 + v];
      const bool ok = std::isnan(bf16_to_float(want)) ? std::isnan(bf16_to_float(have)) : have == want;
      if (!ok) {
        if (mismatches < 10) std::printf("fp4: code 0x%x scale byte 0x%02x: %04x (want %04x)\n", code, s, have, want);
        ++mismatches;
      }
    }
  }
  std::printf("fp4 dequantization: 256 bytes x 256 E4M3 scales: %s\n", mismatches == 0 ? "PASS" : "FAIL");
  g_failed |= mismatches != 0;
}

// The timed modes' table (one line a case: plan, checks, median µs, TFLOP/s); the exit status.
int print_timed_rows() {
  for (const Row& r : g_rows) {
    std::printf("%-30s %-30s %-5s %10.1f us %7.1f TFLOP/s\n", r.name.c_str(), r.plan.c_str(),
                r.errors.ok() && r.deterministic ? "PASS" : "FAIL", r.micros, r.tflops);
  }
  return g_failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const bool sanitize = mode == "--sanitize";
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  g_hopper_device = prop.major * 10 + prop.minor == cuda::kHopperComputeCapability && cuda::hopper_compiled();
  g_dependent_combine = prop.major >= 9 && std::getenv("JSMLA_CHECK_SERIAL_COMBINE") == nullptr;
  g_sm_count = prop.multiProcessorCount;
  // --profile: the T=128 H=128 shape once per variant (for ncu: decode with one split, then prefill, on
  // the Hopper family when available, else the portable one). --headline: the headline shapes on the
  // Hopper family, each checked and timed (a quick performance comparison between builds).
  // --profile-small [h16|h64 [heads [tokens [splits [reps [flags...]]]]]]: one small-batch decode, for ncu;
  // by default T = 1 H = 128 with 32 splits of the 64-head tile, or (h16) the planner's pick, 16 splits
  // of the 16-head tile. Flags: "lengths" (the call passes topk_length: token 0 of length topk, the others
  // random), "portable" (the portable family even on an H100/H200), "bf16" (a bf16_576 cache instead of
  // dsv3_2). Built with JSMLA_PHASE_CLOCKS=1, it prints the Hopper tiles' phase records
  // (benchmarks/phase_clocks.py).
  if (mode == "--profile-small") {
    const Fp8Table fp8;
    const bool h16 = argc > 2 && std::string(argv[2]) == "h16";
    const int heads = argc > 3 ? std::atoi(argv[3]) : 128;
    const int64_t tokens = argc > 4 ? std::atoll(argv[4]) : 1;
    const int splits = argc > 5 ? std::atoi(argv[5]) : h16 ? 16 : 32;
    const int reps = argc > 6 ? std::atoi(argv[6]) : 0;  // > 0: also timed (median of reps batches)
    bool lengths = false, portable = false, bf16 = false;
    for (int i = 7; i < argc; ++i) {
      const std::string flag = argv[i];
      if (flag == "lengths") {
        lengths = true;
      } else if (flag == "portable") {
        portable = true;
      } else if (flag == "bf16") {
        bf16 = true;
      } else {
        std::fprintf(stderr, "--profile-small: unknown flag %s (lengths, portable, bf16)\n", flag.c_str());
        return 2;
      }
    }
    const FormatId format = bf16 ? FormatId::kBf16_576 : FormatId::kDsv32;
    HostCache cache = bf16 ? build_cache(format_traits(format), 4096, 64, 1152, 64 * 1152, 9, fp8)
                           : build_cache(format_traits(format), 4096, 64, 656, 64 * 656, 1, fp8);
    Problem pr1{std::string(bf16 ? "bf16_576" : "dsv3_2") + " T=" + std::to_string(tokens) + " H=" +
                    std::to_string(heads) + " k=2048" + (lengths ? " lengths" : ""),
                format, tokens, heads, 2048, 0, 0.0417f, lengths, false, -1, 0.0, 8};
    DeviceProblem d1 = make_problem(pr1, &cache, nullptr, 15);
    const Plan plan = decode_plan(h16 ? 16 : 64, 2048, splits);
    run_case(d1, g_hopper_device && !portable ? on_hopper(plan) : plan, {0}, reps);
#if JSMLA_PHASE_CLOCKS
    // The last launch's records, in the lines benchmarks/phase_clocks.py reads.
    constexpr int kRecord = cuda::PhaseClock::kRecord;
    const int blocks = static_cast<int>(g_phase_clocks.size() / (cuda::PhaseClock::kRoles * kRecord));
    const int head_tiles = (pr1.num_heads + plan.heads_per_block - 1) / plan.heads_per_block;
    for (int block = 0; block < blocks; ++block) {
      for (int role = 0; role < cuda::PhaseClock::kRoles; ++role) {
        const long long* r = &g_phase_clocks[(static_cast<size_t>(block) * cuda::PhaseClock::kRoles + role) * kRecord];
        if (r[0] < 0) continue;  // the kernel marks no phases, or not this role
        static const char* const kH16Roles[] = {"producer", "consumer", ""};
        static const char* const kH64Roles[] = {"producer", "scorer", "pv"};
        std::printf("PHASE %s %s block=%d split=%d head_tile=%d token=%d start_ns=%lld end_ns=%lld start_cycles=%lld c=",
                    h16 ? "h16" : "h64", (h16 ? kH16Roles : kH64Roles)[role], block, block % plan.num_splits,
                    (block / plan.num_splits) % head_tiles, static_cast<int>(block / plan.num_splits / head_tiles), r[0],
                    r[1], r[2]);
        for (int i = 0; i < cuda::PhaseClock::kMarks; ++i) std::printf(i ? ",%lld" : "%lld", r[3 + i]);
        std::printf("\n");
      }
    }
#endif
    release(d1);
    return g_failed ? 1 : 0;
  }
  // --profile-bf16: the bf16_576 prefill at T=128 H=128 once (the BF16 kernel beside FlashMLA's BF16
  // sparse prefill under ncu, benchmarks/profile_hopper.sh).
  if (mode == "--profile-bf16") {
    const Fp8Table fp8;
    HostCache bf16 = build_cache(format_traits(FormatId::kBf16_576), 4096, 64, 1152, 64 * 1152, 9, fp8);
    Problem pr{"bf16_576 T=128 H=128 k=2048", FormatId::kBf16_576, 128, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
    DeviceProblem d = make_problem(pr, &bf16, nullptr, 23);
    run_case(d, g_hopper_device ? on_hopper(Plan{2, 64}) : Plan{2, 64}, {0}, 0);
    release(d);
    return g_failed ? 1 : 0;
  }
  if (mode == "--h16") {  // the 16-head tiles at the tensor-parallel shard shapes, several split counts
    const Fp8Table fp8;
    HostCache cache = build_cache(format_traits(FormatId::kDsv32), 4096, 64, 656, 64 * 656, 1, fp8);
    struct Shape { int64_t tokens; int heads; std::vector<int> splits; };
    for (const Shape& sh : {Shape{128, 16, {1, 2, 3, 4}}, Shape{128, 32, {1, 2, 3}}, Shape{32, 16, {2, 4, 8}},
                            Shape{1, 16, {16, 32, 64}}}) {
      const std::string name = "dsv3_2 T=" + std::to_string(sh.tokens) + " H=" + std::to_string(sh.heads) + " k=2048";
      Problem pr{name, FormatId::kDsv32, sh.tokens, sh.heads, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
      DeviceProblem d = make_problem(pr, &cache, nullptr, 31);
      for (int splits : sh.splits) run_case(d, decode_plan(16, 2048, splits), {0, sh.tokens - 1}, 15);
      release(d);
    }
    cudaFree(cache.device);
    const FormatTraits& f4 = format_traits(FormatId::kDsv4);
    HostCache dsv4 = build_cache(f4, 4096, 64, 576, 64 * 584, 4, fp8);
    Problem pr4{"dsv4 T=128 H=16 k=2048", FormatId::kDsv4, 128, 16, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
    DeviceProblem d4 = make_problem(pr4, &dsv4, nullptr, 32);
    for (int splits : {1, 2, 3}) run_case(d4, decode_plan(16, 2048, splits), {0, 127}, 15);
    release(d4);
    cudaFree(dsv4.device);
    const FormatTraits& fp4 = format_traits(FormatId::kDsv4Nvfp4);  // the same shape at 0.66x the bytes
    HostCache nvfp4 = build_cache(fp4, 4096, 64, fp4.data_row_bytes, 64 * fp4.bytes_per_token, 5, fp8);
    Problem prf{"dsv4_nvfp4 T=128 H=16 k=2048", FormatId::kDsv4Nvfp4, 128, 16, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
    DeviceProblem df = make_problem(prf, &nvfp4, nullptr, 33);
    for (int splits : {1, 2, 3}) run_case(df, decode_plan(16, 2048, splits), {0, 127}, 15);
    release(df);
    cudaFree(nvfp4.device);
    return print_timed_rows();
  }
  if (mode == "--scales") {  // the scaled formats on the Hopper family beside dsv3_2, T=128 H=128, one split
    const Fp8Table fp8;
    struct Entry { const char* name; FormatId id; uint64_t seed; };
    for (const Entry& e : {Entry{"dsv3_2", FormatId::kDsv32, 1}, Entry{"dsv4", FormatId::kDsv4, 4},
                           Entry{"dsv4_1", FormatId::kDsv41, 6}, Entry{"dots3_swa", FormatId::kDots3Swa, 7},
                           Entry{"dsv4_nvfp4", FormatId::kDsv4Nvfp4, 5}, Entry{"dsv4_1_fp4", FormatId::kDsv41Fp4, 8},
                           Entry{"glm_nsa", FormatId::kGlmNsa, 1}}) {
      const FormatTraits& f = format_traits(e.id);
      HostCache cache = build_cache(f, 4096, 64, f.data_row_bytes, 64 * f.bytes_per_token, e.seed, fp8);
      const std::string name = std::string(e.name) + " T=128 H=128 k=2048";
      Problem pr{name, e.id, 128, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
      DeviceProblem d = make_problem(pr, &cache, nullptr, 81);
      run_case(d, on_hopper(decode_plan(64, 2048, 1)), {0, 37, 127}, 15);
      release(d);
      if (e.id == FormatId::kDsv4 || e.id == FormatId::kDsv4Nvfp4) {  // a 16-head shard (both families' 16-head tiles)
        Problem pr16{std::string(e.name) + " T=128 H=16 k=2048", e.id, 128, 16, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
        DeviceProblem d16 = make_problem(pr16, &cache, nullptr, 82);
        run_case(d16, decode_plan(16, 2048, 2), {0, 127}, 15);
        release(d16);
      }
      cudaFree(cache.device);
    }
    return print_timed_rows();
  }
  if (mode == "--dots3") {  // dots3_swa's 513-candidate window on both families, beside dsv3_2 on 513 candidates
    const Fp8Table fp8;
    const FormatTraits& f3 = format_traits(FormatId::kDots3Swa);
    HostCache dots3 = build_cache(f3, 4096, 64, f3.data_row_bytes, 64 * f3.bytes_per_token, 7, fp8);
    Problem pr{"dots3_swa T=128 H=128 k=2048", FormatId::kDots3Swa, 128, 128, 2048, 0, 0.0303f, false, false, -1, 0.0, 4};
    DeviceProblem d = make_problem(pr, &dots3, nullptr, 64);
    for (const Plan& plan : {Plan{2, 32}, decode_plan(32, 2048, 1), on_hopper(Plan{2, 64}),
                             on_hopper(decode_plan(64, 2048, 1))}) {
      run_case(d, plan, {0, 37, 127}, 15);
    }
    release(d);
    Problem pr1{"dots3_swa T=1 H=128 k=2048", FormatId::kDots3Swa, 1, 128, 2048, 0, 0.0303f, false, false, -1, 0.0, 8};
    DeviceProblem d1 = make_problem(pr1, &dots3, nullptr, 65);
    for (int splits : {4, 8}) {
      run_case(d1, decode_plan(32, 2048, splits), {0}, 15);
      run_case(d1, on_hopper(decode_plan(64, 2048, splits)), {0}, 15);
    }
    release(d1);
    cudaFree(dots3.device);
    HostCache cache = build_cache(format_traits(FormatId::kDsv32), 4096, 64, 656, 64 * 656, 1, fp8);
    Problem prd{"dsv3_2 T=128 H=128 k=513", FormatId::kDsv32, 128, 128, 513, 0, 0.0417f, false, false, -1, 0.0, 4};
    DeviceProblem dd = make_problem(prd, &cache, nullptr, 66);
    run_case(dd, on_hopper(Plan{2, 64}), {0, 37, 127}, 15);
    run_case(dd, on_hopper(decode_plan(64, 513, 1)), {0, 37, 127}, 15);
    release(dd);
    cudaFree(cache.device);
    return print_timed_rows();
  }
  if (mode == "--profile" || mode == "--headline" || mode == "--ablate") {
    const bool profile = mode == "--profile";
    const bool ablate = mode == "--ablate";  // only the dsv3_2 H=128 rows
    const Fp8Table fp8;
    HostCache cache = build_cache(format_traits(FormatId::kDsv32), 4096, 64, 656, 64 * 656, 1, fp8);
    Problem pr{"dsv3_2 T=128 H=128 k=2048", FormatId::kDsv32, 128, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
    DeviceProblem d = make_problem(pr, &cache, nullptr, 14);
    for (const Plan& plan : {decode_plan(64, 2048, 1), Plan{2, 64}}) {
      if (profile) {
        run_case(d, g_hopper_device ? on_hopper(plan) : plan, {0}, 0);
      } else {
        run_case(d, on_hopper(plan), {0, 37, 127}, 15);
      }
    }
    release(d);
    if (profile) return g_failed ? 1 : 0;
    if (!ablate) {  // glm_nsa (FP32 scales per group) on the same shape: its time per FLOP beside dsv3_2's
      const FormatTraits& f = format_traits(FormatId::kGlmNsa);
      HostCache glm = build_cache(f, 4096, 64, 656, 64 * 656, 1, fp8);
      Problem prg{"glm_nsa T=128 H=128 k=2048", FormatId::kGlmNsa, 128, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
      DeviceProblem dg = make_problem(prg, &glm, nullptr, 22);
      run_case(dg, on_hopper(decode_plan(64, 2048, 1)), {0, 37, 127}, 15);
      run_case(dg, on_hopper(Plan{2, 64}), {0, 37, 127}, 15);
      release(dg);
      cudaFree(glm.device);
    }
    if (!ablate) {  // bf16_576 (no conversion: the producer only copies) on the same shape and in prefill
      const FormatTraits& f = format_traits(FormatId::kBf16_576);
      HostCache bf16 = build_cache(f, 4096, 64, 1152, 64 * 1152, 9, fp8);
      Problem prb{"bf16_576 T=128 H=128 k=2048", FormatId::kBf16_576, 128, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
      DeviceProblem db = make_problem(prb, &bf16, nullptr, 23);
      run_case(db, on_hopper(decode_plan(64, 2048, 1)), {0, 37, 127}, 15);
      release(db);
      Problem prbp{"bf16_576 prefill T=4096 H=128", FormatId::kBf16_576, 4096, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 2};
      DeviceProblem dbp = make_problem(prbp, &bf16, nullptr, 24);
      run_case(dbp, on_hopper(Plan{2, 64}), {0, 4095}, 5);
      release(dbp);
      cudaFree(bf16.device);
    }
    if (!ablate) {  // small batches
      Problem pr1{"dsv3_2 T=1 H=128 k=2048", FormatId::kDsv32, 1, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 8};
      DeviceProblem d1 = make_problem(pr1, &cache, nullptr, 15);
      for (int splits : {16, 32, 64}) {
        run_case(d1, on_hopper(decode_plan(64, 2048, splits)), {0}, 15);
        run_case(d1, serial_combine(on_hopper(decode_plan(64, 2048, splits))), {0}, 15);
      }
      // The planner's pick at this shape: 16 splits of 128 candidates on 16-head tiles (both families').
      run_case(d1, decode_plan(16, 2048, 16), {0}, 15);
      release(d1);
      Problem pr1h16{"dsv3_2 T=1 H=16 k=2048", FormatId::kDsv32, 1, 16, 2048, 0, 0.0417f, false, false, -1, 0.0, 8};
      DeviceProblem d1h16 = make_problem(pr1h16, &cache, nullptr, 19);
      for (int splits : {16, 32, 64}) {
        run_case(d1h16, decode_plan(16, 2048, splits), {0}, 15);
        run_case(d1h16, serial_combine(decode_plan(16, 2048, splits)), {0}, 15);
      }
      release(d1h16);
      // A 16-head tensor-parallel shard at T = 128 (the portable tile; kernels/cuda/NOTES.md: its pace is the
      // per-tile chain of four warps, not the bytes in flight).
      Problem pr128h16{"dsv3_2 T=128 H=16 k=2048", FormatId::kDsv32, 128, 16, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
      DeviceProblem d128h16 = make_problem(pr128h16, &cache, nullptr, 25);
      for (int splits : {2, 4}) run_case(d128h16, decode_plan(16, 2048, splits), {0, 127}, 15);
      release(d128h16);
    }
    Problem prp{"dsv3_2 prefill T=4096 H=128", FormatId::kDsv32, 4096, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 2};
    DeviceProblem dp = make_problem(prp, &cache, nullptr, 18);
    run_case(dp, on_hopper(Plan{2, 64}), {0, 4095}, 5);
    release(dp);
    return print_timed_rows();
  }
  const bool quick = mode == "--quick" || sanitize;
  std::printf("device: %s (sm_%d%d, %d SMs, L2 %d MB)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  std::printf("hopper family: %s\n", g_hopper_device ? "yes" : "no");
  std::printf("kernels:");
  for (const cuda::KernelShape& k : cuda::kKernelShapes) {
    std::printf(" [%s fmt%d h%d %dthr %dB]", k.family == cuda::Family::kHopper ? "hopper" : "portable",
                static_cast<int>(k.format), k.heads_per_block, k.threads, k.shared_bytes);
  }
  std::printf("\n");
  const Fp8Table fp8;
  const int reps = quick ? 0 : 15;
  check_dequantization();
  check_ue8m0_scales();
  check_fp4_dequantization();

  // ---- dsv3_2: the headline shape, 262144-token pool (172 MB), page 64 ----
  {
    const FormatTraits& f = format_traits(FormatId::kDsv32);
    HostCache cache = build_cache(f, sanitize ? 64 : 4096, 64, 656, 64 * 656, 1, fp8);
    if (!sanitize) {
      Problem pr{"dsv3_2 T=8 H=128 k=2048 sink+len", FormatId::kDsv32, 8, 128, 2048, 0, 0.0417f, true, true, 7};
      DeviceProblem d = make_problem(pr, &cache, nullptr, 11);
      run_case(d, decode_plan(64, 2048, 4), all_tokens(8), 0);
      run_case(d, decode_plan(64, 2048, 1), all_tokens(8), 0);
      run_case(d, Plan{2, 64}, all_tokens(8), 0);
      run_case(d, on_hopper(decode_plan(64, 2048, 4)), all_tokens(8), 0);
      run_case(d, on_hopper(decode_plan(64, 2048, 1)), all_tokens(8), 0);
      run_case(d, on_hopper(Plan{2, 64}), all_tokens(8), 0);
      run_case(d, decode_plan(16, 2048, 3), all_tokens(8), 0);
      run_case(d, Plan{2, 16}, all_tokens(8), 0);
      release(d);
    }
    {
      Problem pr{"dsv3_2 T=5 H=20 k=100 scale=.3", FormatId::kDsv32, 5, 20, 100, 0, 0.3f, false, false, -1, 0.1};
      DeviceProblem d = make_problem(pr, &cache, nullptr, 12);
      run_case(d, decode_plan(16, 100, 3), all_tokens(5), 0);
      run_case(d, Plan{2, 16}, all_tokens(5), 0);
      run_case(d, Plan{2, 64}, all_tokens(5), 0);
      run_case(d, decode_plan(64, 100, 4), all_tokens(5), 0);
      run_case(d, on_hopper(Plan{2, 64}), all_tokens(5), 0);
      run_case(d, on_hopper(decode_plan(64, 100, 4)), all_tokens(5), 0);
      release(d);
    }
    {  // two head tiles, the second ragged (36 heads); one and several tiles a split
      Problem pr{"dsv3_2 T=6 H=100 k=300 sink+len", FormatId::kDsv32, 6, 100, 300, 0, 0.0417f, true, true, 5, 0.1};
      DeviceProblem d = make_problem(pr, &cache, nullptr, 111);
      run_case(d, on_hopper(decode_plan(64, 300, 10)), all_tokens(6), 0);
      run_case(d, on_hopper(decode_plan(64, 300, 2)), all_tokens(6), 0);
      run_case(d, on_hopper(Plan{2, 64}), all_tokens(6), 0);
      run_case(d, Plan{2, 64}, all_tokens(6), 0);
      release(d);
    }
    {
      Problem pr{"dsv3_2 T=3 H=1 k=1", FormatId::kDsv32, 3, 1, 1, 0, 0.0417f, false, true, -1, 0.0};
      DeviceProblem d = make_problem(pr, &cache, nullptr, 13);
      run_case(d, decode_plan(16, 1, 1), all_tokens(3), 0);
      run_case(d, Plan{2, 16}, all_tokens(3), 0);
      release(d);
    }
    if (!quick) {
      Problem pr{"dsv3_2 T=128 H=128 k=2048", FormatId::kDsv32, 128, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
      DeviceProblem d = make_problem(pr, &cache, nullptr, 14);
      const std::vector<int64_t> sample = {0, 37, 127};
      run_case(d, decode_plan(64, 2048, 1), sample, reps);
      run_case(d, decode_plan(64, 2048, 2), sample, reps);
      run_case(d, Plan{2, 64}, sample, reps);
      run_case(d, on_hopper(decode_plan(64, 2048, 1)), sample, reps);
      run_case(d, on_hopper(decode_plan(64, 2048, 2)), sample, reps);
      run_case(d, on_hopper(Plan{2, 64}), sample, reps);
      run_case(d, Plan{2, 16}, sample, reps);
      release(d);
      Problem pr1{"dsv3_2 T=1 H=128 k=2048", FormatId::kDsv32, 1, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 8};
      DeviceProblem d1 = make_problem(pr1, &cache, nullptr, 15);
      for (int splits : {16, 32, 64}) run_case(d1, decode_plan(64, 2048, splits), {0}, reps);
      for (int splits : {8, 16, 32, 64}) run_case(d1, on_hopper(decode_plan(64, 2048, splits)), {0}, reps);
      run_case(d1, decode_plan(16, 2048, 16), {0}, reps);
      release(d1);
      Problem pr64{"dsv3_2 T=64 H=64 k=2048", FormatId::kDsv32, 64, 64, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
      DeviceProblem d64 = make_problem(pr64, &cache, nullptr, 16);
      run_case(d64, decode_plan(64, 2048, 4), {5}, reps);
      run_case(d64, on_hopper(decode_plan(64, 2048, 1)), {5}, reps);
      run_case(d64, on_hopper(decode_plan(64, 2048, 4)), {5}, reps);
      release(d64);
      Problem pr16{"dsv3_2 T=128 H=16 k=2048", FormatId::kDsv32, 128, 16, 2048, 0, 0.0417f, false, false, -1, 0.0, 4};
      DeviceProblem d16 = make_problem(pr16, &cache, nullptr, 17);
      run_case(d16, decode_plan(16, 2048, 2), {9}, reps);
      run_case(d16, on_hopper(decode_plan(64, 2048, 1)), {9}, reps);
      run_case(d16, on_hopper(decode_plan(64, 2048, 2)), {9}, reps);
      release(d16);
      // Small batches: one user, a 16-head tensor-parallel shard, a few speculative tokens.
      Problem pr1h16{"dsv3_2 T=1 H=16 k=2048", FormatId::kDsv32, 1, 16, 2048, 0, 0.0417f, false, false, -1, 0.0, 8};
      DeviceProblem d1h16 = make_problem(pr1h16, &cache, nullptr, 19);
      for (int splits : {16, 32, 64}) run_case(d1h16, decode_plan(16, 2048, splits), {0}, reps);
      for (int splits : {32, 64}) run_case(d1h16, on_hopper(decode_plan(64, 2048, splits)), {0}, reps);
      release(d1h16);
      Problem pr16h128{"dsv3_2 T=16 H=128 k=2048", FormatId::kDsv32, 16, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 8};
      DeviceProblem d16h128 = make_problem(pr16h128, &cache, nullptr, 20);
      for (int splits : {2, 4, 8}) run_case(d16h128, on_hopper(decode_plan(64, 2048, splits)), {0, 15}, reps);
      release(d16h128);
      Problem prp{"dsv3_2 prefill T=4096 H=128", FormatId::kDsv32, 4096, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 2};
      DeviceProblem dp = make_problem(prp, &cache, nullptr, 18);
      run_case(dp, Plan{2, 64}, {0, 4095}, 3);
      run_case(dp, on_hopper(Plan{2, 64}), {0, 4095}, 3);
      run_case(dp, Plan{2, 16}, {0, 4095}, 3);
      release(dp);
    }
    cudaFree(cache.device);
  }

  // ---- dsv3_2 and dsv4 with scales on both sides of the loader's bit-path limit (see build_cache), and
  // glm_nsa's arbitrary scales spread as widely (FP8 codes at both ends of their range) ----
  if (!sanitize) {
    for (FormatId id : {FormatId::kDsv32, FormatId::kDsv4, FormatId::kGlmNsa}) {
      const FormatTraits& f = format_traits(id);
      const bool dsv4 = id == FormatId::kDsv4;
      const std::string name = id == FormatId::kDsv32 ? "dsv3_2" : dsv4 ? "dsv4" : "glm_nsa";
      HostCache cache = build_cache(f, 64, 64, dsv4 ? 576 : 656, 64 * (dsv4 ? 584 : 656), 19, fp8, true);
      Problem pr{name + " T=4 H=64 k=512 wide scales", id, 4, 64, 512, 0, 0.0417f, false, false};
      DeviceProblem d = make_problem(pr, &cache, nullptr, 91);
      run_case(d, decode_plan(64, 512, 2), all_tokens(4), 0);
      run_case(d, Plan{2, 16}, all_tokens(4), 0);
      run_case(d, on_hopper(decode_plan(64, 512, 2)), all_tokens(4), 0);
      run_case(d, on_hopper(Plan{2, 64}), all_tokens(4), 0);
      release(d);
      // 128 heads: two head tiles.
      Problem pr128{name + " T=4 H=128 k=512 wide scales", id, 4, 128, 512, 0, 0.0417f, false, false};
      DeviceProblem d128 = make_problem(pr128, &cache, nullptr, 92);
      run_case(d128, on_hopper(decode_plan(64, 512, 2)), all_tokens(4), 0);
      run_case(d128, on_hopper(Plan{2, 64}), all_tokens(4), 0);
      release(d128);
      cudaFree(cache.device);
    }
  }
  // ---- glm_nsa: arbitrary FP32 scales, 2-D pages with a gap ----
  if (!sanitize) {
    const FormatTraits& f = format_traits(FormatId::kGlmNsa);
    HostCache cache = build_cache(f, 64, 64, 656, 64 * 656 + 48, 2, fp8);
    Problem pr{"glm_nsa T=6 H=64 k=512 gap", FormatId::kGlmNsa, 6, 64, 512, 0, 0.0417f, true, false};
    DeviceProblem d = make_problem(pr, &cache, nullptr, 21);
    run_on_both_families(d, decode_plan(64, 512, 3), all_tokens(6));
    release(d);
    cudaFree(cache.device);
  }
  // ---- glm53_nope: legacy 656-byte padded rows (padding is 0xff), odd page size ----
  if (!sanitize) {
    const FormatTraits& f = format_traits(FormatId::kGlm53Nope);
    HostCache cache = build_cache(f, 200, 3, 656, 3 * 656, 3, fp8);
    Problem pr{"glm53_nope T=4 H=16 k=300 pad", FormatId::kGlm53Nope, 4, 16, 300, 0, 0.0442f, false, true};
    DeviceProblem d = make_problem(pr, &cache, nullptr, 31);
    run_case(d, decode_plan(16, 300, 2), all_tokens(4), 0);
    run_case(d, Plan{2, 16}, all_tokens(4), 0);
    run_case(d, on_hopper(decode_plan(64, 300, 2)), all_tokens(4), 0);  // 16 heads in a 64-head tile
    run_case(d, on_hopper(Plan{2, 64}), all_tokens(4), 0);
    release(d);
    cudaFree(cache.device);
  }
  // ---- dsv4: footer pages + extra cache with its own page size ----
  {
    const FormatTraits& f = format_traits(FormatId::kDsv4);
    HostCache cache = build_cache(f, 64, 64, 576, 64 * 584, 4, fp8);
    HostCache extra = build_cache(f, 100, 2, 576, 2 * 584, 5, fp8);
    Problem pr{"dsv4 T=5 H=64 k=512+128 len", FormatId::kDsv4, 5, 64, 512, 128, 0.0442f, true, true, 4};
    DeviceProblem d = make_problem(pr, &cache, &extra, 41);
    run_on_both_families(d, decode_plan(64, 640, 3), all_tokens(5));
    run_case(d, Plan{2, 16}, all_tokens(5), 0);
    release(d);
    // 128 heads: two head tiles with the extra list.
    Problem pr128{"dsv4 T=5 H=128 k=512+128 len", FormatId::kDsv4, 5, 128, 512, 128, 0.0442f, true, true, 4};
    DeviceProblem d128 = make_problem(pr128, &cache, &extra, 42);
    run_on_both_families(d128, decode_plan(64, 640, 3), all_tokens(5));
    release(d128);
    cudaFree(cache.device);
    cudaFree(extra.device);
  }
  // ---- dsv4_1: 16 UE8M0 groups of 32, odd page size in the 2-D form (page bytes padded to 16) ----
  if (!sanitize) {
    const FormatTraits& f = format_traits(FormatId::kDsv41);
    HostCache cache = build_cache(f, 300, 3, 512, 3 * 528 + 16, 6, fp8);
    Problem pr{"dsv4_1 T=4 H=128 k=700", FormatId::kDsv41, 4, 128, 700, 0, 0.0442f, false, true};
    DeviceProblem d = make_problem(pr, &cache, nullptr, 51);
    run_on_both_families(d, decode_plan(64, 700, 5), all_tokens(4));
    release(d);
    cudaFree(cache.device);
  }
  // ---- dots3_swa: 513-candidate window ----
  {
    const FormatTraits& f = format_traits(FormatId::kDots3Swa);
    HostCache cache = build_cache(f, 64, 64, 1152, 64 * 1160, 7, fp8);
    Problem pr{"dots3_swa T=4 H=32 k=1024 window", FormatId::kDots3Swa, 4, 32, 1024, 0, 0.0303f, true, false};
    DeviceProblem d = make_problem(pr, &cache, nullptr, 61);
    run_case(d, decode_plan(32, 1024, 4), all_tokens(4), 0);
    run_case(d, Plan{2, 32}, all_tokens(4), 0);
    run_case(d, Plan{2, 16}, all_tokens(4), 0);
    // The Hopper-only 64-head tile (a two-block cluster splitting every row's lanes): 32 of its heads masked.
    run_case(d, on_hopper(decode_plan(64, 1024, 4)), all_tokens(4), 0);
    run_case(d, on_hopper(Plan{2, 64}), all_tokens(4), 0);
    release(d);
    Problem pr7{"dots3_swa T=3 H=7 k=600", FormatId::kDots3Swa, 3, 7, 600, 0, 0.0303f, false, true};
    DeviceProblem d7 = make_problem(pr7, &cache, nullptr, 62);
    run_case(d7, decode_plan(16, 600, 2), all_tokens(3), 0);
    run_case(d7, on_hopper(decode_plan(64, 600, 2)), all_tokens(3), 0);
    release(d7);
    if (!sanitize) {  // two head tiles, a sink, lengths, one split and a split of one candidate tile
      Problem pr2{"dots3_swa T=2 H=128 k=1024 sink+len", FormatId::kDots3Swa, 2, 128, 1024, 0, 0.0303f, true, true};
      DeviceProblem d2 = make_problem(pr2, &cache, nullptr, 63);
      run_case(d2, on_hopper(decode_plan(64, 1024, 1)), all_tokens(2), 0);
      run_case(d2, on_hopper(decode_plan(64, 1024, 16)), all_tokens(2), 0);
      run_case(d2, on_hopper(Plan{2, 64}), all_tokens(2), 0);
      release(d2);
    }
    cudaFree(cache.device);
  }
  // ---- bf16 caches ----
  if (!sanitize) {
    const FormatTraits& f = format_traits(FormatId::kBf16_576);
    HostCache cache = build_cache(f, 20000, 1, 1152, 1152, 8, fp8);
    Problem pr{"bf16_576 T=4 H=64 k=256", FormatId::kBf16_576, 4, 64, 256, 0, 0.0417f, false, true};
    DeviceProblem d = make_problem(pr, &cache, nullptr, 71);
    run_on_both_families(d, decode_plan(64, 256, 2), all_tokens(4));
    run_on_both_families(d, decode_plan(64, 256, 1), all_tokens(4));  // 8 tiles a split: the pipeline refills
    release(d);
    cudaFree(cache.device);
    if (!quick) {
      HostCache big = build_cache(f, 4096, 64, 1152, 64 * 1152, 9, fp8);
      Problem prp{"bf16_576 prefill T=4096 H=128", FormatId::kBf16_576, 4096, 128, 2048, 0, 0.0417f, false, false, -1, 0.0, 2};
      DeviceProblem dp = make_problem(prp, &big, nullptr, 72);
      run_case(dp, Plan{2, 64}, {1, 4000}, 3);
      run_case(dp, on_hopper(Plan{2, 64}), {1, 4000}, 3);
      release(dp);
      cudaFree(big.device);
    }
  }
  {
    const FormatTraits& f = format_traits(FormatId::kBf16_512);
    HostCache cache = build_cache(f, 500, 8, 1024, 8 * 1024, 10, fp8);
    Problem pr{"bf16_512 T=3 H=1 k=77", FormatId::kBf16_512, 3, 1, 77, 0, 0.0442f, true, false};
    DeviceProblem d = make_problem(pr, &cache, nullptr, 81);
    run_case(d, decode_plan(16, 77, 2), all_tokens(3), 0);
    run_case(d, Plan{2, 16}, all_tokens(3), 0);
    run_case(d, on_hopper(decode_plan(64, 77, 2)), all_tokens(3), 0);
    run_case(d, on_hopper(Plan{2, 64}), all_tokens(3), 0);
    release(d);
    cudaFree(cache.device);
  }

  std::printf("\n%-34s %-30s %-5s %9s %8s %8s %10s %8s\n", "case", "plan", "ok", "max_abs", "relL2", "lse_err", "us",
              "TFLOP/s");
  for (const Row& r : g_rows) {
    std::printf("%-34s %-30s %-5s %9.2e %8.1e %8.1e %10.1f %8.1f\n", r.name.c_str(), r.plan.c_str(),
                r.errors.ok() && r.deterministic ? "PASS" : "FAIL", r.errors.max_abs, r.errors.rel_l2(),
                r.errors.max_lse, r.micros, r.tflops);
  }
  std::printf("%s\n", g_failed ? "SOME CHECKS FAILED" : "ALL CHECKS PASSED");
  return g_failed ? 1 : 0;
}
