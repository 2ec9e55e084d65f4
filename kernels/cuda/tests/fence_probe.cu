// What the producers' proxy fence costs on this GPU: `fence.proxy.async.shared::cta` (which compiles to
// MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S on sm_90a) after a thread's shared-memory stores, with and
// without that thread's global → shared copies (cp.async) or global loads still in flight, against the
// time those copies take to land. The cost measured here with copies in flight is why the Hopper kernels
// fence a converted tile in its consumers, after their wait, not in its producers, whose next tile's
// copies are then in flight (hopper/wgmma.cuh: fence_proxy_async_shared).
//
// One launch of G blocks of 128 threads a case. Every thread copies (or loads) kCopies 16-byte units of
// its own 1 KB row of a buffer four times the L2 (a fresh region each launch, so the copies go to DRAM),
// stores one unit to shared memory, then: t0, the instruction under test, t1, waits for its copies, t2.
// Thread 0 of every block records t1 - t0 (the instruction) and t2 - t0 (to the copies' landing); the
// table gives medians over blocks and five launches.
//
// Build and run from the repository root (sm_90a):
//   nvcc -std=c++17 -O3 -arch=sm_90a kernels/cuda/tests/fence_probe.cu -o /tmp/fence_probe && /tmp/fence_probe
// Exit status 0 when every launch's sums equal the host's (the copies are used, so none was dropped).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check_cuda.h"

constexpr int kThreads = 128;
constexpr int kCopies = 4;        // 16-byte units a thread has in flight (a producer's share of a row)
constexpr int kRowBytes = 1024;   // each thread's units lie in its own row
static_assert(kCopies * 16 <= kRowBytes, "a thread's units must fit its row");

enum Mode : int {
  kNothingInFlight = 0,  // no copies at all: the fence alone
  kCopiesThenFence,      // cp.async in flight, then fence.proxy.async.shared::cta
  kCopiesThenCtaFence,   // cp.async in flight, then fence.acq_rel.cta (the generic fence alone)
  kCopiesThenNothing,    // cp.async in flight, no fence: t1 - t0 is the clock's own cost
  kLoadsThenFence,       // ld.global into registers in flight, then fence.proxy.async.shared::cta
  kModes
};
const char* kModeNames[kModes] = {
    "fence.proxy.async, nothing in flight",
    "fence.proxy.async, cp.async in flight",
    "fence.acq_rel.cta, cp.async in flight",
    "no fence, cp.async in flight",
    "fence.proxy.async, ld.global in flight",
};

__device__ __forceinline__ long long clock_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
  return static_cast<long long>(t);
}

__global__ void __launch_bounds__(kThreads) fence_kernel(const uint8_t* __restrict__ src, long long* clocks,
                                                         unsigned* sums, int mode) {
  __shared__ __align__(16) uint4 staged[kCopies][kThreads];
  __shared__ __align__(16) uint4 tile[kThreads];
  const uint8_t* row = src + (static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x) * kRowBytes;
  uint4 loaded[kCopies];
  if (mode == kLoadsThenFence) {
#pragma unroll
    for (int u = 0; u < kCopies; ++u) {
      asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(loaded[u].x), "=r"(loaded[u].y), "=r"(loaded[u].z), "=r"(loaded[u].w)
                   : "l"(row + 16 * u));
    }
  } else if (mode != kNothingInFlight) {
#pragma unroll
    for (int u = 0; u < kCopies; ++u) {
      const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(&staged[u][threadIdx.x]));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(row + 16 * u) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  tile[threadIdx.x] = make_uint4(threadIdx.x, blockIdx.x, mode, 1);  // the generic store a fence orders
  const long long t0 = clock_now();
  switch (mode) {
    case kNothingInFlight:
    case kCopiesThenFence:
    case kLoadsThenFence:
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      break;
    case kCopiesThenCtaFence:
      asm volatile("fence.acq_rel.cta;" ::: "memory");
      break;
    default:
      break;
  }
  const long long t1 = clock_now();
  unsigned sum = tile[(threadIdx.x + 1) % kThreads].x;
  if (mode == kLoadsThenFence) {
#pragma unroll
    for (int u = 0; u < kCopies; ++u) sum += loaded[u].x + loaded[u].y + loaded[u].z + loaded[u].w;
  } else if (mode != kNothingInFlight) {
    asm volatile("cp.async.wait_all;" ::: "memory");
#pragma unroll
    for (int u = 0; u < kCopies; ++u) {
      const uint4 v = staged[u][threadIdx.x];
      sum += v.x + v.y + v.z + v.w;
    }
  }
  const long long t2 = clock_now();  // after the sum: the copies have landed and been read
  if (threadIdx.x == 0) {
    clocks[blockIdx.x * 2 + 0] = t1 - t0;
    clocks[blockIdx.x * 2 + 1] = t2 - t0;
  }
  sums[blockIdx.x * kThreads + threadIdx.x] = sum;
}

int main() {
  int l2 = 0, sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int block_counts[] = {1, sms};
  const int max_blocks = sms;
  const size_t region = static_cast<size_t>(max_blocks) * kThreads * kRowBytes;
  const int regions = static_cast<int>((4 * static_cast<size_t>(l2) + region - 1) / region) + 1;
  const size_t bytes = region * regions;
  // Every 16-byte word a thread reads: its four 32-bit lanes are (region, block, thread, unit) mixed.
  std::vector<uint32_t> host(bytes / 4);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint32_t>(i * 2654435761u);
  uint8_t* d_src = nullptr;
  long long* d_clocks = nullptr;
  unsigned* d_sums = nullptr;
  CHECK_CUDA(cudaMalloc(&d_src, bytes));
  CHECK_CUDA(cudaMemcpy(d_src, host.data(), bytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&d_clocks, max_blocks * 2 * sizeof(long long)));
  CHECK_CUDA(cudaMalloc(&d_sums, max_blocks * kThreads * sizeof(unsigned)));
  std::printf("device: %s (%d SMs, L2 %d MB); %d units of 16 bytes in flight a thread, %d threads a block\n\n",
              prop.name, sms, l2 >> 20, kCopies, kThreads);
  std::printf("| case | blocks | t1 - t0: the instruction (cycles) | t2 - t0: to the copies read (cycles) |\n");
  std::printf("|---|---|---|---|\n");
  bool ok = true;
  int launch = 0;
  for (int mode = 0; mode < kModes; ++mode) {
    for (int blocks : block_counts) {
      std::vector<long long> fence_med, land_med;
      for (int rep = 0; rep < 5; ++rep, ++launch) {
        const int r = launch % regions;
        const uint8_t* src = d_src + static_cast<size_t>(r) * region;
        fence_kernel<<<blocks, kThreads>>>(src, d_clocks, d_sums, mode);
        CHECK_CUDA(cudaGetLastError());
        CHECK_CUDA(cudaDeviceSynchronize());
        std::vector<long long> c(blocks * 2);
        std::vector<unsigned> s(blocks * kThreads);
        CHECK_CUDA(cudaMemcpy(c.data(), d_clocks, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(s.data(), d_sums, s.size() * sizeof(unsigned), cudaMemcpyDeviceToHost));
        for (int b = 0; b < blocks; ++b) {
          for (int t = 0; t < kThreads; ++t) {
            unsigned expect = (t + 1) % kThreads;  // the neighbour's tile store
            if (mode != kNothingInFlight) {
              const size_t word = (static_cast<size_t>(r) * region +
                                   (static_cast<size_t>(b) * kThreads + t) * kRowBytes) / 4;
              for (int w = 0; w < 4 * kCopies; ++w) expect += host[word + w];
            }
            if (s[b * kThreads + t] != expect) ok = false;
          }
        }
        std::vector<long long> f, l;
        for (int b = 0; b < blocks; ++b) {
          f.push_back(c[2 * b]);
          l.push_back(c[2 * b + 1]);
        }
        std::nth_element(f.begin(), f.begin() + f.size() / 2, f.end());
        std::nth_element(l.begin(), l.begin() + l.size() / 2, l.end());
        fence_med.push_back(f[f.size() / 2]);
        land_med.push_back(l[l.size() / 2]);
      }
      std::sort(fence_med.begin(), fence_med.end());
      std::sort(land_med.begin(), land_med.end());
      std::printf("| %s | %d | %lld (%lld–%lld) | %lld (%lld–%lld) |\n", kModeNames[mode], blocks, fence_med[2],
                  fence_med[0], fence_med[4], land_med[2], land_med[0], land_med[4]);
    }
  }
  std::printf("\nsums %s\n", ok ? "match the host's" : "DIFFER from the host's");
  return ok ? 0 : 1;
}
