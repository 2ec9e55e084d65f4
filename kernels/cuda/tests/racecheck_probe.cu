// Whether compute-sanitizer's racecheck models the counted named barriers the Hopper kernels hand data
// over with. One block of 384 threads in three warpgroups, as in the Hopper family: warpgroup 0 (the
// producer's place) never touches the shared array; warpgroup 1 writes slot[b] for step i (b = i % 2),
// warpgroup 2 reads it after both have passed the hand-over for b, and warpgroup 1 writes slot[b] again
// at step i + 2, after both have passed the hand-over for b ^ 1 at step i + 1 (the scorer's row
// factors and the second consumer, hopper/sparse_mla_kernel.cuh). Modes:
//   counted   named_barrier_sync(id, 256), the kernels' non-aligned barrier.sync with a thread count;
//   cluster   `counted` in each block of a two-block cluster (the lane-sliced Hopper tile's launch: its
//             blocks' hand-overs are these, inside each block);
//   exchange  `cluster`, and before each hand-over warpgroup 1 of each block receives 16 bytes a thread
//             from the other block (st.async into this block's buffer b, counted on its transaction
//             barrier b; the lane-sliced tile's score exchange) and folds them into the value it writes;
//   pipeline  `counted`, inside the kernels' full/empty cycle: each step warpgroup 0 arrives on a `full`
//             barrier that warpgroup 1 syncs on before its write, and warpgroups 1 and 2 arrive on an
//             `empty` barrier that warpgroup 0 syncs on after their accesses (the producer's hand-overs,
//             which the kernels mix with the counted syncs of the row factors);
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
#include "kernels/cuda/hopper/wgmma.cuh"

namespace {

enum class Mode { kCounted, kAligned, kArrive, kBlock, kNone, kCluster, kExchange, kPipeline };
constexpr int kSteps = 16;
constexpr int kRows = 64;

__device__ void hand_over(Mode mode, int b) {
  switch (mode) {
    case Mode::kCounted:
    case Mode::kPipeline:
    case Mode::kCluster:
    case Mode::kExchange:
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
  // kExchange: the other block's step number, received every step (exact: it is this block's too).
  __shared__ __align__(16) float exchange[2][128 * 4];
  __shared__ __align__(8) uint64_t arrived[2];
  namespace hopper = jsmla::cuda::hopper;
  if (mode == Mode::kExchange) {
    if (threadIdx.x == 0) {
      hopper::transaction_barrier_init(&arrived[0], 1);
      hopper::transaction_barrier_init(&arrived[1], 1);
    }
    hopper::cluster_sync();
  }
  for (int i = 0; i < kSteps; ++i) {
    const int b = i & 1;
    constexpr int kFull = 10, kEmpty = 12;  // + b
    if (mode == Mode::kPipeline) {
      if (group == 0) {
        jsmla::cuda::named_barrier_arrive(kFull + b, 256);
        jsmla::cuda::named_barrier_sync(kEmpty + b, 384);
        continue;
      }
      if (group == 1) jsmla::cuda::named_barrier_sync(kFull + b, 256);
    }
    float received = static_cast<float>(i);
    if (mode == Mode::kExchange && group == 1) {
      if (t == 0) hopper::transaction_barrier_arrive_expect(&arrived[b], 128 * 16);
      const uint32_t other = hopper::cluster_rank() ^ 1u;
      const float step = static_cast<float>(i);
      hopper::store_remote_async(hopper::cluster_address(&exchange[b][4 * t], other), make_float4(step, step, step, step),
                                 hopper::cluster_address(&arrived[b], other));
      hopper::transaction_barrier_wait(&arrived[b], (i >> 1) & 1);
      received = exchange[b][4 * t + 3];
    }
    if (group == 1 && t % 2 == 0) slot[b][t / 2] = static_cast<float>(i * kRows + t / 2) + (received - static_cast<float>(i));
    if (mode == Mode::kBlock) {
      __syncthreads();
    } else if (group > 0) {
      hand_over(mode, b);
    }
    if (group == 2) sum += slot[b][t / 2];
    if (mode == Mode::kBlock) __syncthreads();  // the reads of slot[b] before its next write
    if (mode == Mode::kPipeline) jsmla::cuda::named_barrier_arrive(kEmpty + b, 384);
  }
  if (group == 2) sums[blockIdx.x * 128 + t] = sum;
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
  } else if (!std::strcmp(name, "pipeline")) {
    mode = Mode::kPipeline;
  } else if (!std::strcmp(name, "cluster")) {
    mode = Mode::kCluster;
  } else if (!std::strcmp(name, "exchange")) {
    mode = Mode::kExchange;
  } else {
    std::fprintf(stderr, "mode: counted, pipeline, aligned, arrive, block, none, cluster or exchange (got %s)\n", name);
    return 2;
  }
  const bool clustered = mode == Mode::kCluster || mode == Mode::kExchange;
  const int blocks = clustered ? 2 : 1;
  float* sums = nullptr;
  if (cudaMalloc(&sums, blocks * 128 * sizeof(float)) != cudaSuccess) return 1;
  if (clustered) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(2);
    config.blockDim = dim3(384);
    cudaLaunchAttribute attribute = {};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = 2;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    if (cudaLaunchKernelEx(&config, probe, mode, sums) != cudaSuccess) return 1;
  } else {
    probe<<<1, 384>>>(mode, sums);
  }
  float host[256];
  if (cudaMemcpy(host, sums, blocks * 128 * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
    std::fprintf(stderr, "%s: launch failed: %s\n", name, cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  cudaFree(sums);
  int wrong = 0;
  for (int t = 0; t < blocks * 128 && mode != Mode::kNone; ++t) {
    float want = 0.0f;
    for (int i = 0; i < kSteps; ++i) want += static_cast<float>(i * kRows + t % 128 / 2);
    wrong += host[t] != want;
  }
  std::printf("racecheck_probe %s: %s\n", name, mode == Mode::kNone ? "ran (values not checked)" : wrong ? "WRONG VALUES" : "values right");
  return wrong ? 1 : 0;
}
