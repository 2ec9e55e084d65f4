// Thin device wrappers around the PTX the CUDA kernels use (sm_80+): asynchronous copies, ldmatrix,
// BF16 mma.sync, named barriers, the exp2 approximation and uncached loads. Every wrapper is
// `asm volatile`, so the compiler keeps its order relative to the others: a load issued before a run
// of MMAs stays in flight across them.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>
#include <type_traits>
#include <utility>

#define JSMLA_DEVICE __device__ __forceinline__

namespace jsmla::cuda {

// Calls f(std::integral_constant<int, i>{}) for i = 0 .. kCount - 1, in order: a loop whose index
// must be a compile-time constant in every iteration (wgmma register operands, descriptor offsets)
// whatever the unroller decides.
template <class F, int... kIndex>
JSMLA_DEVICE void static_for_each(F&& f, std::integer_sequence<int, kIndex...>) {
  (f(std::integral_constant<int, kIndex>{}), ...);
}
template <int kCount, class F>
JSMLA_DEVICE void static_for(F&& f) {
  static_for_each(f, std::make_integer_sequence<int, kCount>{});
}

JSMLA_DEVICE uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes global → shared, bypassing L1 (gathered KV rows are read once per block). The first copy to
// miss in L2 brings 256 bytes of its row into L2, so the row's other copies (issued by other threads a few
// cycles later) hit there: on small-T decode 1-4% faster than no prefetch, up to 3% than 128 bytes.
JSMLA_DEVICE void cp_async_16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(shared_address(shared)), "l"(global));
}

// 8 bytes global → shared through L1 (footer scale rows are 8 bytes; neighbours share the line).
JSMLA_DEVICE void cp_async_8(void* shared, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(shared_address(shared)), "l"(global));
}

JSMLA_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until every copy this thread issued has landed; the data is then visible to this thread only.
JSMLA_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Waits until at most kPending of this thread's cp.async groups are still in flight.
template <int kPending>
JSMLA_DEVICE void cp_async_wait_pending() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Synchronises `thread_count` threads (whole warps) on barrier `id` (0 is __syncthreads). The
// non-aligned barrier.sync: correct even where the compiler has not reconverged a warp that took
// lane-dependent branches (bar.sync, the aligned form, requires a converged warp; compute-sanitizer's
// synccheck found warps arriving divergent at the Hopper kernels' bar.sync although __syncwarp() came
// first). Same speed at the headline shapes. __syncwarp() stays: it orders the warp's memory accesses.
JSMLA_DEVICE void named_barrier_sync(int id, int thread_count) {
  __syncwarp();
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(thread_count) : "memory");
}

// Signals barrier `id` without waiting (the counterpart of named_barrier_sync on the same id). bar.arrive
// is the aligned form: __syncwarp() first reconverges the warp (synccheck reports no divergence at the
// kernels' arrive sites; the non-aligned barrier.arrive is untried).
JSMLA_DEVICE void named_barrier_arrive(int id, int thread_count) {
  __syncwarp();
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(thread_count) : "memory");
}

// A 32-bit read-only load that is not tied to later code by the compiler (see the file comment).
JSMLA_DEVICE int32_t load_global_nc(const int32_t* pointer) {
  int32_t value;
  asm volatile("ld.global.nc.s32 %0, [%1];\n" : "=r"(value) : "l"(pointer));
  return value;
}

JSMLA_DEVICE uint32_t load_global_u32(const void* pointer) {
  uint32_t value;
  asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(value) : "l"(pointer));
  return value;
}

// Four 8x8 b16 matrices; lane i gives the row address of matrix i/8, row i%8.
JSMLA_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(shared)));
}

JSMLA_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(shared)));
}

// Two 8x8 b16 matrices, transposed; lanes 0-15 give the row addresses (matrix i/8, row i%8).
JSMLA_DEVICE void ldmatrix_x2_trans(uint32_t (&r)[2], const void* shared) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_address(shared)));
}

// c += a(16x16, row-major bf16) * b(16x8, column-major bf16), fp32 accumulators.
JSMLA_DEVICE void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x; -inf gives 0. Relative error ~2^-22, far below the bf16 rounding of P.
JSMLA_DEVICE float fast_exp2(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Programmatic dependent launch (sm_90 and newer; no-ops on older targets). A grid calls
// allow_dependent_launch() to let the grid queued after it with the programmatic-serialization launch
// attribute start before it finishes; that grid calls wait_for_prerequisite_grid() before it reads
// anything the first one writes (it returns once the first grid has completed and its writes are visible).
JSMLA_DEVICE void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
JSMLA_DEVICE void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// The sum (maximum) of one value per lane of a full warp by a fixed butterfly: every lane gets the
// same bits, and the same bits on every run.
JSMLA_DEVICE float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}
JSMLA_DEVICE float warp_max(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

JSMLA_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

}  // namespace jsmla::cuda
