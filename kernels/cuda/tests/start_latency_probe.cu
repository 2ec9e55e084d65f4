// What a block's first microseconds cost on this GPU, apart from our kernels: how long straight-line
// code takes the first time a launch runs it (instruction fetch), against the same code run again and
// against a loop of the same dynamic length, against pieces of code reached through jumps in layout
// order and in a scattered order, and how long a block waits for its first kernel parameter (constant
// bank) and its first global word. Each case is one launch of G blocks of 256 threads; thread 0 of
// every block records clock64 deltas; the table gives medians over the blocks.
//
// Orders of a case's launch: "after other" (a different small kernel ran just before), "again" (the
// same kernel ran just before), "L2 cold" (a write of four times the L2 came just before).
//
// Build and run from the repository root (sm_90a):
//   nvcc -std=c++17 -O3 -arch=sm_90a kernels/cuda/tests/start_latency_probe.cu -o /tmp/start_latency_probe \
//       && /tmp/start_latency_probe
// Exit status 0 when every launch's results equal the host's (the arithmetic is checked, so the
// compiler cannot have dropped it).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <string>
#include <vector>

#include "check_cuda.h"

constexpr int kPieces = 16;  // pieces of the jump kernel

struct Params {  // eight 64-byte lines, then the pointers and the jump kernel's order
  float line[8][16];
  const float* global_word;
  long long* clocks;  // [block][4]
  float* result;      // [block][thread]
  int order[kPieces]; // the jump kernel's piece order (a permutation)
};

__device__ __forceinline__ long long clock_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
  return static_cast<long long>(t);
}
// A branch on `v` (whose other side sleeps for no time): the warp waits for v before going on.
__device__ __forceinline__ void wait_for(float v) {
  if (__float_as_uint(v) == 0x9e3779b9u) asm volatile("nanosleep.u32 0;");
}
// 0, as a value the compiler cannot see through, produced after the volatile statements before it.
__device__ __forceinline__ int opaque_zero() {
  int z;
  asm volatile("mov.u32 %0, 0;" : "=r"(z));
  return z;
}

// Four independent FMA chains, kInstructions FMAs in all, every immediate different (no folding).
template <int kInstructions, bool kRolled>
__global__ void __launch_bounds__(256) code_kernel(const __grid_constant__ Params p) {
  const long long t0 = clock_now();
  float x0 = p.line[0][(threadIdx.x & 15) + opaque_zero()];
  wait_for(x0);
  const long long t1 = clock_now();
  x0 += static_cast<float>(opaque_zero());  // the chains start after t1
  float x1 = x0 + 1.0f, x2 = x0 + 2.0f, x3 = x0 + 3.0f;
  if constexpr (kRolled) {
#pragma unroll 1
    for (int r = 0; r < kInstructions / 64; ++r) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        x0 = fmaf(x0, 0.999f, 1e-6f * (i + 1));
        x1 = fmaf(x1, 0.998f, 2e-6f * (i + 1));
        x2 = fmaf(x2, 0.997f, 3e-6f * (i + 1));
        x3 = fmaf(x3, 0.996f, 4e-6f * (i + 1));
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < kInstructions / 4; ++i) {
      x0 = fmaf(x0, 0.999f, 1e-6f * (i % 16 + 1) + 1e-9f * i);
      x1 = fmaf(x1, 0.998f, 2e-6f * (i % 16 + 1) + 1e-9f * i);
      x2 = fmaf(x2, 0.997f, 3e-6f * (i % 16 + 1) + 1e-9f * i);
      x3 = fmaf(x3, 0.996f, 4e-6f * (i % 16 + 1) + 1e-9f * i);
    }
  }
  const float sum = x0 + x1 + x2 + x3;
  wait_for(sum);
  const long long t2 = clock_now();
  if (threadIdx.x == 0) {
    p.clocks[blockIdx.x * 4 + 0] = t1 - t0;  // first parameter arrived
    p.clocks[blockIdx.x * 4 + 1] = t2 - t1;  // the code
  }
  p.result[blockIdx.x * 256 + threadIdx.x] = sum;
}

// The jump kernel's code: kPieces pieces of straight code, kPerPiece FMAs each over four chains, every
// immediate unique to its piece and position (no folding, no two pieces alike), run in the order p.order
// through a switch: each piece ends in a jump to the next one's code wherever it lies, as a kernel's
// roles and phases jump between parts of a large instance. The same pieces in layout order and in a
// scattered order, against the straight code above of the same size, tell whether jumps cost fetch time.
__host__ __device__ constexpr float piece_add(int piece, int i, int chain) {
  return 1e-6f * (chain + 1) * (i % 16 + 1) + 1e-9f * i + 1e-7f * piece;
}
template <int kPiece, int kPerPiece>
__device__ __forceinline__ void run_piece(float (&x)[4]) {
#pragma unroll
  for (int i = 0; i < kPerPiece / 4; ++i) {
#pragma unroll
    for (int c = 0; c < 4; ++c) x[c] = fmaf(x[c], 0.999f - 0.001f * c, piece_add(kPiece, i, c));
  }
}
template <int kPerPiece>
__global__ void __launch_bounds__(256) jump_kernel(const __grid_constant__ Params p) {
  const long long t0 = clock_now();
  float x0 = p.line[0][(threadIdx.x & 15) + opaque_zero()];
  wait_for(x0);
  const long long t1 = clock_now();
  x0 += static_cast<float>(opaque_zero());
  float x[4] = {x0, x0 + 1.0f, x0 + 2.0f, x0 + 3.0f};
#pragma unroll 1
  for (int k = 0; k < kPieces; ++k) {
    switch (p.order[k]) {
#define JSMLA_PIECE(n) \
  case n:              \
    run_piece<n, kPerPiece>(x); \
    break;
      JSMLA_PIECE(0) JSMLA_PIECE(1) JSMLA_PIECE(2) JSMLA_PIECE(3) JSMLA_PIECE(4) JSMLA_PIECE(5) JSMLA_PIECE(6)
      JSMLA_PIECE(7) JSMLA_PIECE(8) JSMLA_PIECE(9) JSMLA_PIECE(10) JSMLA_PIECE(11) JSMLA_PIECE(12)
      JSMLA_PIECE(13) JSMLA_PIECE(14) JSMLA_PIECE(15)
#undef JSMLA_PIECE
      default:
        break;
    }
  }
  static_assert(kPieces == 16, "the switch above has sixteen cases");
  const float sum = x[0] + x[1] + x[2] + x[3];
  wait_for(sum);
  const long long t2 = clock_now();
  if (threadIdx.x == 0) {
    p.clocks[blockIdx.x * 4 + 0] = t1 - t0;
    p.clocks[blockIdx.x * 4 + 1] = t2 - t1;
  }
  p.result[blockIdx.x * 256 + threadIdx.x] = sum;
}

// The first parameter, then a parameter of another line, then a global word, each waited for.
__global__ void __launch_bounds__(256) start_kernel(const __grid_constant__ Params p) {
  const long long t0 = clock_now();
  const float a = p.line[0][opaque_zero()];
  wait_for(a);
  const long long t1 = clock_now();
  const float b = p.line[5][3 + opaque_zero()] + a;
  wait_for(b);
  const long long t2 = clock_now();
  const float c = p.global_word[opaque_zero()] + b;
  wait_for(c);
  const long long t3 = clock_now();
  if (threadIdx.x == 0) {
    p.clocks[blockIdx.x * 4 + 0] = t1 - t0;
    p.clocks[blockIdx.x * 4 + 1] = t2 - t1;
    p.clocks[blockIdx.x * 4 + 2] = t3 - t2;
  }
  p.result[blockIdx.x * 256 + threadIdx.x] = c;
}

__global__ void other_kernel(float* x) {
  if (threadIdx.x == 0) x[blockIdx.x] += 1.0f;
}

template <int kInstructions, bool kRolled>
float host_sum(float x0) {
  float x[4] = {x0, x0 + 1.0f, x0 + 2.0f, x0 + 3.0f};
  const float m[4] = {0.999f, 0.998f, 0.997f, 0.996f};
  for (int i = 0; i < kInstructions / 4; ++i) {
    for (int c = 0; c < 4; ++c) {
      const float add = kRolled ? (c + 1) * 1e-6f * (i % 16 + 1) : (c + 1) * 1e-6f * (i % 16 + 1) + 1e-9f * i;
      x[c] = std::fmaf(x[c], m[c], add);
    }
  }
  return x[0] + x[1] + x[2] + x[3];
}

struct Probe {
  Params p{};
  long long* d_clocks = nullptr;
  float* d_result = nullptr;
  float* d_other = nullptr;
  float* d_word = nullptr;
  void* d_flush = nullptr;
  size_t flush_bytes = 0;
  Probe() {
    for (int l = 0; l < 8; ++l)
      for (int i = 0; i < 16; ++i) p.line[l][i] = 0.5f + 0.01f * i + l;
    CHECK_CUDA(cudaMalloc(&d_clocks, 1024 * 4 * sizeof(long long)));
    CHECK_CUDA(cudaMalloc(&d_result, 1024 * 256 * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&d_other, 1024 * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&d_word, sizeof(float)));
    const float word = 3.0f;
    CHECK_CUDA(cudaMemcpy(d_word, &word, sizeof(float), cudaMemcpyHostToDevice));
    int l2 = 0;
    CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
    flush_bytes = 4 * static_cast<size_t>(l2);
    CHECK_CUDA(cudaMalloc(&d_flush, flush_bytes));
    p.global_word = d_word;
    p.clocks = d_clocks;
    p.result = d_result;
  }
  // Median over blocks of clock slot `slot`, launching `launch` after `order`.
  template <typename Launch>
  std::vector<long long> run(Launch launch, int blocks, const char* order) {
    const std::string o = order;
    if (o == "again") launch();
    if (o == "after other") {
      launch();
      other_kernel<<<blocks, 32>>>(d_other);
    }
    if (o == "L2 cold") CHECK_CUDA(cudaMemsetAsync(d_flush, 1, flush_bytes));
    launch();
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<long long> c(blocks * 4);
    CHECK_CUDA(cudaMemcpy(c.data(), d_clocks, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    return c;
  }
};

long long median_slot(const std::vector<long long>& c, int blocks, int slot) {
  std::vector<long long> v;
  for (int b = 0; b < blocks; ++b) v.push_back(c[b * 4 + slot]);
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

bool g_ok = true;

// The cells of a code case's row: for each launch order, the median over five launches of the blocks'
// median cycles for the code (and per FMA); then every thread's result checked against `expect(x0)`.
template <typename Launch, typename Expect>
void code_row(Probe& probe, int blocks, int fmas, Launch launch, Expect expect) {
  for (const char* order : {"again", "after other", "L2 cold"}) {
    std::vector<long long> med;
    for (int rep = 0; rep < 5; ++rep) med.push_back(median_slot(probe.run(launch, blocks, order), blocks, 1));
    std::sort(med.begin(), med.end());
    std::printf(" %lld (%.2f) |", med[2], static_cast<double>(med[2]) / fmas);
  }
  std::vector<float> r(blocks * 256);
  CHECK_CUDA(cudaMemcpy(r.data(), probe.d_result, r.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < r.size(); ++i) {
    const float v = r[i], e = expect(probe.p.line[0][i % 256 & 15]);
    if (std::fabs(v - e) > 1e-3f * std::fabs(e)) {
      g_ok = false;
      std::printf(" MISMATCH %g vs %g", v, e);
      break;
    }
  }
  std::printf("\n");
}

template <int kInstructions, bool kRolled>
void code_case(Probe& probe, int blocks) {
  std::printf("| %s %d FMAs (%d KB of FMAs) | %d |", kRolled ? "loop of 64," : "straight,", kInstructions,
              kRolled ? 1 : kInstructions * 16 / 1024, blocks);
  code_row(probe, blocks, kInstructions, [&] { code_kernel<kInstructions, kRolled><<<blocks, 256>>>(probe.p); },
           [](float x0) { return host_sum<kInstructions, kRolled>(x0); });
}

template <int kPerPiece>
float host_jump_sum(float x0, const int (&order)[kPieces]) {
  float x[4] = {x0, x0 + 1.0f, x0 + 2.0f, x0 + 3.0f};
  for (int k = 0; k < kPieces; ++k) {
    for (int i = 0; i < kPerPiece / 4; ++i) {
      for (int c = 0; c < 4; ++c) x[c] = std::fmaf(x[c], 0.999f - 0.001f * c, piece_add(order[k], i, c));
    }
  }
  return x[0] + x[1] + x[2] + x[3];
}

// The jump kernel in layout order (piece k at step k) and scattered (piece 7k mod 16 at step k).
template <int kPerPiece>
void jump_case(Probe& probe, int blocks, bool scattered) {
  for (int k = 0; k < kPieces; ++k) probe.p.order[k] = scattered ? (7 * k) % kPieces : k;
  const int total = kPieces * kPerPiece;
  std::printf("| %d pieces of %d FMAs (%d KB of FMAs), %s | %d |", kPieces, kPerPiece, total * 16 / 1024,
              scattered ? "scattered order" : "layout order", blocks);
  code_row(probe, blocks, total, [&] { jump_kernel<kPerPiece><<<blocks, 256>>>(probe.p); },
           [&](float x0) { return host_jump_sum<kPerPiece>(x0, probe.p.order); });
}

int main() {
  Probe probe;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs\n\n", prop.name, prop.multiProcessorCount);
  std::printf("Code: median cycles over the blocks for the FMAs (cycles per FMA), by launch order\n\n");
  std::printf("| code | blocks | again | after other | L2 cold |\n|---|---|---|---|---|\n");
  for (int blocks : {1, 64, 128}) {
    code_case<512, false>(probe, blocks);
    code_case<2048, false>(probe, blocks);
    code_case<8192, false>(probe, blocks);
    code_case<8192, true>(probe, blocks);
    jump_case<128>(probe, blocks, false);
    jump_case<128>(probe, blocks, true);
    // Between 36 and 134 KB of code (an instance of 67 KB: does it stay cached?)
    jump_case<256>(probe, blocks, false);
    jump_case<384>(probe, blocks, false);
    jump_case<512>(probe, blocks, false);
    jump_case<512>(probe, blocks, true);
  }
  std::printf("\nA block's first words: median cycles over the blocks, by launch order\n\n");
  std::printf("| blocks | order | first parameter | a parameter of another line | a global word |\n|---|---|---|---|---|\n");
  for (int blocks : {1, 64, 128}) {
    for (const char* order : {"again", "after other", "L2 cold"}) {
      std::vector<long long> m[3];
      for (int rep = 0; rep < 5; ++rep) {
        auto c = probe.run([&] { start_kernel<<<blocks, 256>>>(probe.p); }, blocks, order);
        for (int s = 0; s < 3; ++s) m[s].push_back(median_slot(c, blocks, s));
      }
      std::printf("| %d | %s |", blocks, order);
      for (auto& v : m) {
        std::sort(v.begin(), v.end());
        std::printf(" %lld |", v[2]);
      }
      std::printf("\n");
    }
  }
  std::vector<float> r(128 * 256);
  CHECK_CUDA(cudaMemcpy(r.data(), probe.d_result, r.size() * sizeof(float), cudaMemcpyDeviceToHost));
  const float expect = probe.p.line[0][0] + probe.p.line[5][3] + 3.0f;
  for (float v : r) g_ok = g_ok && v == expect;
  std::printf("\nstart_latency_probe: %s\n", g_ok ? "results checked" : "RESULT MISMATCH");
  return g_ok ? 0 : 1;
}
