// Whether compute-sanitizer's racecheck models the counted named barriers the Hopper kernels hand data
// over with. One block of 384 threads in three warpgroups, as in the Hopper family: warpgroup 0 (the
// producer's place) never touches the shared array; warpgroup 1 writes slot[b] for step i (b = i % 2),
// warpgroup 2 reads it after both have passed the hand-over for b, and warpgroup 1 writes slot[b] again
// at step i + 2, after both have passed the hand-over for b ^ 1 at step i + 1 (the scorer's row
// factors and the second consumer, hopper/sparse_mla_kernel.cuh). Modes:
//   counted   named_barrier_sync(id, 256), the kernels' non-aligned barrier.sync with a thread count;
//   aligned   bar.sync id, 256 (the aligned form);
//   arrive    one slot handed back and forth by arrive/sync pairs, the 64-head kernel's one-P-buffer
//             path (its row_rescale): warpgroup 1 waits on `free` (from step 1), writes, arrives on
//             `ready`; warpgroup 2 waits on `ready`, reads, arrives on `free` (bar.arrive orders the
//             arriving thread's earlier accesses before the waiters' later ones, PTX memory model);
//   block     __syncthreads() for every hand-over (all 384 threads): racecheck must report nothing;
//   none      no hand-over at all, a real race: racecheck must report it (the tool sees races here).
// The program checks the values read (except with `none`) and exits 0 when they are right.
//
//   nvcc -std=c++17 -O3 -arch=sm_90a -I. kernels/cuda/tests/racecheck_probe.cu -o racecheck_probe
//   compute-sanitizer --tool racecheck ./racecheck_probe counted
#include <cstdio>
#include <cstring>

#include <cuda_runtime.h>

#include "kernels/cuda/device_utils.cuh"

namespace {

enum class Mode { kCounted, kAligned, kArrive, kBlock, kNone };
constexpr int kSteps = 16;
constexpr int kRows = 64;

__device__ void hand_over(Mode mode, int b) {
  switch (mode) {
    case Mode::kCounted:
      jsmla::cuda::named_barrier_sync(6 + b, 256);
      break;
    case Mode::kAligned:
      __syncwarp();
      asm volatile("bar.sync %0, %1;\n" ::"r"(6 + b), "r"(256) : "memory");
      break;
    default:
      break;
  }
}

__global__ void __launch_bounds__(384, 1) probe(Mode mode, float* sums) {
  __shared__ float slot[2][kRows];
  const int group = threadIdx.x / 128;
  const int t = threadIdx.x % 128;
  float sum = 0.0f;
  if (mode == Mode::kArrive) {
    constexpr int kReady = 6, kFree = 7;
    for (int i = 0; i < kSteps; ++i) {
      if (group == 1) {
        if (i > 0) jsmla::cuda::named_barrier_sync(kFree, 256);
        if (t % 2 == 0) slot[0][t / 2] = static_cast<float>(i * kRows + t / 2);
        jsmla::cuda::named_barrier_arrive(kReady, 256);
      } else if (group == 2) {
        jsmla::cuda::named_barrier_sync(kReady, 256);
        sum += slot[0][t / 2];
        if (i + 1 < kSteps) jsmla::cuda::named_barrier_arrive(kFree, 256);
      }
    }
    if (group == 2) sums[t] = sum;
    return;
  }
  for (int i = 0; i < kSteps; ++i) {
    const int b = i & 1;
    if (group == 1 && t % 2 == 0) slot[b][t / 2] = static_cast<float>(i * kRows + t / 2);
    if (mode == Mode::kBlock) {
      __syncthreads();
    } else if (group > 0) {
      hand_over(mode, b);
    }
    if (group == 2) sum += slot[b][t / 2];
    if (mode == Mode::kBlock) __syncthreads();  // the reads of slot[b] before its next write
  }
  if (group == 2) sums[t] = sum;
}

}  // namespace

int main(int argc, char** argv) {
  const char* name = argc > 1 ? argv[1] : "counted";
  Mode mode;
  if (!std::strcmp(name, "counted")) {
    mode = Mode::kCounted;
  } else if (!std::strcmp(name, "aligned")) {
    mode = Mode::kAligned;
  } else if (!std::strcmp(name, "arrive")) {
    mode = Mode::kArrive;
  } else if (!std::strcmp(name, "block")) {
    mode = Mode::kBlock;
  } else if (!std::strcmp(name, "none")) {
    mode = Mode::kNone;
  } else {
    std::fprintf(stderr, "mode: counted, aligned, arrive, block or none (got %s)\n", name);
    return 2;
  }
  float* sums = nullptr;
  if (cudaMalloc(&sums, 128 * sizeof(float)) != cudaSuccess) return 1;
  probe<<<1, 384>>>(mode, sums);
  float host[128];
  if (cudaMemcpy(host, sums, sizeof(host), cudaMemcpyDeviceToHost) != cudaSuccess) {
    std::fprintf(stderr, "%s: launch failed: %s\n", name, cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  cudaFree(sums);
  int wrong = 0;
  for (int t = 0; t < 128 && mode != Mode::kNone; ++t) {
    float want = 0.0f;
    for (int i = 0; i < kSteps; ++i) want += static_cast<float>(i * kRows + t / 2);
    wrong += host[t] != want;
  }
  std::printf("racecheck_probe %s: %s\n", name, mode == Mode::kNone ? "ran (values not checked)" : wrong ? "WRONG VALUES" : "values right");
  return wrong ? 1 : 0;
}
