// PTX wrappers of the Hopper family (sm_90a only): shared-memory matrix descriptors, the wgmma
// shapes the kernels issue, wgmma fences and groups, the generic→async proxy fence, register
// reallocation, and the cluster pieces of the lane-sliced tile (transaction barriers, stores into the
// other block's shared memory, the cluster barrier). Every wrapper is `asm volatile`, so the compiler keeps their order. Also the swizzled
// operand layout both Hopper kernels write Q in, and their Q copy into it.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_utils.cuh"

// 1 while compiling device code for sm_90a (wgmma, setmaxnreg); the kernels are empty elsewhere.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JSMLA_HOPPER_DEVICE 1
#else
#define JSMLA_HOPPER_DEVICE 0
#endif

namespace jsmla::cuda::hopper {

// Descriptor of a shared-memory operand in a swizzled layout: the 128-byte one (atoms of 8 rows of
// 128 bytes, 1024-byte aligned; the 16-byte chunk c of row r at c ^ (r % 8)) or the 64-byte one (atoms
// of 8 rows of 64 bytes, 512-byte aligned; chunk c of row r at c ^ ((r / 2) % 4)). K-major: `leading`
// is unused, `stride` is the byte distance between 8-row groups. MN-major: `leading` is the byte
// distance between 64-element column blocks, `stride` the distance between 8-row groups along K. Kept
// as two 32-bit halves: moving the start address by `bytes` only adds bytes >> 4 to the low half (the
// 14-bit address field of a shared-memory address never carries into the next field), one
// instruction where a 64-bit add takes two, and the halves stay in uniform registers when the address
// is warp-uniform.
struct SmemDescriptor {
  uint32_t lo;  // start address >> 4, leading byte offset >> 4 (bits 16..29)
  uint32_t hi;  // stride byte offset >> 4, swizzle mode (bits 30..31: 1 = 128 B, 2 = 64 B)

  JSMLA_DEVICE SmemDescriptor offset(uint32_t bytes) const { return SmemDescriptor{lo + (bytes >> 4), hi}; }
};

enum class Swizzle : uint32_t { k128B = 1, k64B = 2 };

// The start address is taken from lane 0 (every lane of the warp must call it with the same `start`; all
// callers are warpgroup-wide wgmma code): ptxas then knows the descriptor is the same in every lane and
// builds it, and each wgmma's offset of it, in uniform registers (one UIADD3 and one UMOV a wgmma).
// From the per-lane pointer it built them in vector registers and moved every one into uniform
// registers before its wgmma (R2UR: 196 in the bf16_576 64-head instance, 39 this way).
JSMLA_DEVICE SmemDescriptor smem_descriptor(const void* start, uint32_t leading, uint32_t stride,
                                            Swizzle swizzle = Swizzle::k128B) {
  const uint32_t address = __shfl_sync(0xffffffffu, shared_address(start), 0);
  return SmemDescriptor{((address & 0x3FFFF) >> 4) | (((leading & 0x3FFFF) >> 4) << 16),
                        ((stride & 0x3FFFF) >> 4) | (static_cast<uint32_t>(swizzle) << 30)};
}

// Byte offset of BF16 element `dim` of row `row` in a 128-byte swizzled operand of `rows` rows (dim % 8 == 0):
// 64-column blocks of rows × 128 bytes; the 16-byte chunk c of row r sits at chunk c ^ (r % 8).
JSMLA_DEVICE int swizzled_offset(int row, int dim, int rows) {
  return (dim / 64) * rows * 128 + row * 128 + ((((dim % 64) / 8) ^ (row % 8)) * 16);
}

// Copies the Q rows [head_begin, head_begin + kRows) of `token` (rows past num_heads are zero) into a
// 128-byte swizzled operand at q_smem with kThreads threads (`thread` of them), every 16-byte chunk's
// cp.async in flight at once (one round trip; the handler checks that q is 16-byte aligned), and waits
// for this thread's copies. The caller then fences them into the async proxy and meets the other
// copying threads at a barrier. kSlices > 1 (lane slices, config.h): q rows are kRowDqk wide (kSlices
// runs of quantized lanes, then the trailing BF16 lanes) and the operand is lane slice `slice` of them:
// the slice's quantized lanes, then the trailing lanes in slice 0 (in every slice with kSplitTrailing,
// where each block multiplies its share of them) and zeros in the others.
template <int kRows, int kDqk, int kThreads, int kSlices = 1, int kRowDqk = kDqk, bool kSplitTrailing = false>
JSMLA_DEVICE void copy_q_rows(uint8_t* q_smem, const uint16_t* q, int64_t token, int num_heads, int head_begin,
                              int thread, int slice = 0) {
  constexpr int kChunksPerRow = kDqk / 8;
  constexpr int kChunksPerThread = kRows * kChunksPerRow / kThreads;
  static_assert(kRows * kChunksPerRow % kThreads == 0, "every copying thread copies as many Q chunks");
  static_assert(kSlices == 1 ? kRowDqk == kDqk : (kRowDqk - kDqk) % (kSlices - 1) == 0,
                "a row is kSlices equal runs of quantized lanes and the trailing lanes");
  constexpr int kQuantLanes = kSlices == 1 ? kDqk : (kRowDqk - kDqk) / (kSlices - 1);  // a slice's
  static_assert(kQuantLanes % 8 == 0 && kQuantLanes <= kDqk, "a 16-byte chunk lies in one run of lanes");
  // q's column of operand column `dim` (a multiple of 8), or -1 for a zero chunk.
  auto source_dim = [&](int dim) {
    if constexpr (kSlices == 1) {
      return dim;
    } else {
      return dim < kQuantLanes ? slice * kQuantLanes + dim
                               : (slice == 0 || kSplitTrailing ? kSlices * kQuantLanes + (dim - kQuantLanes) : -1);
    }
  };
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) {
    const int c = thread + i * kThreads;
    const int row = c / kChunksPerRow;
    const int dim = (c % kChunksPerRow) * 8;
    const int head = head_begin + row;
    uint8_t* const chunk = q_smem + swizzled_offset(row, dim, kRows);
    const int from = source_dim(dim);
    if (head < num_heads && (kSlices == 1 || from >= 0)) {
      cp_async_16(chunk, q + (token * num_heads + head) * kRowDqk + from);
    } else {
      *reinterpret_cast<uint4*>(chunk) = make_uint4(0, 0, 0, 0);
    }
  }
  cp_async_commit();
  cp_async_wait_all();
}

JSMLA_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
JSMLA_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
JSMLA_DEVICE void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Waits until at most kPending of this warp's most recent wgmma groups are still in flight.
template <int kPending>
JSMLA_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accesses of accumulator registers across wgmma fences and waits.
template <int kCount>
JSMLA_DEVICE void fence_registers(float (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// The same for A fragments in registers: an in-flight wgmma reads them, so they stay live (and
// unchanged) until a wait that covers it, where this fence is placed.
template <int kCount>
JSMLA_DEVICE void fence_registers(uint32_t (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Makes generic-proxy shared-memory writes visible to wgmma (the async proxy): this thread's, and those
// of other threads ordered before it by a barrier it has waited on (the fence is then on every path from
// those writes to the wgmma that reads them). The tiles converted by the producers are fenced that way,
// by their consumers after the full-barrier wait: executed by a producer with its next tile's copies in
// flight, the fence took about 360 cycles instead of 50 (kernels/cuda/tests/fence_probe.cu, H100).
JSMLA_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Register reallocation between warpgroups (all warps of the warpgroup execute it).
template <int kRegisters>
JSMLA_DEVICE void increase_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
JSMLA_DEVICE void decrease_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// d[64x32] (+)= A[64x16] · B[16x32]: A and B in shared memory, both K-major, BF16 in, FP32 accumulators.
JSMLA_DEVICE void wgmma_m64n32k16_ss(float (&d)[16], SmemDescriptor a, SmemDescriptor b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %20, 0;\n"
      "mov.b64 da, {%16, %17};\nmov.b64 db, {%18, %19};\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, da, db, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a.lo), "r"(a.hi), "r"(b.lo), "r"(b.hi), "r"(accumulate));
}

// d[64x16] (+)= A[64x16] · B[16x16], both in shared memory, B K-major; A K-major (kTransposeA = 0) or
// MN-major (1). The 16-head tile's Sᵀ = K·Qᵀ (A = K) and Oᵀ = Vᵀ·Pᵀ (A = Vᵀ, the tile read MN-major).
template <int kTransposeA>
JSMLA_DEVICE void wgmma_m64n16k16_ss(float (&d)[8], SmemDescriptor a, SmemDescriptor b, int accumulate) {
  static_assert(kTransposeA == 0 || kTransposeA == 1, "A is K-major or MN-major");
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %12, 0;\n"
      "mov.b64 da, {%8, %9};\nmov.b64 db, {%10, %11};\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, da, db, p, 1, 1, %13, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a.lo), "r"(a.hi), "r"(b.lo), "r"(b.hi), "r"(accumulate), "n"(kTransposeA));
}

// The FP32 accumulators of an m64n256 (128 a thread) and an m64n128 (64) wgmma: their register list in
// the instruction text and their operand list (shared by the register- and shared-memory-A forms).
#define JSMLA_WGMMA_REGISTERS_0_63 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define JSMLA_WGMMA_REGISTERS_64_127 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define JSMLA_WGMMA_D128_REGISTERS "{" JSMLA_WGMMA_REGISTERS_0_63 ", " JSMLA_WGMMA_REGISTERS_64_127 "}"
#define JSMLA_WGMMA_D64_REGISTERS "{" JSMLA_WGMMA_REGISTERS_0_63 "}"
#define JSMLA_WGMMA_D8(d, i)                                                                                    \
  "+f"(d[(i) + 0]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), \
      "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define JSMLA_WGMMA_D64_AT(d, i)                                                                            \
  JSMLA_WGMMA_D8(d, (i) + 0), JSMLA_WGMMA_D8(d, (i) + 8), JSMLA_WGMMA_D8(d, (i) + 16), JSMLA_WGMMA_D8(d, (i) + 24), \
      JSMLA_WGMMA_D8(d, (i) + 32), JSMLA_WGMMA_D8(d, (i) + 40), JSMLA_WGMMA_D8(d, (i) + 48), JSMLA_WGMMA_D8(d, (i) + 56)
#define JSMLA_WGMMA_D64(d) JSMLA_WGMMA_D64_AT(d, 0)
#define JSMLA_WGMMA_D128(d) JSMLA_WGMMA_D64_AT(d, 0), JSMLA_WGMMA_D64_AT(d, 64)

// d[64x64] (+)= A[64x16] · B[16x64]: A and B in shared memory, both K-major, BF16 in, FP32 accumulators.
JSMLA_DEVICE void wgmma_m64n64k16_ss(float (&d)[32], SmemDescriptor a, SmemDescriptor b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %36, 0;\n"
      "mov.b64 da, {%32, %33};\nmov.b64 db, {%34, %35};\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, da, db, "
      "p, 1, 1, 0, 0;\n}\n"
      : JSMLA_WGMMA_D8(d, 0), JSMLA_WGMMA_D8(d, 8), JSMLA_WGMMA_D8(d, 16), JSMLA_WGMMA_D8(d, 24)
      : "r"(a.lo), "r"(a.hi), "r"(b.lo), "r"(b.hi), "r"(accumulate));
}

// S over one candidate tile: the m64n32 or m64n64 shape by the tile's width.
template <int kCount>
JSMLA_DEVICE void wgmma_score_ss(float (&d)[kCount], SmemDescriptor a, SmemDescriptor b, int accumulate) {
  static_assert(kCount == 16 || kCount == 32, "S tiles are 32 or 64 candidates wide");
  if constexpr (kCount == 16) {
    wgmma_m64n32k16_ss(d, a, b, accumulate);
  } else {
    wgmma_m64n64k16_ss(d, a, b, accumulate);
  }
}

// d[64x256] += A[64x16] · B[16x256]: A in registers (the m16n8k16 A-fragment layout per warp), B in
// shared memory MN-major (transposed), BF16 in, FP32 accumulators.
JSMLA_DEVICE void wgmma_m64n256k16_rs(float (&d)[128], const uint32_t (&a)[4], SmemDescriptor b) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 db;\nsetp.ne.b32 p, %134, 0;\nmov.b64 db, {%132, %133};\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " JSMLA_WGMMA_D128_REGISTERS ", {%128, %129, %130, %131}, db, p, 1, 1, 1;\n}\n"
      : JSMLA_WGMMA_D128(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.lo), "r"(b.hi), "r"(1));
}

// d[64x256] += A[64x16] · B[16x256]: A in shared memory K-major, B in shared memory MN-major
// (transposed), BF16 in, FP32 accumulators.
JSMLA_DEVICE void wgmma_m64n256k16_ss(float (&d)[128], SmemDescriptor a, SmemDescriptor b) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %132, 0;\nmov.b64 da, {%128, %129};\nmov.b64 db, {%130, %131};\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " JSMLA_WGMMA_D128_REGISTERS ", da, db, p, 1, 1, 0, 1;\n}\n"
      : JSMLA_WGMMA_D128(d)
      : "r"(a.lo), "r"(a.hi), "r"(b.lo), "r"(b.hi), "r"(1));
}

// d[64x128] += A[64x16] · B[16x128]: A in registers, B in shared memory MN-major (the exact-scale
// formats' P·V, one scale group of V columns per call).
JSMLA_DEVICE void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], SmemDescriptor b) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 db;\nsetp.ne.b32 p, %70, 0;\nmov.b64 db, {%68, %69};\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " JSMLA_WGMMA_D64_REGISTERS ", {%64, %65, %66, %67}, db, p, 1, 1, 1;\n}\n"
      : JSMLA_WGMMA_D64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.lo), "r"(b.hi), "r"(1));
}

// d[64x128] += A[64x16] · B[16x128]: A in shared memory K-major, B in shared memory MN-major.
JSMLA_DEVICE void wgmma_m64n128k16_ss(float (&d)[64], SmemDescriptor a, SmemDescriptor b) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %68, 0;\nmov.b64 da, {%64, %65};\nmov.b64 db, {%66, %67};\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " JSMLA_WGMMA_D64_REGISTERS ", da, db, p, 1, 1, 0, 1;\n}\n"
      : JSMLA_WGMMA_D64(d)
      : "r"(a.lo), "r"(a.hi), "r"(b.lo), "r"(b.hi), "r"(1));
}

// d[64xN] (+)= A[64x16] · B[16xN] with both operands in shared memory MN-major (transposed: A's 64 rows
// and B's N columns contiguous, 128-byte swizzled), BF16 in, FP32 accumulators; N = 128 or 192 (64 or 96
// accumulators a thread). The cache gradient's partial rows (backward/partials_wgmma.cuh).
#define JSMLA_WGMMA_REGISTERS_64_95 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
JSMLA_DEVICE void wgmma_m64n192k16_ss_mn(float (&d)[96], SmemDescriptor a, SmemDescriptor b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %100, 0;\nmov.b64 da, {%96, %97};\nmov.b64 db, {%98, %99};\n"
      "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {" JSMLA_WGMMA_REGISTERS_0_63 ", " JSMLA_WGMMA_REGISTERS_64_95
      "}, da, db, p, 1, 1, 1, 1;\n}\n"
      : JSMLA_WGMMA_D64_AT(d, 0), JSMLA_WGMMA_D8(d, 64), JSMLA_WGMMA_D8(d, 72), JSMLA_WGMMA_D8(d, 80), JSMLA_WGMMA_D8(d, 88)
      : "r"(a.lo), "r"(a.hi), "r"(b.lo), "r"(b.hi), "r"(accumulate));
}
JSMLA_DEVICE void wgmma_m64n128k16_ss_mn(float (&d)[64], SmemDescriptor a, SmemDescriptor b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, %68, 0;\nmov.b64 da, {%64, %65};\nmov.b64 db, {%66, %67};\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " JSMLA_WGMMA_D64_REGISTERS ", da, db, p, 1, 1, 1, 1;\n}\n"
      : JSMLA_WGMMA_D64(d)
      : "r"(a.lo), "r"(a.hi), "r"(b.lo), "r"(b.hi), "r"(accumulate));
}
template <int kCount>
JSMLA_DEVICE void wgmma_ss_mn(float (&d)[kCount], SmemDescriptor a, SmemDescriptor b, int accumulate) {
  static_assert(kCount == 64 || kCount == 96, "N = 128 or 192 columns");
  if constexpr (kCount == 96) {
    wgmma_m64n192k16_ss_mn(d, a, b, accumulate);
  } else {
    wgmma_m64n128k16_ss_mn(d, a, b, accumulate);
  }
}

// ---- clusters (the lane-sliced tile, config.h: hopper_lane_slices) ----

// This block's rank in its cluster.
JSMLA_DEVICE uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

// The shared::cluster address of `local` (this block's shared memory) in block `rank`'s shared memory.
JSMLA_DEVICE uint32_t cluster_address(const void* local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(shared_address(local)), "r"(rank));
  return remote;
}

// Every thread of the cluster's blocks that has not exited arrives, then waits for the others: release
// and acquire order this block's shared-memory writes (barrier initialisation included) before the
// other block's accesses.
JSMLA_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// A transaction barrier (an mbarrier in this block's shared memory) expecting `arrivals` arrivals a
// phase; the initialisation is made visible to the cluster (before a cluster_sync).
JSMLA_DEVICE void transaction_barrier_init(uint64_t* barrier, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(arrivals) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival at `barrier` that also expects `bytes` more bytes of stores this phase (they may have
// landed already: the phase completes once every arrival is in and every expected byte has landed).
JSMLA_DEVICE void transaction_barrier_arrive_expect(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
}

// Waits until the phase of `barrier` with parity `parity` has completed (its stores are then visible).
JSMLA_DEVICE void transaction_barrier_wait(uint64_t* barrier, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(shared_address(barrier)),
      "r"(parity)
      : "memory");
}

// Stores 16 bytes at shared::cluster address `remote` (another block's shared memory) and counts them
// on that block's transaction barrier at shared::cluster address `remote_barrier`.
JSMLA_DEVICE void store_remote_async(uint32_t remote, float4 value, uint32_t remote_barrier) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                   remote),
               "f"(value.x), "f"(value.y), "f"(value.z), "f"(value.w), "r"(remote_barrier)
               : "memory");
}

}  // namespace jsmla::cuda::hopper
